"""Out-of-memory is recognised by type first, by message second (STYLE 10)."""

from __future__ import annotations

import pytest
import torch

from lightning_swap.core.errors import is_out_of_memory


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (torch.OutOfMemoryError("anything"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("CUDA error: out of memory"), True),
        (RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"), True),
        (RuntimeError("shape mismatch"), False),
        (ValueError("CUDA out of memory"), False),  # only a RuntimeError is read by message
        (KeyError("oom"), False),
    ],
)
def test_is_out_of_memory(exc, expected):
    assert is_out_of_memory(exc) is expected


def test_one_home_per_name():
    """``is_out_of_memory`` and ``AUTO`` live in one module each (``errors``, ``actions``); the
    surface re-exports those objects, and the old re-exports (``core.scale``, ``core.session``)
    are gone with the restructuring (issue 19)."""
    import lightning_swap.core as core
    from lightning_swap.core import actions, errors
    from lightning_swap.core.scale import batch_search, session

    assert core.is_out_of_memory is errors.is_out_of_memory and core.AUTO is actions.AUTO == "auto"
    assert "is_out_of_memory" not in batch_search.__all__
    assert not hasattr(session, "AUTO")
