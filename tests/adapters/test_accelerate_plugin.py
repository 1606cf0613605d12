"""``SwapPlugin``: reading ``ACCELERATE_CPU_SWAP*`` and the config file (every invalid value
names its variable or key and what is allowed), and ``accelerate-swap config``."""

from __future__ import annotations

import re
import shlex

import pytest
import torchvision

from accelerate_swap import Action, SwapPlugin
from accelerate_swap.cli import main
from lightning_swap.core import InfeasibleBudgetError, solve
from lightning_swap.core.config import DEFAULT_MIN_OFFLOAD_BYTES

from ..models import ConvBlock, cnn_bn_dropout

ON = {"ACCELERATE_CPU_SWAP": "true"}


def _yaml(tmp_path, text, name="swap.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- the switch ---------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["true", "TRUE", "1", "yes", "on", " y "])
def test_switch_on(flag):
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP": flag}) == SwapPlugin()


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"ACCELERATE_CPU_SWAP": "false"},
        {"ACCELERATE_CPU_SWAP": "0"},
        # off: nothing else is read or validated (Note [Where the options come from])
        {"ACCELERATE_CPU_SWAP": "off", "ACCELERATE_CPU_SWAP_POLICY": "nonsense", "ACCELERATE_CPU_SWAP_TYPO": "1"},
        {"ACCELERATE_CPU_SWAP": "no", "ACCELERATE_CPU_SWAP_CONFIG": "/does/not/exist.yaml"},
        {"ACCELERATE_CPU_SWAP_POLICY": "offload"},  # options without the switch
        {"UNRELATED": "x"},
    ],
)
def test_switch_off(env):
    assert SwapPlugin.from_env(env) is None


def test_default_environ_is_os_environ(monkeypatch):
    monkeypatch.setenv("ACCELERATE_CPU_SWAP", "true")
    monkeypatch.setenv("ACCELERATE_CPU_SWAP_POLICY", "recompute")
    assert SwapPlugin.from_env().policy is Action.RECOMPUTE
    monkeypatch.delenv("ACCELERATE_CPU_SWAP")
    assert SwapPlugin.from_env() is None


# -- each option from the environment ------------------------------------------------------
@pytest.mark.parametrize(
    ("variable", "value", "field", "expected"),
    [
        # the policy parsed once, by the core (lightning_swap.core.actions.parse_policy), as in code
        ("POLICY", "offload", "policy", Action.OFFLOAD),
        ("POLICY", " Auto ", "policy", "auto"),
        ("POLICY", " Recompute_Offload ", "policy", Action.RECOMPUTE_OFFLOAD),
        ("POLICY", "blocks.0=offload, blocks.2=RECOMPUTE", "policy", {"blocks.0": Action.OFFLOAD, "blocks.2": Action.RECOMPUTE}),
        ("SEGMENTS", "blocks.0, blocks.2", "segments", ("blocks.0", "blocks.2")),
        ("SEGMENTS", "tests.models:ConvBlock", "segments", (ConvBlock,)),
        ("SEGMENTS", "torchvision.models.resnet:Bottleneck,layer4", "segments", (torchvision.models.resnet.Bottleneck, "layer4")),
        ("SEGMENTS", "none", "segments", None),
        ("MIN_OFFLOAD_BYTES", "0", "min_offload_bytes", 0),
        ("MIN_OFFLOAD_BYTES", "64KiB", "min_offload_bytes", 65536),
        ("MIN_OFFLOAD_BYTES", "1_000", "min_offload_bytes", 1000),
        ("BUDGET_BYTES", "12GiB", "budget_bytes", 12 << 30),
        ("BUDGET_BYTES", "1.5 MiB", "budget_bytes", 3 << 19),
        ("BUDGET_BYTES", "2GB", "budget_bytes", 2 * 10**9),
        ("BUDGET_BYTES", "123456", "budget_bytes", 123456),
        ("BUDGET_BYTES", "None", "budget_bytes", None),
        ("PREFETCH_BYTES", "2MiB", "prefetch_bytes", 2 << 20),
        ("PREFETCH_BYTES", "none", "prefetch_bytes", None),
        ("LOG_PLAN", "false", "log_plan", False),
        ("LOG_STATS", "0", "log_stats", False),
    ],
)
def test_option_from_env(variable, value, field, expected):
    plugin = SwapPlugin.from_env({**ON, f"ACCELERATE_CPU_SWAP_{variable}": value})
    assert getattr(plugin, field) == expected
    assert plugin.to_config() is not None  # the core accepts it


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [
        ("ACCELERATE_CPU_SWAP", "maybe", "allowed: true or false"),
        ("ACCELERATE_CPU_SWAP", "", "allowed: true or false"),
        ("ACCELERATE_CPU_SWAP_POLICY", "swap", "allowed: 'auto' .*an Action or one of 'keep'"),
        ("ACCELERATE_CPU_SWAP_POLICY", "blocks.0=nope", r"\['blocks.0'\]. got 'nope'; allowed: an Action or one of 'keep'"),
        ("ACCELERATE_CPU_SWAP_POLICY", "blocks.0=offload,=recompute", "got 'blocks.0=offload,=recompute'; allowed: 'auto' .*'segment.name=action"),
        ("ACCELERATE_CPU_SWAP_POLICY", ",", "allowed: 'auto' .*an Action or one of 'keep'"),
        ("ACCELERATE_CPU_SWAP_SEGMENTS", ",", "allowed: none .find repeated blocks."),
        ("ACCELERATE_CPU_SWAP_SEGMENTS", "no_such_module:Block", "cannot be imported"),
        ("ACCELERATE_CPU_SWAP_SEGMENTS", "tests.models:NoSuchBlock", "cannot be imported"),
        ("ACCELERATE_CPU_SWAP_SEGMENTS", "tests.models:mlp_block", "not a class"),
        ("ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES", "-1", "negative; allowed: an int number of bytes.*at least 0 bytes\\.$"),
        ("ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES", "none", "not a size; allowed: an int number of bytes"),
        ("ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES", "12 parsecs", "not a size; allowed: an int number of bytes"),
        ("ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES", "1.5", "not a whole number of bytes; allowed: an int number of bytes"),
        ("ACCELERATE_CPU_SWAP_BUDGET_BYTES", "0", "below the minimum of 1; allowed: .*at least 1 byte"),
        ("ACCELERATE_CPU_SWAP_BUDGET_BYTES", "lots", r"allowed: an int number of bytes.*KiB/MiB/GiB/TiB.*or None"),
        ("ACCELERATE_CPU_SWAP_BUDGET_BYTES", "12G", "not a size; allowed: an int number of bytes"),
        ("ACCELERATE_CPU_SWAP_BUDGET_BYTES", "0.8", "not a whole number of bytes.*for 80% of a GPU pass int"),
        ("ACCELERATE_CPU_SWAP_UM_MAX_BYTES", "-1MiB", "negative; allowed: an int number of bytes"),
        ("ACCELERATE_CPU_SWAP_PREFETCH_BYTES", "-2", "negative; allowed: an int number of bytes"),
        ("ACCELERATE_CPU_SWAP_PREFETCH_BYTES", "two", "not a size; allowed: an int number of bytes"),
        ("ACCELERATE_CPU_SWAP_PREFETCH_SEGMENTS", "1", "known variables: .*ACCELERATE_CPU_SWAP_PREFETCH_BYTES"),  # windows are bytes
        ("ACCELERATE_CPU_SWAP_LOG_PLAN", "maybe", "allowed: true or false"),
        ("ACCELERATE_CPU_SWAP_LOG_STATS", "2", "allowed: true or false"),
        ("ACCELERATE_CPU_SWAP_BUDGET", "1GiB", "known variables: ACCELERATE_CPU_SWAP_CONFIG, ACCELERATE_CPU_SWAP_POLICY"),
        ("ACCELERATE_CPU_SWAP_CONFIG", "/does/not/exist.yaml", "cannot read the config file"),
    ],
)
def test_invalid_env_names_the_variable(variable, value, allowed):
    with pytest.raises(ValueError, match=f"`{variable}.*{allowed}"):
        SwapPlugin.from_env({**ON, variable: value})


# -- the config file -----------------------------------------------------------------------
def test_config_file(tmp_path):
    path = _yaml(
        tmp_path,
        "enabled: true\npolicy:\n  blocks.0: offload\n  blocks.1: recompute\nsegments: [blocks.0, blocks.1]\n"
        "min_offload_bytes: 1KiB\nbudget_bytes: 1073741824\nprefetch_bytes: 1MiB\nlog_plan: false\nlog_stats: no\n",
    )
    plugin = SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": path})
    assert plugin == SwapPlugin(
        policy={"blocks.0": "offload", "blocks.1": "recompute"},
        segments=("blocks.0", "blocks.1"),
        min_offload_bytes=1024,
        budget_bytes=1 << 30,
        prefetch_bytes=1 << 20,
        log_plan=False,
        log_stats=False,
    )
    assert SwapPlugin.from_yaml(path) == plugin


def test_precedence_env_over_file(tmp_path):
    on = _yaml(tmp_path, "enabled: true\npolicy: offload\nbudget_bytes: 1GiB\n", "on.yaml")
    off = _yaml(tmp_path, "enabled: false\npolicy: offload\n", "off.yaml")
    silent = _yaml(tmp_path, "policy: recompute\n", "silent.yaml")
    env = {"ACCELERATE_CPU_SWAP_CONFIG": on, "ACCELERATE_CPU_SWAP_POLICY": "selective"}
    plugin = SwapPlugin.from_env(env)
    assert plugin.policy is Action.SELECTIVE and plugin.budget_bytes == 1 << 30
    assert SwapPlugin.from_env({**env, "ACCELERATE_CPU_SWAP": "false"}) is None
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": off}) is None
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": off, **ON}).policy is Action.OFFLOAD
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": silent}) is None  # the switch is never implied
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": silent, **ON}).policy is Action.RECOMPUTE
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": _yaml(tmp_path, "", "empty.yaml"), **ON}) == SwapPlugin()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("policy: [offload\n", "not valid YAML"),
        ("- offload\n", "must hold a mapping of option: value; got list"),
        ("enabled: true\npolcy: offload\n", r"unknown keys \['polcy'\]; allowed: enabled, policy, segments"),
        ("enabled: maybe\n", "swap.yaml: enabled. got 'maybe'; allowed: true or false"),
        ("enabled: true\npolicy: swap\n", r"swap.yaml: policy. got 'swap'; allowed: 'auto' .*an Action"),
        ("enabled: true\npolicy: {blocks.0: nope}\n", r"swap.yaml: policy.*allowed: an Action"),
        ("enabled: true\npolicy: 3\n", r"swap.yaml: policy. got 3; allowed: 'auto' .*one of 'keep'"),
        ("enabled: true\nsegments: blocks.0\n", None),  # a string is a one-item list: valid
        ("enabled: true\nsegments: {a: 1}\n", r"swap.yaml: segments. got \{'a': 1\}; allowed: none"),
        ("enabled: true\nsegments: [blocks.0, 3]\n", r"swap.yaml: segments.*allowed: none"),
        ("enabled: true\nmin_offload_bytes: -5\n", r"swap.yaml: min_offload_bytes. got -5: negative; allowed: an int number of bytes"),
        ("enabled: true\nmin_offload_bytes: 1.5\n", r"swap.yaml: min_offload_bytes. got 1.5: not a whole number of bytes; allowed"),
        ("enabled: true\nbudget_bytes: 0\n", r"swap.yaml: budget_bytes. got 0: below the minimum of 1; allowed"),
        ("enabled: true\nbudget_bytes: true\n", r"swap.yaml: budget_bytes. got True: a bool is not a size; allowed: an int number of bytes"),
        ("enabled: true\nprefetch_bytes: -1\n", r"swap.yaml: prefetch_bytes. got -1: negative; allowed: an int number of bytes"),
        ("enabled: true\nprefetch_segments: 1\n", r"unknown keys \['prefetch_segments'\]; allowed: .*prefetch_bytes"),
        ("enabled: true\nlog_stats: sometimes\n", r"swap.yaml: log_stats. got 'sometimes'; allowed: true or false"),
    ],
)
def test_invalid_file_names_the_key(tmp_path, text, message):
    env = {"ACCELERATE_CPU_SWAP_CONFIG": _yaml(tmp_path, text), **ON}
    if message is None:
        assert SwapPlugin.from_env(env).segments == ("blocks.0",)
        return
    with pytest.raises(ValueError, match=message):
        SwapPlugin.from_env(env)


# -- in code ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"policy": "swap"}, "policy"),
        ({"policy": {"blocks.0": "nope"}}, "policy"),
        ({"segments": []}, "segments"),
        ({"min_offload_bytes": -1}, "min_offload_bytes"),
        ({"budget_bytes": 0}, "budget_bytes"),
        ({"prefetch_bytes": -1}, "prefetch_bytes"),
        ({"log_stats": "yes"}, "log_stats"),
    ],
)
def test_plugin_in_code_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}") as err:
        SwapPlugin(**kwargs)
    assert "allowed" in str(err.value) or "must be" in str(err.value)
    if kwargs.get("policy") == "swap":  # the planner is offered too
        assert "'auto'" in str(err.value)


def test_auto_is_the_default_policy():
    """Switched on with no options, the planner decides; without a budget on CPU it keeps every
    segment (tests/adapters/test_accelerate.py), as the Lightning strategy does."""
    assert SwapPlugin().policy == "auto" and SwapPlugin().to_config().is_auto
    assert SwapPlugin.from_env(ON).to_config().is_auto
    assert SwapPlugin(policy=" AUTO ").to_config().is_auto
    assert SwapPlugin().to_dict()["policy"] == "auto"
    assert SwapPlugin(policy="keep").to_env()["ACCELERATE_CPU_SWAP_POLICY"] == "keep"  # no longer the default
    assert "ACCELERATE_CPU_SWAP_POLICY" not in SwapPlugin(budget_bytes=1 << 30).to_env()


def test_plugin_is_frozen_and_keyword_only():
    plugin = SwapPlugin(policy=Action.OFFLOAD)
    with pytest.raises(AttributeError):
        plugin.policy = "keep"
    with pytest.raises(TypeError):
        SwapPlugin("offload")
    assert plugin.to_config().policy is Action.OFFLOAD
    assert plugin.to_config().min_offload_bytes == DEFAULT_MIN_OFFLOAD_BYTES


@pytest.mark.parametrize(
    "plugin",
    [
        SwapPlugin(),
        SwapPlugin(policy=Action.RECOMPUTE, budget_bytes=3 << 30, log_stats=False),
        SwapPlugin(policy="keep"),
        SwapPlugin(policy="auto", budget_bytes=12 << 30),
        SwapPlugin(policy={"layer1.0": "offload", "layer2.0": Action.SELECTIVE}, segments=[ConvBlock, "layer4"], prefetch_bytes=2 << 20, min_offload_bytes=0),
    ],
)
def test_env_and_file_round_trip(tmp_path, plugin):
    assert SwapPlugin.from_env(plugin.to_env()).to_dict() == plugin.to_dict()
    import yaml

    path = _yaml(tmp_path, yaml.safe_dump({"enabled": True, **plugin.to_dict()}))
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": path}).to_dict() == plugin.to_dict()


# -- accelerate-swap config ---------------------------------------------------------------
def test_cli_config_writes_file_and_env_line(tmp_path, capsys):
    target = tmp_path / "project" / "swap.yaml"
    argv = ["config", "--config_file", str(target), "--policy", "blocks.0=offload,blocks.1=recompute"]
    argv += ["--budget-bytes", "2GiB", "--segments", "tests.models:ConvBlock", "--no_log_stats"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    expected = SwapPlugin(
        policy={"blocks.0": "offload", "blocks.1": "recompute"}, budget_bytes=2 << 30, segments=[ConvBlock], log_stats=False
    )
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": str(target)}).to_dict() == expected.to_dict()
    lines = [line.strip() for line in out.splitlines()]
    with_file = next(line for line in lines if line.startswith("ACCELERATE_CPU_SWAP_CONFIG="))
    assert with_file == f"ACCELERATE_CPU_SWAP_CONFIG={target} accelerate launch your_script.py"
    inline = next(line for line in lines if line.startswith("ACCELERATE_CPU_SWAP=true"))
    env = dict(word.split("=", 1) for word in shlex.split(inline) if "=" in word and word.startswith("ACCELERATE"))
    assert SwapPlugin.from_env(env).to_dict() == expected.to_dict()


def test_cli_config_disabled_and_errors(tmp_path, capsys):
    target = tmp_path / "swap.yaml"
    assert main(["config", "--config_file", str(target), "--disabled"]) == 0
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": str(target)}) is None
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": str(target), **ON}) == SwapPlugin()
    capsys.readouterr()
    assert main(["config", "--config_file", str(tmp_path / "bad.yaml"), "--policy", "swap"]) == 2
    err = capsys.readouterr().err
    assert "`--policy` got 'swap'" in err and "allowed" in err
    assert not (tmp_path / "bad.yaml").exists()
    assert main(["config", "--config_file", str(tmp_path / "bad.yaml"), "--budget_bytes", "-3"]) == 2
    assert "`--budget_bytes` got '-3'" in capsys.readouterr().err
    assert main([]) == 1


def test_cli_config_auto(tmp_path, capsys):
    target = tmp_path / "swap.yaml"
    assert main(["config", "--config_file", str(target), "--policy", "auto", "--budget_bytes", "2GiB"]) == 0
    plugin = SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": str(target)})
    assert plugin.to_config().is_auto and plugin.budget_bytes == 2 << 30


# -- accelerate-swap estimate -------------------------------------------------------------
def _largest(out: str) -> int:
    return int(re.search(r"Largest batch for .*?: (\d+), plan", out).group(1))


@pytest.mark.slow
def test_cli_estimate_factory_model(capsys):
    from accelerate_swap.estimate import estimate

    argv = ["estimate", "--model", "tests.models:cnn_bn_dropout", "--input_shape", "3,16,16", "--batch-size", "8"]
    assert main([*argv, "--budget", "4MiB", "--margin", "0"]) == 0
    out = capsys.readouterr().out
    assert "`tests.models:cnn_bn_dropout`, input (8, 3, 16, 16) float32" in out
    assert "Plan at batch 8 for a budget of 4.0 MiB" in out and "blocks.3" in out
    largest = _largest(out)
    # exactly the largest batch the planner predicts to fit: the next one has no plan
    prof = estimate(cnn_bn_dropout(), batch_size=8, input_shape=(3, 16, 16)).profile
    solve(prof, budget_bytes=4 << 20, batch_size=largest)
    with pytest.raises(InfeasibleBudgetError):
        solve(prof, budget_bytes=4 << 20, batch_size=largest + 1)
    assert largest > 8
    # a single forced action plans less freely: never a larger batch
    assert main([*argv, "--budget", "4MiB", "--margin", "0", "--policy", "keep"]) == 0
    out = capsys.readouterr().out
    assert _largest(out) < largest and "offload" not in out.split("Largest batch")[1]


@pytest.mark.slow
def test_cli_estimate_torchvision_model(capsys):
    assert main(["estimate", "resnet18", "--image-size", "32", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "input (4, 3, 32, 32) float32" in out and "8 segments" in out and "Give --budget" in out
    assert main(["estimate", "resnet18", "--image-size", "32", "--batch-size", "4", "--budget", "10MiB"]) == 0
    out = capsys.readouterr().out  # less than the parameters, gradients and input need: nothing fits
    assert "Batch 4 does not fit 10.0 MiB with any plan" in out and "No batch in [1, 8192] fits" in out


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        ([], "--model"),
        (["resnet18", "--model", "tests.models:cnn_bn_dropout"], "--model"),
        (["resnet5"], "model_name"),
        (["--model", "tests.models:NoSuchFactory"], "--model"),
        (["--model", "tests.models:ConvBlock"], "--model"),  # needs arguments
        (["--model", "tests.models:_images"], "--model"),
        (["resnet18", "--batch_size", "0"], "--batch_size"),
        (["resnet18", "--batch-size", "x"], "--batch_size"),
        (["resnet18", "--image_size", "-1"], "--image_size"),
        (["resnet18", "--input_shape", "3,x"], "--input_shape"),
        (["resnet18", "--input_dtype", "int8"], "--input_dtype"),
        (["resnet18", "--budget", "lots"], "--budget"),
        (["resnet18", "--policy", "swap"], "--policy"),
        (["resnet18", "--policy", "layer1.0=offload"], "--policy"),
        (["resnet18", "--margin", "1.5"], "--margin"),
        (["resnet18", "--max_batch_size", "0"], "--max_batch_size"),
    ],
)
def test_cli_estimate_bad_arguments(argv, flag, capsys):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accelerate-swap estimate: error:") and f"`{flag}" in err
