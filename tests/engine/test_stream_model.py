"""The strict stream model itself (Note [Strict stream model] in tests/stream_double.py): each
ordering rule of CUDA, once kept (clean, exact bytes) and once broken (poison or a violation),
on a few tensors — so the engine suite's test of record can be trusted to fail."""

from __future__ import annotations

import pytest
import torch

from lightning_swap.core.engine.streams import CopyStreams, override_stream_ops

from ..stream_double import DoubleFactory

CPU = torch.device("cpu")


def _model(mode="late"):
    factory = DoubleFactory(mode)
    return factory, factory.__enter__()(CPU)


def _poisoned(t: torch.Tensor) -> bool:
    return bool(torch.isnan(t).all())


@pytest.mark.parametrize("ordered", [True, False])
def test_a_d2h_copy_reads_its_source_only_after_the_op_that_produced_it(ordered):
    factory, d = _model()
    try:
        d2h = d.new_stream()
        host = torch.zeros(4)
        x = torch.full((4,), 2.0)  # compute work
        if ordered:
            d.wait(d2h, d.record(d.compute))
        d.copy(host, x, d2h)
        d.wait(d.compute, d.record(d2h))
    finally:
        factory.__exit__(None, None, None)
    assert _poisoned(host) != ordered
    assert bool(factory.violations) != ordered


def test_ordering_after_the_producer_is_enough():
    """As strict as CUDA, no stricter: later, unrelated compute work need not be waited for."""
    with DoubleFactory() as factory:
        d = factory(CPU)
        d2h = d.new_stream()
        x = torch.full((4,), 3.0)
        produced = d.record(d.compute)
        torch.ones(8).sum()  # unrelated work after the event
        host = torch.zeros(4)
        d.wait(d2h, produced)
        d.copy(host, x, d2h)
        d.synchronize(d.record(d2h))
    assert factory.violations == [] and torch.equal(host, torch.full((4,), 3.0))


@pytest.mark.parametrize("wait_after_allocation", [True, False])
def test_an_h2d_copy_writes_its_block_only_after_the_allocation(wait_after_allocation):
    """The caching allocator may hand back a block queued compute work still uses: an h2d copy
    into it is ordered after an event recorded on the compute stream *after* the allocation."""
    with DoubleFactory() as factory:
        d = factory(CPU)
        h2d = d.new_stream()
        host = torch.arange(8, dtype=torch.uint8)
        early = d.record(d.compute)
        dst = d.empty(8, CPU)
        d.wait(h2d, d.record(d.compute) if wait_after_allocation else early)
        d.copy(dst, host, h2d)
        d.wait(d.compute, d.record(h2d))
        got = dst.clone()
    assert bool(factory.violations) != wait_after_allocation
    assert torch.equal(got, torch.arange(8, dtype=torch.uint8)) == wait_after_allocation


def test_compute_reading_a_block_before_waiting_for_its_copy_is_reported():
    with DoubleFactory() as factory:
        d = factory(CPU)
        h2d = d.new_stream()
        dst = d.empty(8, CPU)
        d.wait(h2d, d.record(d.compute))
        d.copy(dst, torch.ones(8, dtype=torch.uint8), h2d)
        event = d.record(h2d)
        (dst + 1).sum()  # no wait: reads poison
        d.wait(d.compute, event)
    assert any("read memory a copy on side0 writes" in v for v in factory.violations)


@pytest.mark.parametrize("how", ["wait", "record_stream", "nothing"])
def test_a_source_freed_under_its_copy(how):
    """A block freed to the compute stream's pool while a copy on another stream still reads it:
    safe after the compute stream waited for the copy, or with ``record_stream``; else reported."""
    with DoubleFactory() as factory:
        d = factory(CPU)
        d2h = d.new_stream()
        host = torch.zeros(4)
        x = torch.full((4,), 5.0)
        d.wait(d2h, d.record(d.compute))
        d.copy(host, x, d2h)
        event = d.record(d2h)
        if how == "wait":
            d.wait(d.compute, event)
        elif how == "record_stream":
            d.record_stream(x, d2h)
        del x  # the last reference: the block goes back to the allocator
        factory.drain()
    freed = [v for v in factory.violations if "freed" in v]
    assert bool(freed) == (how == "nothing"), factory.violations
    assert torch.equal(host, torch.full((4,), 5.0)) == (how != "nothing")


@pytest.mark.parametrize("ordered", [True, False])
def test_a_host_buffer_is_refilled_only_after_the_copy_that_read_it(ordered):
    """Note [Host buffer reuse]: the next d2h copy into a host buffer follows the h2d copy that
    read it, through that copy's event (or transitively)."""
    with DoubleFactory() as factory:
        d = factory(CPU)
        d2h, h2d = d.new_stream(), d.new_stream()
        host = torch.full((4,), 1.0)
        dst = d.empty(16, CPU).view(torch.float32)
        d.wait(h2d, d.record(d.compute))
        d.copy(dst, host, h2d)
        read = d.record(h2d)
        x = torch.full((4,), 7.0)
        d.wait(d2h, d.record(d.compute))
        if ordered:
            d.wait(d2h, read)
        d.copy(host, x, d2h)
        factory.drain()
    assert bool(factory.violations) != ordered


def test_orders_are_transitive_and_the_host_seeing_an_event_orders_later_work():
    with DoubleFactory() as factory:
        d = factory(CPU)
        a, b = d.new_stream(), d.new_stream()
        x = torch.full((4,), 4.0)
        d.wait(a, d.record(d.compute))
        host = torch.zeros(4)
        d.copy(host, x, a)
        d.wait(b, d.record(a))  # b follows a, which follows the compute stream
        dst = torch.zeros(4)
        y = torch.full((4,), 6.0)
        d.wait(b, d.record(d.compute))
        d.copy(dst, y, b)
        last = d.record(b)
        d.synchronize(last)  # the host saw b finish: anything queued later follows it
        d.copy(y, host, a)  # a writes what b read: ordered by the host's observation
        factory.drain()
    assert factory.violations == []


def test_a_factory_used_through_override_stream_ops_runs_its_clock_until_drained():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    factory = DoubleFactory()
    with override_stream_ops(factory):
        d = factory(CPU)
        d2h = d.new_stream()
        x = torch.full((4,), 2.0)
        host = torch.zeros(4)
        d.copy(host, x, d2h)  # no wait on the compute stream
    assert _get_current_dispatch_mode() is factory.compute
    factory.drain()
    assert _get_current_dispatch_mode() is None
    assert _poisoned(host) and factory.violations


def test_the_engine_streams_see_the_same_model():
    """CopyStreams on the model: a full round trip with the protocol's own waits is clean."""
    with DoubleFactory("early") as factory:
        copies = CopyStreams(CPU, factory(CPU))
        x = torch.randn(6)
        host = torch.empty(24, dtype=torch.uint8)
        event = copies.to_host(x.view(torch.uint8), host)
        copies.retire()  # an in-flight window of 0
        dst, back, _ = copies.to_device(host, 24, after=(event,))
        copies.consume(back)
        got = dst.view(torch.float32).clone()
        copies.close()
    assert factory.violations == [] and torch.equal(got, x)


def test_a_block_of_a_side_streams_pool_goes_back_to_that_stream():
    """Allocated inside ``use(stream)``: the block belongs to that stream's pool, so compute
    reading it must wait for that stream, and kernels issued there are flagged (not modelled)."""
    with DoubleFactory() as factory:
        d = factory(CPU)
        h2d = d.new_stream()
        host = torch.ones(8, dtype=torch.uint8)
        with d.use(h2d):
            dst = d.empty(8, CPU)
            d.copy(dst, host, h2d)
        assert factory.violations == []
        dst.sum()  # compute reads it without waiting for h2d
        assert any("read memory a copy on side0 writes" in v for v in factory.violations)
        with d.use(h2d):
            torch.ones(2).sum()
    assert any("issued inside use(side0)" in v for v in factory.violations)


@pytest.mark.parametrize("waited", [True, False])
def test_compute_writing_a_source_before_its_copy_read_it_is_reported(waited):
    """A write after a read on another stream: the in-place kernel may run before the d2h copy
    (what an in-place change of a saved tensor does under offload, issue 24 item 2)."""
    with DoubleFactory() as factory:
        d = factory(CPU)
        d2h = d.new_stream()
        x = torch.full((4,), 1.0)
        host = torch.zeros(4)
        d.wait(d2h, d.record(d.compute))
        d.copy(host, x, d2h)
        if waited:
            d.wait(d.compute, d.record(d2h))
        x.add_(1.0)
        factory.drain()
    assert bool(factory.violations) != waited
    assert torch.equal(host, torch.full((4,), 1.0 if waited else 2.0))  # late: the copy read the new bytes


@pytest.mark.parametrize("overlap", [True, False])
def test_copies_to_disjoint_bytes_of_one_storage_need_no_order(overlap):
    """Rule 2 is about bytes: two pieces of one host slab (Note [Pinned slabs]) are separate
    memory; an unordered copy into bytes another stream's copy still reads is reported."""
    with DoubleFactory() as factory:
        d = factory(CPU)
        d2h, h2d = d.new_stream(), d.new_stream()
        slab = torch.zeros(16)
        dst = d.empty(32, CPU).view(torch.float32)
        d.wait(h2d, d.record(d.compute))
        d.copy(dst, slab[:8], h2d)  # reads the first piece
        x = torch.full((8,), 3.0)
        d.wait(d2h, d.record(d.compute))
        d.copy(slab[4:12] if overlap else slab[8:], x, d2h)  # writes another piece, unordered
        factory.drain()
    assert bool(factory.violations) == overlap
