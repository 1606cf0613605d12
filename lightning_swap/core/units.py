"""Byte counts as users write them: ``12 << 30``, ``"12GiB"``, ``"1.5 GiB"``, ``"500MB"``.

Every option that takes a number of bytes from a user (a budget, a cap, a threshold) goes
through :func:`parse_bytes`, so the Lightning strategy, the batch-size finders, the Accelerate
plugin (code, environment, config file) and the command line accept the same forms and refuse
the same mistakes with the same message. Inside the library memory is an ``int`` of bytes.

The forms follow ``accelerate.utils.convert_file_size_to_int`` (which reads
``max_memory={0: "10GiB"}`` in Accelerate's big-model loading) where that is sensible:

- an ``int`` (or a ``float`` holding a whole number, such as ``12e9``) is a number of bytes;
- a string is a number with an optional unit, case-insensitive, spaces and ``_`` digit
  separators allowed: binary ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 1024), decimal
  ``KB``, ``MB``, ``GB``, ``TB`` (powers of 1000), ``B`` or no unit for bytes;
- a decimal amount with a unit is rounded down to whole bytes, as Accelerate rounds it
  (``"1.2GiB"`` is 1288490188); without a unit the amount is bytes and must be whole.

Where it differs from Accelerate: units are case-insensitive, so ``"5Gb"`` is 5 GB, not
5 gigabits (a memory budget in bits is never what is meant); ``bool``, negative values and
unparseable text raise ``ValueError`` naming the option and the forms allowed.

Note [No fraction of device memory]: a byte option never takes a fraction such as ``0.8``
for "80% of the device". A field named ``budget_bytes`` must not change meaning with the
type of its value (STYLE: no fields that change type), and on CPU, where the budget is the
simulated capacity, there is no device capacity to take a fraction of. 80% of a GPU is one
line of code: ``int(0.8 * torch.cuda.get_device_properties(0).total_memory)``.
"""

from __future__ import annotations

import math
import numbers
import re
from decimal import Decimal
from typing import Any, Optional, Union

__all__ = ["ByteSize", "UNITS", "format_bytes", "parse_bytes"]

#: What a byte option accepts: an ``int`` of bytes or a size string such as ``"12GiB"``.
ByteSize = Union[int, str]

#: Unit (lower case) -> bytes.
UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}

_SIZE = re.compile(r"\s*([-+]?)\s*((?:[0-9][0-9_]*)?(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")

_FORMS = (
    "an int number of bytes, or a string: a number with an optional unit, binary KiB/MiB/GiB/TiB "
    "(powers of 1024) or decimal KB/MB/GB/TB (powers of 1000), case-insensitive, e.g. '12GiB', "
    "'1.5 GiB', '500MB', '123456'"
)

_FRACTION_HINT = (
    " A fraction of device memory is not a byte count (Note [No fraction of device memory] in "
    "lightning_swap/core/units.py): for 80% of a GPU pass "
    "int(0.8 * torch.cuda.get_device_properties(0).total_memory)."
)


def _refuse(value: Any, field: str, reason: str, *, allow_none: bool, minimum: int, hint: str = "") -> ValueError:
    none = ", or None" if allow_none else ""
    unit = "byte" if minimum == 1 else "bytes"
    return ValueError(f"`{field}` got {value!r}: {reason}; allowed: {_FORMS}; at least {minimum} {unit}{none}.{hint}")


def parse_bytes(value: Any, *, field: str, allow_none: bool = False, minimum: int = 1) -> Optional[int]:
    """``value`` as an ``int`` number of bytes (the forms: module docstring).

    Args:
        value: an ``int``, a whole ``float``, or a size string such as ``"12GiB"``; ``None``
            only with ``allow_none``.
        field: the option's name as the user wrote it (``"budget_bytes"``, an environment
            variable, a command-line flag); every error names it.
        allow_none: whether ``None`` (meaning the option's default) is allowed; returned as is.
        minimum: the smallest count allowed: 1 for a budget or a cap, 0 for a threshold.

    Raises:
        ValueError: naming ``field``, the value, why it was refused, and the forms allowed.
    """

    def refuse(reason: str, hint: str = "") -> ValueError:
        return _refuse(value, field, reason, allow_none=allow_none, minimum=minimum, hint=hint)

    if value is None:
        if allow_none:
            return None
        raise refuse("a number of bytes is required")
    if isinstance(value, bool):
        raise refuse("a bool is not a size")
    if isinstance(value, numbers.Integral):
        nbytes = int(value)
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            hint = _FRACTION_HINT if 0 < value < 1 else ""
            raise refuse("not a whole number of bytes", hint)
        nbytes = int(value)
    elif isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match is None or not match.group(2).strip("_.") or match.group(3).lower() not in UNITS:
            raise refuse("not a size")
        sign, number, unit = match.group(1), match.group(2).replace("_", ""), match.group(3).lower()
        amount = Decimal(number) * UNITS[unit]
        if unit in ("", "b") and amount != amount.to_integral_value():
            raise refuse("not a whole number of bytes", _FRACTION_HINT if 0 < amount < 1 else "")
        nbytes = int(amount)  # rounds a decimal amount with a unit down, as Accelerate does
        if sign == "-":
            nbytes = -nbytes
    else:
        raise refuse(f"a {type(value).__name__} is not a size")
    if nbytes < minimum:
        raise refuse("negative" if nbytes < 0 else f"below the minimum of {minimum}")
    return nbytes


def format_bytes(nbytes: Optional[int]) -> str:
    """``nbytes`` for display, in binary units (the inverse of :func:`parse_bytes` to a tenth)."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
