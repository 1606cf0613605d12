"""How the processes of a data-parallel job agree: :class:`Collectives`.

Note [Decide from the largest measurement]: what one process measured (a peak, a profile)
can be less than another's — under FSDP each rank holds its own shards, gathers the same units
and may pad differently, and a data-parallel rank's batch can be larger — and a plan made from
the main process's measurements alone may not fit the fullest rank. So every decision reads
the largest over the processes: every process measures (under FSDP it must anyway: every rank
runs every collective of the step), numbers are reduced by :attr:`Collectives.reduce_max`, and
profiles are :attr:`Collectives.gather`-ed and merged by
:func:`~lightning_swap.core.measure.model_profile.max_profile`. The main process then decides
from those, and broadcasts (:meth:`Collectives.on_main`).

The one mechanism every agreement goes through: the session's plans and least budget
(:meth:`Collectives.on_main`, :meth:`Collectives.largest`), the batch-size search's profile,
measurements and answer. Every front end takes :func:`process_group_collectives`:
``torch.distributed``'s default group, which Lightning's, Fabric's and Accelerate's data-parallel
launchers all start; the defaults are one process's identity.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import torch

__all__ = ["Collectives", "process_group_collectives"]

T = TypeVar("T")


def _same(value: Any) -> Any:
    return value


def _alone(value: Any) -> list[Any]:
    return [value]


def _sendable(error: Exception) -> Exception:
    """``error`` when it survives pickling (the broadcast pickles it), else a ``RuntimeError``
    saying what it was: the other processes must raise something rather than wait."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure to travel is answered the same way
        return RuntimeError(f"the main process failed: {type(error).__name__}: {error}")
    return error


@dataclass(frozen=True, kw_only=True)
class Collectives:
    """How the processes of a data-parallel job agree; the defaults are one process's identity."""

    #: Whether this process decides (profiles, plans); the others receive what it decided.
    is_main: bool = True
    #: The main process's object, on every process.
    broadcast: Callable[[Any], Any] = _same
    #: The largest of every process's number (measured peaks and step times).
    reduce_max: Callable[[float], float] = _same
    #: The smallest of every process's number (the batch size all agree on).
    reduce_min: Callable[[int], int] = _same
    #: Every process's object, in process order, on every process (the profiles each measured).
    gather: Callable[[Any], list[Any]] = _alone

    def largest(self, value: Optional[int]) -> Optional[int]:
        """The largest of every process's measured bytes (Note [Decide from the largest
        measurement]); ``None`` where no process measured any. Every process must call it."""
        largest = self.reduce_max(-1.0 if value is None else float(value))
        return None if largest < 0 else int(largest)

    def on_main(self, decide: Callable[[], T]) -> T:
        """``decide()`` on the main process, its result handed to every process.

        Every process must call this at the same point (it is a broadcast). An error ``decide``
        raises is broadcast too and raised on every process (the main process raises its own;
        the others a copy), so that none is left waiting in a collective the main process never
        enters."""
        payload: Any = None
        error = None
        if self.is_main:
            try:
                payload = ("ok", decide())
            except Exception as err:  # re-raised on every process below
                error = err
                payload = ("error", _sendable(err))
        kind, body = self.broadcast(payload)
        if kind == "error":
            raise error if error is not None else body
        return body


def process_group_collectives(device: torch.device) -> Collectives:
    """:class:`Collectives` over ``torch.distributed``'s default process group (rank 0 decides),
    numbers reduced as float64 on ``device`` (a 32-bit shape hash and a batch size packed in one
    number stay exact: Note [Auto decides from values] in ``auto.py``); one process's identity
    when no group is initialised or it holds one process. Every process calls each collective."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Collectives()

    def broadcast(obj: Any) -> Any:
        payload = [obj]
        dist.broadcast_object_list(payload, src=0, device=device)
        return payload[0]

    def reduce(value: float, op: Any) -> float:
        number = torch.tensor([float(value)], dtype=torch.float64, device=device)
        dist.all_reduce(number, op=op)
        return float(number.item())

    def gather(obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    return Collectives(
        is_main=dist.get_rank() == 0,
        broadcast=broadcast,
        reduce_max=lambda value: reduce(value, dist.ReduceOp.MAX),
        reduce_min=lambda value: int(reduce(value, dist.ReduceOp.MIN)),
        gather=gather,
    )
