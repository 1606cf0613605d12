"""Note [One option table] (``lightning_swap/core/config.py``): every ``SwapConfig`` field reaches
the core from every entry point — the Lightning strategies, ``SwapPlugin`` in code, its
``ACCELERATE_CPU_SWAP_*`` variable, its YAML file, and ``accelerate-swap config`` — and the entry
points' option names are ``SwapConfig``'s fields plus their own, so a field added to the config
and forgotten in one entry point fails here (and at import)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields, replace
from typing import Any

import pytest
import yaml

import accelerate_swap.plugin as plugin_module
import lightning_swap.strategy as strategy_module
from accelerate_swap.cli import build_parser, main
from accelerate_swap.plugin import ENV_CONFIG, ENV_FLAG, OPTIONS, SwapPlugin, env_name
from lightning_swap import CPUSwapStrategy, DDPCPUSwapStrategy, SwapConfig
from lightning_swap.core import Action

#: field -> (value in code and in YAML, the same as text, what SwapConfig holds, other options
#: it needs). Every value differs from the default, so a dropped option is seen.
VALUES: dict[str, tuple[Any, str, Any, dict[str, tuple[Any, str]]]] = {
    "policy": ("offload", "offload", Action.OFFLOAD, {}),
    "segments": (["net.0", "net.1"], "net.0,net.1", ("net.0", "net.1"), {}),
    "min_offload_bytes": ("1KiB", "1KiB", 1024, {}),
    "budget_bytes": ("1GiB", "1GiB", 1 << 30, {}),
    "prefetch_segments": (2, "2", 2, {}),
    "inflight_segments": (3, "3", 3, {}),
    "prefetch_bytes": ("1MiB", "1MiB", 1 << 20, {}),
    "inflight_bytes": (0, "0", 0, {}),
    "log_plan": (False, "false", False, {}),
    "um": ("offload", "offload", "offload", {}),
    "um_max_bytes": ("1MiB", "1MiB", 1 << 20, {"um": ("offload", "offload")}),
}
#: Each entry point's options beside SwapConfig's fields.
STRATEGY_OWN = {"log_stats", "report"}
PLUGIN_OWN = {"log_stats"}
FIELDS = [f.name for f in fields(SwapConfig)]


def _strategy_config(strategy: Any) -> SwapConfig:
    """The options a strategy was given: its session's config, whose ``log_plan`` is off because
    the strategy logs the plan itself when its ``log_plan`` is on."""
    return replace(strategy.swap_config, log_plan=strategy.log_plan)


def _code(name: str) -> dict[str, Any]:
    value, _, _, needs = VALUES[name]
    return {name: value, **{k: v for k, (v, _) in needs.items()}}


def _text(name: str) -> dict[str, str]:
    _, text, _, needs = VALUES[name]
    return {name: text, **{k: t for k, (_, t) in needs.items()}}


def _cli_args(options: dict[str, str]) -> list[str]:
    argv = []
    for name, text in options.items():
        if isinstance(getattr(SwapConfig(), name), bool):  # a yes/no option: one flag turns its default over
            assert text == str(not getattr(SwapConfig(), name)).lower()
            argv.append(f"--no_{name}" if getattr(SwapConfig(), name) else f"--{name}")
        else:
            argv += [f"--{name}", text]
    return argv


def test_the_table_covers_every_field_with_a_value_that_is_not_the_default():
    assert set(VALUES) == set(FIELDS)
    default = SwapConfig()
    for name, (_, _, expected, _) in VALUES.items():
        assert getattr(default, name) != expected, name


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_through_every_entry_point(name, tmp_path, capsys):
    expected = VALUES[name][2]
    configs = {
        "CPUSwapStrategy": _strategy_config(CPUSwapStrategy(**_code(name))),
        "DDPCPUSwapStrategy": _strategy_config(DDPCPUSwapStrategy(**_code(name))),
        "SwapPlugin": SwapPlugin(**_code(name)).to_config(),
        "environment": SwapPlugin.from_env({ENV_FLAG: "true", **{env_name(k): t for k, t in _text(name).items()}}).to_config(),
    }
    path = tmp_path / "swap.yaml"
    path.write_text(yaml.safe_dump({"enabled": True, **_code(name)}))
    configs["YAML file"] = SwapPlugin.from_env({ENV_CONFIG: str(path)}).to_config()
    written = tmp_path / "cli.yaml"
    assert main(["config", "--config_file", str(written), *_cli_args(_text(name))]) == 0
    capsys.readouterr()
    configs["accelerate-swap config"] = SwapPlugin.from_env({ENV_CONFIG: str(written)}).to_config()
    for entry, config in configs.items():
        assert getattr(config, name) == expected, entry
        # ...and nothing else moved off its default (the option reached its own field).
        others = {f for f in FIELDS if f != name and f not in VALUES[name][3]}
        assert {f: getattr(config, f) for f in others} == {f: getattr(SwapConfig(), f) for f in others}, entry


# -- the names agree ----------------------------------------------------------------------
def _entry_point_options() -> dict[str, tuple[set[str], set[str]]]:
    """entry point -> (its option names, the names it must have besides SwapConfig's fields)."""
    config_parser = build_parser()._subparsers._group_actions[0].choices["config"]
    flags = {a.dest for a in config_parser._actions} - {"help", "config_file", "disabled"}
    cli = {d.removeprefix("no_") if d.startswith("no_") else d for d in flags}
    out = {}
    for cls in (CPUSwapStrategy, DDPCPUSwapStrategy):
        params = inspect.signature(cls.__init__).parameters
        out[cls.__name__] = (set(params) - {"self", "strategy_kwargs"}, STRATEGY_OWN)
    out["SwapPlugin fields"] = ({f.name for f in fields(SwapPlugin)}, PLUGIN_OWN)
    out["plugin OPTIONS (variables, YAML keys)"] = (set(OPTIONS), PLUGIN_OWN)
    out["accelerate-swap config flags"] = (cli, PLUGIN_OWN)
    return out


@pytest.mark.parametrize("entry", list(_entry_point_options()))
def test_entry_point_names_are_swapconfig_fields_plus_its_own(entry):
    names, own = _entry_point_options()[entry]
    assert names == set(FIELDS) | own


def test_entry_point_defaults_are_swapconfig_defaults():
    default = SwapConfig()
    params = inspect.signature(CPUSwapStrategy.__init__).parameters
    plugin = SwapPlugin()
    for name in FIELDS:
        assert params[name].default == getattr(default, name), name
        assert getattr(plugin, name) == getattr(default, name), name


@dataclass(frozen=True, kw_only=True)
class _GrownConfig(SwapConfig):
    """SwapConfig with one more option, which no entry point knows."""

    spill_segments: int = 0


@pytest.mark.parametrize("module", [strategy_module, plugin_module], ids=["strategy", "plugin"])
def test_a_field_missing_from_an_entry_point_fails_at_import(module, monkeypatch):
    module._check_option_table()  # the real table agrees
    monkeypatch.setattr(module, "SwapConfig", _GrownConfig)
    with pytest.raises(TypeError, match=r"missing \['spill_segments'\]"):
        module._check_option_table()
