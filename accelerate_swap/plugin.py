"""The Accelerate plugin's options, and where they come from: code, environment, or a file.

Accelerate's own config loader rejects unknown keys and has no registry for third-party
plugins, so this plugin follows the convention of Accelerate's dynamo and FSDP plugins: it
reads ``ACCELERATE_*`` environment variables, which ``accelerate launch`` passes through to
every process.

- ``ACCELERATE_CPU_SWAP``: the switch (``true``/``false``, and the other spellings
  Accelerate's ``str_to_bool`` accepts).
- ``ACCELERATE_CPU_SWAP_<OPTION>``: one option, e.g. ``ACCELERATE_CPU_SWAP_POLICY=offload``,
  ``ACCELERATE_CPU_SWAP_BUDGET_BYTES=12GiB``, ``ACCELERATE_CPU_SWAP_UM=all``.
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

import importlib
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from lightning_swap.core import AUTO, Action, PolicyLike
from lightning_swap.core import DEFAULT_MIN_OFFLOAD_BYTES
from lightning_swap.core import SegmentSpec
from lightning_swap.core import SwapConfig
from lightning_swap.core import UMMode
from lightning_swap.core import ByteSize, parse_bytes

__all__ = ["ENV_CONFIG", "ENV_FLAG", "ENV_PREFIX", "FILE_FLAG", "OPTIONS", "SwapPlugin", "env_name", "parse_option"]

log = logging.getLogger(__name__)

ENV_FLAG = "ACCELERATE_CPU_SWAP"
ENV_PREFIX = "ACCELERATE_CPU_SWAP_"
ENV_CONFIG = "ACCELERATE_CPU_SWAP_CONFIG"
#: The switch's key in a config file.
FILE_FLAG = "enabled"

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def env_name(option: str) -> str:
    """The environment variable holding ``option`` (``"budget_bytes"`` -> ``ACCELERATE_CPU_SWAP_BUDGET_BYTES``)."""
    return ENV_PREFIX + option.upper()


# -- parsing one value; `source` names the variable or the file key in every error -------
def _parse_bool(value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"`{source}` got {value!r}; allowed: true or false (also {'/'.join(_TRUE[:-1])}, {'/'.join(_FALSE[:-1])}, 1/0).")


def _is_auto(policy: Any) -> bool:
    return isinstance(policy, str) and policy.strip().lower() == AUTO


def _is_none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null"))


def _bytes_parser(*, allow_none: bool, minimum: int) -> Callable[[Any, str], Optional[int]]:
    """The core's :func:`~lightning_swap.core.units.parse_bytes`, its errors naming the variable
    or file key; ``none``/``null``/empty text is ``None`` where the option allows it."""

    def parse(value: Any, source: str) -> Optional[int]:
        if allow_none and _is_none(value):
            return None
        return parse_bytes(value, field=source, allow_none=allow_none, minimum=minimum)

    return parse


def _count_parser(*, allow_none: bool, allowed: str) -> Callable[[Any, str], Optional[int]]:
    """A whole number from text or YAML (its range is checked by ``SwapConfig``); ``allowed``
    is what the error offers."""

    def parse(value: Any, source: str) -> Optional[int]:
        if allow_none and _is_none(value):
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and re.fullmatch(r"\s*[-+]?[0-9]+\s*", value):
            return int(value)
        raise ValueError(f"`{source}` got {value!r}; allowed: {allowed}.")

    return parse


def _parse_policy(value: Any, source: str) -> PolicyLike:
    """One action name, or per segment: ``name=action,name=action`` (env) / a mapping (file)."""
    allowed = (
        f"auto, one of {', '.join(a.value for a in Action)}, or per segment "
        "'segment.name=action,other.name=action' (a mapping in a config file)"
    )
    if isinstance(value, Action):
        return value
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str) and "=" in value:
        policy: dict[str, str] = {}
        for item in value.split(","):
            if not item.strip():
                continue
            name, sep, action = item.partition("=")
            if not sep or not name.strip() or not action.strip():
                raise ValueError(f"`{source}` got {value!r}; allowed: {allowed}.")
            policy[name.strip()] = action.strip()
        if not policy:
            raise ValueError(f"`{source}` got {value!r}; allowed: {allowed}.")
        return policy
    if isinstance(value, str):
        return value.strip()
    raise ValueError(f"`{source}` got {value!r}; allowed: {allowed}.")


def import_object(spec: str, source: str) -> Any:
    """The object ``package.module:qualified.name`` names; ``ValueError`` naming ``source``."""
    module_name, _, qualname = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name.strip())
        for part in qualname.strip().split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"`{source}` names {spec!r}, which cannot be imported ({err}).") from err
    return obj


def _import_class(spec: str, source: str) -> type:
    obj = import_object(spec, source)
    if not isinstance(obj, type):
        raise ValueError(f"`{source}` names {spec!r}, which is not a class.")
    return obj


def _parse_segments(value: Any, source: str) -> SegmentSpec:
    """Qualified module names, or ``package.module:ClassName`` for a block class."""
    allowed = (
        "none (find repeated blocks), or a comma-separated list (a list in a config file) of "
        "qualified module names ('model.layer1.0') or block classes ('package.module:ClassName')"
    )
    if _is_none(value):
        return None
    if isinstance(value, str):
        items: list[Any] = [s.strip() for s in value.split(",") if s.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError(f"`{source}` got {value!r}; allowed: {allowed}.")
    if not items or not all(isinstance(s, (str, type)) and (not isinstance(s, str) or s.strip()) for s in items):
        raise ValueError(f"`{source}` got {value!r}; allowed: {allowed}.")
    return tuple(_import_class(s, source) if isinstance(s, str) and ":" in s else s for s in items)


#: Every option: its parser from text (environment) or a YAML value. Note [One option table]:
#: ``SwapConfig``'s fields and the plugin's own options (:data:`_PLUGIN_OPTIONS`); a test checks
#: that these keys, ``SwapPlugin``'s fields and the CLI's flags are the same set.
_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "policy": _parse_policy,
    "segments": _parse_segments,
    "min_offload_bytes": _bytes_parser(allow_none=False, minimum=0),
    "budget_bytes": _bytes_parser(allow_none=True, minimum=1),
    "prefetch_segments": _count_parser(allow_none=True, allowed="an integer >= 0, or none (1 on CUDA, 0 on CPU)"),
    "inflight_segments": _count_parser(allow_none=False, allowed="an integer >= 0"),
    "prefetch_bytes": _bytes_parser(allow_none=True, minimum=0),
    "inflight_bytes": _bytes_parser(allow_none=True, minimum=0),
    "log_plan": _parse_bool,
    "log_stats": _parse_bool,
    "um": lambda v, s: UMMode.parse(v, field=s).value,
    "um_max_bytes": _bytes_parser(allow_none=True, minimum=1),
}
#: Options that ``SwapConfig`` holds, read from its fields (what ``to_config`` hands over).
_CONFIG_OPTIONS = tuple(f.name for f in fields(SwapConfig))
#: The plugin's own options, which the core does not see.
_PLUGIN_OPTIONS = ("log_stats",)
#: What an option needs beside it to be checked alone (its cross-field rule is checked when
#: the whole plugin is built).
_ALONE: dict[str, dict[str, Any]] = {"um_max_bytes": {"um": "all"}}


def parse_option(option: str, raw: Any, source: str) -> Any:
    """Parse ``raw`` (text, or a YAML value) for ``option`` and validate it alone, so an error
    names ``source`` (a variable, a file key, a command-line flag) and the allowed values."""
    value = _PARSERS[option](raw, source)
    try:
        SwapPlugin(**{option: value, **_ALONE.get(option, {})})
    except ValueError as err:
        raise ValueError(f"`{source}` got {raw!r}: {err}") from err
    return value


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
    allowed = (FILE_FLAG, *_PARSERS)
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise ValueError(f"`{source}` has unknown keys {unknown}; allowed: {', '.join(allowed)}.")
    enabled = _parse_bool(data[FILE_FLAG], f"{path}: {FILE_FLAG}") if FILE_FLAG in data else None
    options = {k: parse_option(k, v, f"{path}: {k}") for k, v in data.items() if k != FILE_FLAG}
    return enabled, options


@dataclass(frozen=True, kw_only=True)
class SwapPlugin:
    """Switches an :class:`~accelerate_swap.SwapAccelerator` on, with the same options as the
    Lightning ``"cpu_swap"`` strategy.

    Build it in code, or let :meth:`from_env` read it from ``ACCELERATE_CPU_SWAP*`` variables
    and the config file (Note [Where the options come from]).
    """

    #: ``"auto"`` (profile the first training forward and let the planner choose under
    #: ``budget_bytes``: Note [Auto policy in Accelerate]), an action name (``keep``,
    #: ``offload``, ``recompute``, ``selective``, ``recompute_offload``), an ``Action``, or a
    #: mapping from segment name to action. With ``"auto"`` and no ``budget_bytes`` on CPU every
    #: segment is kept (there is no device capacity to plan for), as in the Lightning strategy.
    policy: PolicyLike = AUTO
    #: ``None`` finds repeated blocks; or module classes / qualified module names.
    segments: SegmentSpec = None
    #: Saved tensors smaller than this stay on the device (bytes, >= 0; e.g. ``"16KiB"``).
    min_offload_bytes: ByteSize = DEFAULT_MIN_OFFLOAD_BYTES
    #: The device memory budget for the planner (on CPU: the simulated capacity): bytes as an
    #: ``int`` or a size string (``"12GiB"``), stored as ``int``; not a fraction of device
    #: memory (for 80% of a GPU: ``int(0.8 * torch.cuda.get_device_properties(0).total_memory)``).
    budget_bytes: Optional[ByteSize] = None
    #: Segments prefetched ahead in backward; ``None``: 1 on CUDA, 0 on CPU.
    prefetch_segments: Optional[int] = None
    #: Segments whose copies to the host may still run while later segments compute; 0 waits
    #: for each segment's copies before the next.
    inflight_segments: int = 1
    #: Bytes fetched ahead in backward instead of whole segments (``0``: each saved tensor when
    #: needed); ``None``: the planner's choice under ``policy="auto"``.
    prefetch_bytes: Optional[ByteSize] = None
    #: Bytes of copies to the host that may still run while the forward goes on; ``None`` as above.
    inflight_bytes: Optional[ByteSize] = None
    #: Log the plan table (``logging``, level INFO) when it is applied.
    log_plan: bool = True
    #: Send each step's statistics to ``accelerator.log`` (``swap/...`` keys) when trackers are set up.
    log_stats: bool = True
    #: CUDA unified memory: ``"off"``, ``"offload"`` (offloaded activations in managed host
    #: buffers) or ``"all"`` (every CUDA allocation managed; installed when the accelerator is
    #: built, so build it before moving anything to the GPU). Refused on CPU.
    um: str = "off"
    #: Cap on managed memory in bytes (only with ``um`` on); ``None``: the GPU's free memory.
    um_max_bytes: Optional[ByteSize] = None

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Mapping) and not _is_auto(self.policy):
            try:
                Action.parse(self.policy, field="policy")
            except ValueError as err:
                raise ValueError(f"{err} Or 'auto' to let the planner choose.") from None
        object.__setattr__(self, "um", UMMode.parse(self.um).value)
        config = self.to_config()  # validates every shared option, naming the field
        for name in ("min_offload_bytes", "budget_bytes", "um_max_bytes"):  # "12GiB" -> int
            object.__setattr__(self, name, getattr(config, name))
        if not isinstance(self.log_stats, bool):
            raise ValueError(f"`log_stats` must be True or False; got {self.log_stats!r}.")

    def to_config(self) -> SwapConfig:
        """The core's options for a :class:`~lightning_swap.core.scale.session.SwapSession`."""
        return SwapConfig(**{name: getattr(self, name) for name in _CONFIG_OPTIONS})

    # -- reading -------------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["SwapPlugin"]:
        """The plugin the environment asks for, or ``None`` when the switch is off.

        ``environ`` defaults to ``os.environ``.
        """
        env = os.environ if environ is None else environ
        flag = env.get(ENV_FLAG)
        if flag is not None and not _parse_bool(flag, ENV_FLAG):
            return None
        path = env.get(ENV_CONFIG)
        enabled, options = _read_file(path) if path else (None, {})
        if flag is None and not enabled:
            return None
        for key in sorted(env):
            if not key.startswith(ENV_PREFIX) or key == ENV_CONFIG:
                continue
            option = key[len(ENV_PREFIX):].lower()
            if option not in _PARSERS:
                known = ", ".join([ENV_CONFIG, *(env_name(o) for o in _PARSERS)])
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
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "policy":
                if isinstance(value, Mapping):
                    value = {str(k): Action.parse(v).value for k, v in value.items()}
                else:
                    value = AUTO if _is_auto(value) else Action.parse(value).value
            elif f.name == "segments" and value is not None:
                value = [v if isinstance(v, str) else f"{v.__module__}:{v.__qualname__}" for v in value]
            out[f.name] = value
        return out

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
            elif isinstance(value, bool):
                text = str(value).lower()
            else:
                text = "none" if value is None else str(value)
            env[env_name(name)] = text
        return env


#: Every option's name, in the order of ``SwapPlugin``'s fields.
OPTIONS = tuple(f.name for f in fields(SwapPlugin))


def _check_option_table() -> None:
    """Note [One option table]: an option of ``SwapConfig`` missing from the plugin (its fields,
    its parsers, hence its environment variables and file keys), or with another default, fails
    at import, naming it."""
    expected = {f.name for f in fields(SwapConfig)} | set(_PLUGIN_OPTIONS)
    for what, names in (("SwapPlugin's fields", {f.name for f in fields(SwapPlugin)}), ("the option parsers (_PARSERS)", set(_PARSERS))):
        if names != expected:
            raise TypeError(
                f"accelerate_swap.plugin: {what} disagree with SwapConfig's fields + {_PLUGIN_OPTIONS}: "
                f"missing {sorted(expected - names)}, unknown {sorted(names - expected)}."
            )
    ours = {f.name: f.default for f in fields(SwapPlugin)}
    for f in fields(SwapConfig):
        if ours[f.name] != f.default:
            raise TypeError(f"accelerate_swap.plugin: `{f.name}` defaults to {ours[f.name]!r}; SwapConfig's default is {f.default!r}.")

_check_option_table()
