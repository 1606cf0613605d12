"""The Accelerate plugin's options, and where they come from: code, environment, or a file.

Accelerate's own config loader rejects unknown keys and has no registry for third-party
plugins, so this plugin follows the convention of Accelerate's dynamo and FSDP plugins: it
reads ``ACCELERATE_*`` environment variables, which ``accelerate launch`` passes through to
every process.

- ``ACCELERATE_CPU_SWAP``: the switch (``true``/``false``, and the other spellings
  Accelerate's ``str_to_bool`` accepts).
- ``ACCELERATE_CPU_SWAP_<OPTION>``: one option, for each of ``SwapPlugin``'s fields (Note [One
  option table]), e.g. ``ACCELERATE_CPU_SWAP_POLICY=offload``, ``ACCELERATE_CPU_SWAP_BUDGET_BYTES=12GiB``,
  ``ACCELERATE_CPU_SWAP_UM=all``.
- ``ACCELERATE_CPU_SWAP_CONFIG``: a YAML file with the same keys in lower case
  (``policy: offload``) plus ``enabled: true`` (the switch). ``accelerate-swap config``
  writes one.

Note [Where the options come from]: a ``SwapPlugin`` given in code wins outright (the
environment is not read). Otherwise an option set in the environment overrides the same key
in the file, which overrides the default. The switch is ``ACCELERATE_CPU_SWAP`` when it is
set, else the file's ``enabled``, else off. When the switch is off nothing else is read or
validated, so the accelerator is exactly Accelerate's; a switch that is neither true nor
false is an error, since neither reading of it is safe. Any other ``ACCELERATE_CPU_SWAP_*``
variable, or key in the file, is an error listing the known ones, so a misspelt option
cannot be silently ignored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from lightning_swap.core import SwapConfig
from lightning_swap.core import check_bool, describe_options, from_text, option, parse_bool

__all__ = ["ENV_CONFIG", "ENV_FLAG", "ENV_PREFIX", "FILE_FLAG", "OPTIONS", "SwapPlugin", "env_name", "parse_option"]

log = logging.getLogger(__name__)

ENV_FLAG = "ACCELERATE_CPU_SWAP"
ENV_PREFIX = "ACCELERATE_CPU_SWAP_"
ENV_CONFIG = "ACCELERATE_CPU_SWAP_CONFIG"
#: The switch's key in a config file.
FILE_FLAG = "enabled"


def env_name(option: str) -> str:
    """The environment variable holding ``option`` (``"budget_bytes"`` -> ``ACCELERATE_CPU_SWAP_BUDGET_BYTES``)."""
    return ENV_PREFIX + option.upper()


@dataclass(frozen=True, kw_only=True)
class SwapPlugin(SwapConfig):
    """Switches an :class:`~accelerate_swap.SwapAccelerator` on: ``SwapConfig``'s options (the
    Lightning ``"cpu_swap"`` strategy's) and the plugin's own ``log_stats`` (Note [One option table]).

    Build it in code, or let :meth:`from_env` read it from ``ACCELERATE_CPU_SWAP*`` variables
    and the config file (Note [Where the options come from]). With ``policy="auto"`` the first
    training forward is observed (Note [Auto policy in Accelerate]); ``um="all"`` is installed
    when the accelerator is built, so build it before moving anything to the GPU.
    """

    log_stats: bool = option(
        True, "send each step's statistics to ``accelerator.log`` (``swap/...`` keys) when trackers are set up (default on).",
        check=check_bool, text=parse_bool,
    )

    # -- reading -------------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["SwapPlugin"]:
        """The plugin the environment asks for, or ``None`` when the switch is off.

        ``environ`` defaults to ``os.environ``.
        """
        env = os.environ if environ is None else environ
        flag = env.get(ENV_FLAG)
        if flag is not None and not parse_bool(flag, ENV_FLAG):
            return None
        path = env.get(ENV_CONFIG)
        enabled, options = _read_file(path) if path else (None, {})
        if flag is None and not enabled:
            return None
        for key in sorted(env):
            if not key.startswith(ENV_PREFIX) or key == ENV_CONFIG:
                continue
            option = key[len(ENV_PREFIX):].lower()
            if option not in OPTIONS:
                known = ", ".join([ENV_CONFIG, *(env_name(o) for o in OPTIONS)])
                raise ValueError(f"`{key}` is not an option of the Accelerate swap plugin; known variables: {known}.")
            options[option] = parse_option(option, env[key], key)
        try:
            plugin = cls(**options)
        except ValueError as err:  # a rule across options (each was checked alone above)
            sources = ", ".join(env_name(o) for o in options if env_name(o) in env) or ENV_CONFIG
            raise ValueError(f"The swap plugin's settings ({sources}) do not go together: {err}") from err
        log.debug("swap plugin from the environment: %s", plugin)
        return plugin

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "SwapPlugin":
        """The options in a config file (its ``enabled`` key is not consulted)."""
        _, options = _read_file(os.fspath(path))
        return cls(**options)

    # -- writing -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every option as plain YAML values (what a config file holds, ``enabled`` aside)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def to_env(self) -> dict[str, str]:
        """The switch and every option that differs from its default, as environment variables."""
        env = {ENV_FLAG: "true"}
        defaults = SwapPlugin().to_dict()
        for name, value in self.to_dict().items():
            if value == defaults[name]:
                continue
            if isinstance(value, Mapping):
                text = ",".join(f"{k}={v}" for k, v in value.items())
            elif isinstance(value, list):
                text = ",".join(value)
            else:
                text = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            env[env_name(name)] = text
        return env


#: Every option's name: ``SwapPlugin``'s fields, hence its variables, file keys and CLI flags.
OPTIONS = tuple(f.name for f in fields(SwapPlugin))
SwapPlugin.__doc__ += "\n    Options:\n" + describe_options(SwapPlugin, "        ") + "\n"


def _plain(value: Any) -> Any:
    """A value as YAML holds it: an enum's value, a class as ``package.module:ClassName``."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, type):
        return f"{value.__module__}:{value.__qualname__}"
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def parse_option(option: str, raw: Any, source: str) -> Any:
    """Parse ``raw`` (text, or a YAML value) for ``option`` and check it alone, so an error
    names ``source`` (a variable, a file key, a command-line flag) and the allowed values."""
    return from_text(next(f for f in fields(SwapPlugin) if f.name == option), raw, source)


def _read_file(path: str) -> tuple[Optional[bool], dict[str, Any]]:
    """The switch (``None`` when the file does not say) and the options in a config file."""
    import yaml

    source = f"{ENV_CONFIG}={path}"
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"`{source}`: cannot read the config file ({err}).") from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"`{source}`: not valid YAML ({err}).") from err
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"`{source}`: the file must hold a mapping of option: value; got {type(data).__name__}.")
    allowed = (FILE_FLAG, *OPTIONS)
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise ValueError(f"`{source}` has unknown keys {unknown}; allowed: {', '.join(allowed)}.")
    enabled = parse_bool(data[FILE_FLAG], f"{path}: {FILE_FLAG}") if FILE_FLAG in data else None
    options = {k: parse_option(k, v, f"{path}: {k}") for k, v in data.items() if k != FILE_FLAG}
    return enabled, options
