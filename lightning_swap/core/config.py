"""The options every front end shares, in one table: :class:`SwapConfig`, its defaults, checks and help.

Note [One option table]: an option is declared once, as a field made by :func:`option`: its
default, its help, the check that validates and normalizes a value (its errors naming the field
and the values allowed) and, where text spells it differently (``false``, ``2``,
``name=action,...``), how text becomes a value. Every front end derives its options from the
fields, never from a list of its own:

- the Lightning strategies take ``SwapConfig``'s fields (and their own ``log_stats`` and
  ``report``, a subclass's fields) as keywords; their signatures and docstrings are generated;
- the Accelerate ``SwapPlugin`` is ``SwapConfig`` plus its own ``log_stats`` (a subclass): its
  fields are its ``ACCELERATE_CPU_SWAP_<NAME>`` variables, YAML keys and ``accelerate-swap config``
  flags, read through :func:`from_text`;
- the Fabric strategies take ``SwapConfig``'s fields as keywords (read from ``fields(SwapConfig)``).

So a field added here reaches each of them with no other edit (``tests/vocabulary/test_option_table.py``
adds one). The batch-size finders' options are :class:`~lightning_swap.core.scale.batch_search.ScaleConfig`'s
fields, the same way. Constructing a config has no side effect: installing unified memory is the
adapters' business (:func:`~lightning_swap.core.engine.unified.memory.install_unified_memory`).
"""

from __future__ import annotations

import enum
import functools
import importlib
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any, Optional

from .actions import AUTO, PolicyLike, parse_policy, policy_from_text
from .segments import SegmentSpec
from .units import ByteSize, parse_bytes

__all__ = [
    "DEFAULT_MIN_OFFLOAD_BYTES", "OptionTable", "SwapConfig", "UMMode", "build_options", "check_bool", "check_count",
    "check_min_offload_bytes", "check_segments", "check_um_max_bytes", "check_window_bytes",
    "describe_options", "from_text", "import_object", "option", "parse_bool", "split_options",
]


#: Tensors smaller than this stay on the device: copying them costs more than it frees.
DEFAULT_MIN_OFFLOAD_BYTES = 1 << 14

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


# -- one option's checks: ``check(value, field=name)`` returns the value normalized ------------
def check_bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`{field}` must be True or False; got {value!r}.")
    return value


def check_count(value: Any, field: str, *, allow_none: bool = False) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{field}` must be an int >= 0{' or None' if allow_none else ''}; got {value!r}.")
    return value


def check_window_bytes(value: Any, field: str) -> Optional[int]:
    """A copy window in bytes (Note [Copy windows] in ``engine/offload.py``), or ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{field}` must be an int >= 0 (bytes) or None; got {value!r}.")
    return value


def check_min_offload_bytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`min_offload_bytes` must be an int >= 0 (bytes); got {value!r}.")
    return value


def check_segments(value: Any, field: str = "segments") -> SegmentSpec:
    """``None``, or a non-empty sequence of module classes and qualified module names (one name alone too)."""
    if value is None:
        return None
    items = [value] if isinstance(value, (str, type)) else value
    if isinstance(items, Iterable) and not isinstance(items, Mapping):
        items = tuple(items)
        if items and all(isinstance(s, type) or (isinstance(s, str) and s.strip()) for s in items):
            return items
    raise ValueError(
        f"`{field}` got {value!r}; allowed: none (find repeated blocks), or a non-empty list (as text: comma-separated) "
        "of qualified module names ('model.layer1.0') and module classes (as text: 'package.module:ClassName')."
    )


class UMMode(str, enum.Enum):
    OFF = "off"
    OFFLOAD = "offload"
    ALL = "all"

    @classmethod
    def parse(cls, value: Any, field: str = "um") -> "UMMode":
        if isinstance(value, UMMode):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"`{field}` got {value!r}; allowed: {allowed}.")


def check_um_max_bytes(value: Any, field: str = "um_max_bytes") -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"`{field}` must be a positive int (bytes of managed memory) or None (the device's free "
            f"memory when unified memory is installed); got {value!r}."
        )
    return value


# -- text (environment variables, YAML values, command-line flags) -------------------------
def parse_bool(value: Any, field: str) -> bool:
    """``true``/``false`` and the other spellings Accelerate's ``str_to_bool`` accepts."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"`{field}` got {value!r}; allowed: true or false (also {'/'.join(_TRUE[:-1])}, {'/'.join(_FALSE[:-1])}, 1/0).")


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


def _segments_from_text(value: Any, field: str) -> Any:
    """Comma-separated names (a list in YAML); ``package.module:ClassName`` imports the class."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        return value  # for the check to refuse
    out = []
    for item in items:
        if isinstance(item, str) and ":" in item:
            spec, item = item, import_object(item, field)
            if not isinstance(item, type):
                raise ValueError(f"`{field}` names {spec!r}, which is not a class.")
        if not isinstance(item, str) or item.strip():
            out.append(item.strip() if isinstance(item, str) else item)
    return out


def from_text(option_field: Field, raw: Any, source: str) -> Any:
    """Option ``option_field``'s value from text or a YAML value, checked alone (a rule across
    options is checked when the whole config is built); errors name ``source`` (a variable, a
    file key, a flag). ``none``, ``null`` or nothing is ``None`` for an option whose default is ``None``."""
    if option_field.default is None and (raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null"))):
        return None
    text = option_field.metadata.get("text")
    return option_field.metadata["check"](text(raw, source) if text else raw, field=source)


# -- the table ---------------------------------------------------------------------------
def option(default: Any, help: str, *, check: Callable[..., Any], text: Optional[Callable[[Any, str], Any]] = None) -> Any:
    """A field of an option table (Note [One option table]): ``check(value, field=name)`` returns
    the value normalized or raises ``ValueError`` naming ``field``; ``text(raw, source)`` turns a
    text or YAML spelling into what ``check`` takes (where that differs); ``help`` is the
    option's one description (docstrings, ``--help``)."""
    return field(default=default, metadata={"help": help, "check": check, "text": text})


def describe_options(table: type, indent: str = "            ") -> str:
    """``name: help`` for each of ``table``'s options, wrapped for a docstring's ``Args``."""
    return "\n".join(
        textwrap.fill(f"{f.name}: {f.metadata['help']}", 100, initial_indent=indent, subsequent_indent=indent + "    ")
        for f in fields(table)
    )


def split_options(options: Mapping[str, Any], table: type) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``table``'s options among ``options``, the others)."""
    names = {f.name for f in fields(table)}
    return {k: v for k, v in options.items() if k in names}, {k: v for k, v in options.items() if k not in names}


def build_options(table: type, options: Mapping[str, Any], *, owner: str) -> Any:
    """``table(**options)``; a name that is not one of its options is a ``ValueError`` listing them."""
    known, unknown = split_options(options, table)
    if unknown:
        raise ValueError(f"unknown {owner} options {sorted(unknown)}; allowed: {sorted(f.name for f in fields(table))}.")
    return table(**known)


@dataclass(frozen=True, kw_only=True)
class OptionTable:
    """A frozen table of :func:`option` fields, each checked and normalized when it is built."""

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](getattr(self, f.name), field=f.name))

    def with_options(self, **changes: Any) -> "OptionTable":
        """A copy with some options changed (checked again)."""
        return replace(self, **changes)


def _bytes(*, allow_none: bool = False, minimum: int = 1) -> Callable[..., Optional[int]]:
    return functools.partial(parse_bytes, allow_none=allow_none, minimum=minimum)


@dataclass(frozen=True, kw_only=True)
class SwapConfig(OptionTable):
    """Options shared by every front end (strategies, plugin, Fabric): Note [One option table].

    Byte options take an ``int`` or a size string (``"12GiB"``, ``"500MB"``; the forms of
    :func:`~lightning_swap.core.units.parse_bytes`) and are stored as ``int``. None takes a
    fraction of device memory (Note [No fraction of device memory] in ``core/units.py``).
    """

    policy: PolicyLike = option(
        AUTO, "``\"auto\"`` (default: observe the first training step and let the planner choose the fastest plan within "
        "``budget_bytes``), one action for every segment (``keep``, ``offload``, ``recompute``, ``selective``, "
        "``recompute_offload``, case-insensitive, or an ``Action``), or a mapping from segment name to action (segments "
        "left out are kept; as text ``name=action,name=action``).", check=parse_policy, text=policy_from_text,
    )
    segments: SegmentSpec = option(
        None, "``None`` (default) finds the model's repeated blocks; or module classes / qualified module names (as "
        "text: comma-separated, a class as ``package.module:ClassName``).", check=check_segments, text=_segments_from_text,
    )
    min_offload_bytes: ByteSize = option(
        DEFAULT_MIN_OFFLOAD_BYTES, "saved tensors smaller than this stay on the device (bytes, >= 0; default 16KiB).",
        check=_bytes(minimum=0),
    )
    budget_bytes: Optional[ByteSize] = option(
        None, "the device memory budget for the planner; on CPU the simulated capacity (without it ``\"auto\"`` keeps "
        "everything); on CUDA by default the free memory less 10%. Bytes, an ``int`` or a size string (``\"12GiB\"``), "
        "never a fraction: for 80% of a GPU pass ``int(0.8 * torch.cuda.get_device_properties(0).total_memory)``.",
        check=_bytes(allow_none=True),
    )
    prefetch_bytes: Optional[ByteSize] = option(
        None, "bytes fetched ahead in backward (``0``: each saved tensor when it is needed); default: the planner's "
        "choice under ``\"auto\"``, else one segment's worth on CUDA and 0 on CPU (Notes [Copy windows] and [Default "
        "copy windows] in ``engine/offload.py``).", check=_bytes(allow_none=True, minimum=0),
    )
    inflight_bytes: Optional[ByteSize] = option(
        None, "bytes of copies to the host that may still run while the forward goes on (``0``: each waited for when "
        "issued); default as ``prefetch_bytes``.", check=_bytes(allow_none=True, minimum=0),
    )
    log_plan: bool = option(
        True, "log the plan table when a plan is applied (default on; a Lightning strategy logs it on rank zero, "
        "through the progress bar when one is drawing).", check=check_bool, text=parse_bool,
    )
    um: UMMode | str = option(
        UMMode.OFF, "CUDA unified memory: ``\"off\"`` (default), ``\"offload\"`` (offloaded activations in managed host "
        "buffers, prefetched before their backward) or ``\"all\"`` (every CUDA allocation managed, installed before the "
        "model reaches the GPU: training that does not fit is slow instead of failing); stored as a ``UMMode`` (a ``str`` "
        "enum). Refused on CPU.", check=UMMode.parse,
    )
    um_max_bytes: Optional[ByteSize] = option(
        None, "cap on managed memory in bytes, only with ``um`` on; default: the device's free memory (no "
        "oversubscription unless asked for).", check=_bytes(allow_none=True),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.um is UMMode.OFF and self.um_max_bytes is not None:
            raise ValueError(
                f"`um_max_bytes` caps unified memory and applies only with um='offload' or um='all'; got "
                f"um_max_bytes={self.um_max_bytes!r} with um='off'."
            )

    def to_config(self) -> "SwapConfig":
        """The shared options alone, as a plain ``SwapConfig`` (a front end's subclass adds its own)."""
        return SwapConfig(**{f.name: getattr(self, f.name) for f in fields(SwapConfig)})

    @property
    def is_auto(self) -> bool:
        return self.policy == AUTO


SwapConfig.__doc__ += "\n    Options:\n" + describe_options(SwapConfig, "        ") + "\n"
