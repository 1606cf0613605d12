"""``SwapPlugin``: reading ``ACCELERATE_CPU_SWAP*`` and the config file (every invalid value
names its variable or key and what is allowed), and ``accelerate-swap config``."""

from __future__ import annotations

import shlex

import pytest
import torchvision

from accelerate_swap import Action, SwapPlugin
from accelerate_swap.cli import main
from lightning_swap.core.runtime import DEFAULT_MIN_OFFLOAD_BYTES

from .models import ConvBlock

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
    assert SwapPlugin.from_env().policy == "recompute"
    monkeypatch.delenv("ACCELERATE_CPU_SWAP")
    assert SwapPlugin.from_env() is None


# -- each option from the environment ------------------------------------------------------
@pytest.mark.parametrize(
    ("variable", "value", "field", "expected"),
    [
        ("POLICY", "offload", "policy", "offload"),
        ("POLICY", " Recompute_Offload ", "policy", "Recompute_Offload"),
        ("POLICY", "blocks.0=offload, blocks.2=RECOMPUTE", "policy", {"blocks.0": "offload", "blocks.2": "RECOMPUTE"}),
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
        ("PREFETCH_SEGMENTS", "2", "prefetch_segments", 2),
        ("PREFETCH_SEGMENTS", "none", "prefetch_segments", None),
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
        ("ACCELERATE_CPU_SWAP_POLICY", "swap", "allowed: an Action or one of 'keep'"),
        ("ACCELERATE_CPU_SWAP_POLICY", "Auto", "does not support yet; allowed: one of 'keep'"),
        ("ACCELERATE_CPU_SWAP_POLICY", "blocks.0=nope", r"policy\['blocks.0'\]. got 'nope'; allowed"),
        ("ACCELERATE_CPU_SWAP_POLICY", "blocks.0=offload,=recompute", "allowed: one of keep, offload"),
        ("ACCELERATE_CPU_SWAP_POLICY", ",", "allowed: an Action or one of 'keep'"),
        ("ACCELERATE_CPU_SWAP_SEGMENTS", ",", "allowed: none .find repeated blocks."),
        ("ACCELERATE_CPU_SWAP_SEGMENTS", "no_such_module:Block", "cannot be imported"),
        ("ACCELERATE_CPU_SWAP_SEGMENTS", "tests.models:NoSuchBlock", "cannot be imported"),
        ("ACCELERATE_CPU_SWAP_SEGMENTS", "tests.models:mlp_block", "not a class"),
        ("ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES", "-1", "must be an int >= 0"),
        ("ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES", "none", "allowed: an integer number of bytes"),
        ("ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES", "12 parsecs", "allowed: an integer number of bytes"),
        ("ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES", "1.5", "allowed: an integer number of bytes"),
        ("ACCELERATE_CPU_SWAP_BUDGET_BYTES", "0", "must be a positive int"),
        ("ACCELERATE_CPU_SWAP_BUDGET_BYTES", "lots", r"allowed: an integer number of bytes.*or none"),
        ("ACCELERATE_CPU_SWAP_BUDGET_BYTES", "12G", "allowed: an integer number of bytes"),
        ("ACCELERATE_CPU_SWAP_PREFETCH_SEGMENTS", "-2", "must be an int >= 0"),
        ("ACCELERATE_CPU_SWAP_PREFETCH_SEGMENTS", "two", "allowed: an integer >= 0, or none"),
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
        "min_offload_bytes: 1KiB\nbudget_bytes: 1073741824\nprefetch_segments: 1\nlog_plan: false\nlog_stats: no\n",
    )
    plugin = SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": path})
    assert plugin == SwapPlugin(
        policy={"blocks.0": "offload", "blocks.1": "recompute"},
        segments=("blocks.0", "blocks.1"),
        min_offload_bytes=1024,
        budget_bytes=1 << 30,
        prefetch_segments=1,
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
    assert plugin.policy == "selective" and plugin.budget_bytes == 1 << 30
    assert SwapPlugin.from_env({**env, "ACCELERATE_CPU_SWAP": "false"}) is None
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": off}) is None
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": off, **ON}).policy == "offload"
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": silent}) is None  # the switch is never implied
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": silent, **ON}).policy == "recompute"
    assert SwapPlugin.from_env({"ACCELERATE_CPU_SWAP_CONFIG": _yaml(tmp_path, "", "empty.yaml"), **ON}) == SwapPlugin()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("policy: [offload\n", "not valid YAML"),
        ("- offload\n", "must hold a mapping of option: value; got list"),
        ("enabled: true\npolcy: offload\n", r"unknown keys \['polcy'\]; allowed: enabled, policy, segments"),
        ("enabled: maybe\n", "swap.yaml: enabled. got 'maybe'; allowed: true or false"),
        ("enabled: true\npolicy: swap\n", r"swap.yaml: policy. got 'swap': .policy. got 'swap'; allowed: an Action"),
        ("enabled: true\npolicy: {blocks.0: nope}\n", r"swap.yaml: policy.*allowed: an Action"),
        ("enabled: true\npolicy: 3\n", r"swap.yaml: policy. got 3; allowed: one of keep"),
        ("enabled: true\nsegments: blocks.0\n", None),  # a string is a one-item list: valid
        ("enabled: true\nsegments: {a: 1}\n", r"swap.yaml: segments. got \{'a': 1\}; allowed: none"),
        ("enabled: true\nsegments: [blocks.0, 3]\n", r"swap.yaml: segments.*allowed: none"),
        ("enabled: true\nmin_offload_bytes: -5\n", r"swap.yaml: min_offload_bytes. got -5: .min_offload_bytes. must be an int >= 0"),
        ("enabled: true\nmin_offload_bytes: 1.5\n", r"swap.yaml: min_offload_bytes. got 1.5; allowed: an integer number of bytes"),
        ("enabled: true\nbudget_bytes: 0\n", r"swap.yaml: budget_bytes. got 0: .budget_bytes. must be a positive int"),
        ("enabled: true\nbudget_bytes: true\n", r"swap.yaml: budget_bytes. got True; allowed: an integer number of bytes"),
        ("enabled: true\nprefetch_segments: -1\n", r"swap.yaml: prefetch_segments. got -1: .prefetch_segments. must be an int >= 0"),
        ("enabled: true\nprefetch_segments: 1.0\n", r"swap.yaml: prefetch_segments. got 1.0; allowed: an integer >= 0"),
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
        ({"policy": "auto"}, "policy"),
        ({"policy": {"blocks.0": "nope"}}, "policy"),
        ({"segments": []}, "segments"),
        ({"min_offload_bytes": -1}, "min_offload_bytes"),
        ({"budget_bytes": 0}, "budget_bytes"),
        ({"prefetch_segments": -1}, "prefetch_segments"),
        ({"log_stats": "yes"}, "log_stats"),
    ],
)
def test_plugin_in_code_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}") as err:
        SwapPlugin(**kwargs)
    assert "allowed" in str(err.value) or "must be" in str(err.value)
    if kwargs.get("policy") == "swap":  # no hint at 'auto', which the plugin refuses
        assert "auto" not in str(err.value)


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
        SwapPlugin(policy={"layer1.0": "offload", "layer2.0": Action.SELECTIVE}, segments=[ConvBlock, "layer4"], prefetch_segments=2, min_offload_bytes=0),
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
    assert main(["config", "--config_file", str(tmp_path / "bad.yaml"), "--policy", "auto"]) == 2
    err = capsys.readouterr().err
    assert "`--policy` got 'auto'" in err and "allowed" in err
    assert not (tmp_path / "bad.yaml").exists()
    assert main(["config", "--config_file", str(tmp_path / "bad.yaml"), "--budget_bytes", "-3"]) == 2
    assert "`--budget_bytes` got '-3'" in capsys.readouterr().err
    assert main([]) == 1
