"""Unified memory (``um=``): options, refusals, the CUDA runtime binding, and the managed
buffers and prefetches run against a recording fake of the CUDA runtime on CPU.

The fake stands in for ``cudaMallocManaged`` with host memory and records every prefetch and
advice, so the offload engine's use of managed buffers, the cap, the allocator callbacks
(called through their C function pointers) and the parameter prefetch schedule are all
tested here; what only a GPU can show (the MemPool routing, the driver's migrations, the
overhead) is in the ``cuda``-marked tests at the end.
"""

from __future__ import annotations

import ctypes
import gc

import lightning as L
import pytest
import torch

from lightning_swap import CPUSwapStrategy, UMMode, UnifiedMemoryError, install_unified_memory
from lightning_swap.core import find_segments, resolve_policy
from lightning_swap.core.cudart import CPU_DEVICE, Advice, CudaRuntime, CudaRuntimeError, find_cudart
from lightning_swap.core.meter import DeviceMemoryMeter
from lightning_swap.core.runtime import SwapRuntime
from lightning_swap.core.session import SwapConfig
from lightning_swap.core.unified import (
    ManagedMemory,
    UnifiedMemory,
    _ManagedAllocator,
    _MALLOC,
    _FREE,
    check_um_max_bytes,
    refusal,
)

from .helpers import assert_same_state, train_core
from .lit import LitModel
from .models import MODELS

CPU = torch.device("cpu")
CUDA0 = torch.device("cuda", 0)


class FakeRuntime:
    """``CudaRuntime``'s interface over host memory, recording the calls."""

    def __init__(self) -> None:
        self.buffers: dict[int, ctypes.Array] = {}
        self.calls: list[tuple] = []

    def malloc_managed(self, nbytes: int) -> int:
        buf = ctypes.create_string_buffer(nbytes)
        ptr = ctypes.addressof(buf)
        self.buffers[ptr] = buf
        self.calls.append(("malloc", ptr, nbytes))
        return ptr

    def free(self, ptr: int) -> None:
        del self.buffers[ptr]
        self.calls.append(("free", ptr))

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> None:
        self.calls.append(("prefetch", ptr, nbytes, device))

    def advise(self, ptr: int, nbytes: int, advice: Advice, device: int) -> None:
        self.calls.append(("advise", ptr, nbytes, advice, device))

    def as_tensor(self, block, device):
        array = (ctypes.c_uint8 * block.nbytes).from_address(block.ptr)
        array.owner = block  # the tensor keeps the block (and so the memory) alive
        return torch.frombuffer(array, dtype=torch.uint8)

    def of(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]


def fake_unified(mode: UMMode = UMMode.OFFLOAD, max_bytes: int = 1 << 30) -> tuple[UnifiedMemory, FakeRuntime]:
    runtime = FakeRuntime()
    return UnifiedMemory(mode, CPU, ManagedMemory(runtime, 0, max_bytes), None), runtime


# -- options -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, expected",
    [("off", UMMode.OFF), ("offload", UMMode.OFFLOAD), ("all", UMMode.ALL), (" ALL ", UMMode.ALL), (UMMode.ALL, UMMode.ALL)],
)
def test_um_mode_parses(value, expected):
    assert UMMode.parse(value) is expected


@pytest.mark.parametrize("value", ["most", "", None, True, 1])
def test_um_mode_rejects_with_allowed_values(value):
    with pytest.raises(ValueError, match=r"`um` got .*allowed: 'off', 'offload', 'all'"):
        UMMode.parse(value)


@pytest.mark.parametrize("value", [0, -1, 1.5, "1GiB", True])
def test_um_max_bytes_rejects(value):
    with pytest.raises(ValueError, match="`um_max_bytes` must be a positive int"):
        check_um_max_bytes(value)


def test_um_max_bytes_only_with_um_on():
    assert SwapConfig(um="offload", um_max_bytes=1 << 20).um == "offload"
    with pytest.raises(ValueError, match="`um_max_bytes` .* applies only with um='offload' or um='all'"):
        SwapConfig(um_max_bytes=1 << 20)
    with pytest.raises(ValueError, match="`um` got 'sometimes'"):
        CPUSwapStrategy(um="sometimes")


# -- refusals ------------------------------------------------------------------------------
REFUSALS = [
    # mode, device, cuda available, missing torch features, reserved bytes, pool exists -> message part or None
    (UMMode.OFF, CPU, False, (), 0, False, None),
    (UMMode.OFFLOAD, CPU, False, (), 0, False, "needs a CUDA device, and this run is on cpu"),
    (UMMode.ALL, CPU, True, (), 0, False, "needs a CUDA device, and this run is on cpu"),
    (UMMode.ALL, CUDA0, False, (), 0, False, "needs a CUDA device, and CUDA is not available"),
    (UMMode.ALL, CUDA0, True, ("torch.cuda.MemPool",), 0, False, "needs torch.cuda.MemPool, which torch"),
    (UMMode.OFFLOAD, CUDA0, True, ("torch.cuda.MemPool",), 0, False, None),
    (UMMode.ALL, CUDA0, True, (), 4096, False, "must be installed before the first CUDA allocation"),
    (UMMode.ALL, CUDA0, True, (), 4096, True, None),
    (UMMode.OFFLOAD, CUDA0, True, (), 4096, False, None),
    (UMMode.ALL, CUDA0, True, (), 0, False, None),
]


@pytest.mark.parametrize("mode, device, available, missing, reserved, has_pool, expected", REFUSALS)
def test_refusal_table(mode, device, available, missing, reserved, has_pool, expected):
    why = refusal(mode, device, cuda_available=available, missing_features=missing, reserved_bytes=reserved, has_pool=has_pool)
    if expected is None:
        assert why is None
    else:
        assert expected in why
        assert "um=" in why  # every refusal says what to do instead


def test_refusals_say_what_to_do():
    cpu = refusal(UMMode.ALL, CPU, cuda_available=False)
    assert "Use um='off'" in cpu
    old = refusal(UMMode.ALL, CUDA0, cuda_available=True, missing_features=["torch.cuda.MemPool"])
    assert "upgrade torch" in old and "um='offload'" in old
    busy = refusal(UMMode.ALL, CUDA0, cuda_available=True, reserved_bytes=1)
    assert "Do not move the model" in busy and "um='offload'" in busy


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
@pytest.mark.parametrize("mode", ["offload", "all"])
def test_install_refused_on_cpu(mode):
    assert install_unified_memory("off", "cpu") is None
    with pytest.raises(UnifiedMemoryError, match="needs a CUDA device") as info:
        install_unified_memory(mode, "cpu", max_bytes=1 << 20)
    assert info.value.mode == mode and info.value.device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
@pytest.mark.parametrize("mode", ["offload", "all"])
def test_strategy_refuses_on_cpu_before_touching_the_model(mode):
    module = LitModel("mlp")
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = L.Trainer(
        strategy=CPUSwapStrategy(um=mode, um_max_bytes=1 << 20),
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(UnifiedMemoryError, match=f"um='{mode}' needs a CUDA device"):
        trainer.fit(module)
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.strategy.unified_memory is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_accelerate_refuses_on_cpu(monkeypatch):
    from accelerate_swap import SwapAccelerator, SwapPlugin

    with pytest.raises(UnifiedMemoryError, match="um='all' needs a CUDA device"):
        SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(um="all"))
    monkeypatch.setenv("ACCELERATE_CPU_SWAP", "true")
    monkeypatch.setenv("ACCELERATE_CPU_SWAP_UM", "offload")
    monkeypatch.setenv("ACCELERATE_CPU_SWAP_UM_MAX_BYTES", "64MiB")
    with pytest.raises(UnifiedMemoryError, match="um='offload' needs a CUDA device"):
        SwapAccelerator(cpu=True)


# -- the CUDA runtime binding ----------------------------------------------------------------
@pytest.mark.skipif(find_cudart() is None, reason="no libcudart (CPU-only torch build)")
def test_cudart_binding_loads_the_runtime_torch_uses():
    runtime = CudaRuntime()
    assert runtime.path == find_cudart()
    if torch.version.cuda is not None:
        assert runtime.version // 1000 == int(torch.version.cuda.split(".")[0])
    if not torch.cuda.is_available():
        # No GPU or driver here: the error is CUDA's, by name, not a crash.
        with pytest.raises(CudaRuntimeError, match=r"cudaGetDeviceCount failed: cudaError\w+ \(\d+\)") as info:
            runtime.device_count()
        assert info.value.name.startswith("cudaError") and info.value.code != 0
        with pytest.raises(CudaRuntimeError, match="cudaMallocManaged failed"):
            runtime.malloc_managed(4096)
        # the prefetch and advice entry points resolve and take their arguments (the struct
        # forms by value on CUDA 13: Note [Prefetch and advice signatures]); CUDA refuses, by name
        for call, name in [
            (lambda: runtime.prefetch(1 << 20, 4096, 0, 0), "cudaMemPrefetchAsync"),
            (lambda: runtime.prefetch(1 << 20, 4096, CPU_DEVICE, 0), "cudaMemPrefetchAsync"),
            (lambda: runtime.advise(1 << 20, 4096, Advice.SET_PREFERRED_LOCATION, CPU_DEVICE), "cudaMemAdvise"),
            (lambda: runtime.advise(1 << 20, 4096, Advice.SET_ACCESSED_BY, 0), "cudaMemAdvise"),
        ]:
            with pytest.raises(CudaRuntimeError, match=f"{name} failed: cudaError"):
                call()


# -- managed memory accounting ---------------------------------------------------------------
def test_managed_memory_cap_and_ranges():
    runtime = FakeRuntime()
    memory = ManagedMemory(runtime, 0, max_bytes=10_000)
    a = memory.alloc(4000)
    b = memory.alloc(4000)
    assert a and b and memory.managed_bytes == 8000
    assert memory.alloc(4000) == 0  # would exceed the cap: refused, the driver is not asked
    assert memory.refused_allocations == 1 and len(runtime.of("malloc")) == 2
    assert memory.owns(a, 4000) and memory.owns(a + 100, 3900) and not memory.owns(a + 100, 4000)
    assert not memory.owns(12345, 1)
    memory.free(a)
    assert memory.managed_bytes == 4000 and memory.peak_managed_bytes == 8000
    assert not memory.owns(a, 1)
    c = memory.alloc(6000)
    assert c and memory.managed_bytes == 10_000
    memory.free(b)
    memory.free(c)
    memory.free(c)  # twice: ignored
    assert memory.managed_bytes == 0 and runtime.buffers == {}


def test_allocator_callbacks_through_their_c_function_pointers():
    """The malloc/free torch would call, called through the same C pointers."""
    runtime = FakeRuntime()
    memory = ManagedMemory(runtime, 0, max_bytes=1 << 20)
    allocator = _ManagedAllocator(memory)
    malloc_ptr, free_ptr = allocator.function_pointers
    c_malloc = _MALLOC(malloc_ptr)
    c_free = _FREE(free_ptr)
    ptr = c_malloc(1 << 19, 0, None)
    assert ptr and memory.managed_bytes == 1 << 19 and memory.owns(ptr, 1 << 19)
    assert not c_malloc(1 << 20, 0, None)  # over the cap: NULL, which torch turns into its OOM error
    ctypes.memset(ptr, 7, 16)  # the memory is real and writable
    c_free(ptr, 1 << 19, 0, None)
    assert memory.managed_bytes == 0 and runtime.buffers == {}
    c_free(None, 0, 0, None)  # a NULL free is ignored


def test_allocator_callback_never_raises_into_cpp():
    class Broken(FakeRuntime):
        def malloc_managed(self, nbytes):
            raise RuntimeError("boom")

    memory = ManagedMemory(Broken(), 0, max_bytes=1 << 20)
    allocator = _ManagedAllocator(memory)  # held: its thunks die with it (Note [Managed memory outlives the session])
    malloc_ptr, _ = allocator.function_pointers
    assert not _MALLOC(malloc_ptr)(4096, 0, None)
    assert memory.managed_bytes == 0 and memory.refused_allocations == 1


# -- um="offload": managed host buffers in the offload engine ----------------------------------
_PLAIN: dict[str, tuple] = {}


def _plain(name: str):
    if name not in _PLAIN:
        _PLAIN[name] = train_core(name, None)
    return _PLAIN[name]


@pytest.mark.parametrize("policy", ["offload", "recompute_offload"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_managed_offload_equals_plain_and_cleans_up(name, policy):
    unified, runtime = fake_unified()
    model, stats, grads = train_core(name, policy, unified=unified)
    plain_model, _, plain_grads = _plain(name)
    # (a) the same training as plain
    assert_same_state(model, plain_model)
    assert all(torch.equal(grads[k], plain_grads[k]) for k in plain_grads)
    # every offloaded byte went through managed memory, with the advice and migrations of
    # Note [Managed host buffers]
    assert all(s.offloaded_bytes > 0 for s in stats)
    mallocs = runtime.of("malloc")
    advised = {(c[1], c[3], c[4]) for c in runtime.of("advise")}
    for _, ptr, _ in mallocs:
        assert (ptr, Advice.SET_PREFERRED_LOCATION, CPU_DEVICE) in advised
        assert (ptr, Advice.SET_ACCESSED_BY, 0) in advised
    to_host = [c for c in runtime.of("prefetch") if c[3] == CPU_DEVICE]
    to_device = [c for c in runtime.of("prefetch") if c[3] == 0]
    assert sum(c[2] for c in to_device) == sum(s.fetched_bytes for s in stats)
    # each buffer read back went to the device before and back to the host after
    assert sum(c[2] for c in to_host) == sum(s.offloaded_bytes + s.fetched_bytes for s in stats)
    assert all(s.um_prefetched_bytes > 0 for s in stats)
    # (c) runtime removed and graphs gone: every managed byte freed
    gc.collect()
    assert unified.memory.managed_bytes == 0
    assert runtime.buffers == {} and len(runtime.of("free")) == len(mallocs)


def test_managed_offload_reuses_buffers_across_steps():
    unified, runtime = fake_unified()
    _, stats, _ = train_core("mlp", "offload", steps=4, unified=unified)
    first_step_mallocs = stats[0].offloaded_tensors
    # batch grows by one row per step, so some buckets change; most buffers are reused
    assert len(runtime.of("malloc")) < sum(s.offloaded_tensors for s in stats)
    assert len(runtime.of("malloc")) >= first_step_mallocs


def test_managed_offload_memory_matches_pinned_offload():
    """(b) managed buffers are host memory to the meter, exactly like the pinned pool's, so
    the peak is the pinned offload's (which test_profile checks against the plan's
    prediction), far under plain training's."""
    def peak(unified):
        build, data, loss_fn = MODELS["mlp"]
        torch.manual_seed(0)
        model = build()
        x, y = data(1024)
        actions = resolve_policy("offload" if unified is not False else "keep", find_segments(model))
        with SwapRuntime(model, actions, unified=unified or None, min_offload_bytes=0, device="cpu") as runtime:
            runtime.begin_step([x, y])
            loss_fn(model(x), y).backward()
            return runtime.end_step().peak_device_bytes

    unified, _ = fake_unified()
    managed, pinned, plain = peak(unified), peak(None), peak(False)
    assert managed == pinned
    assert managed < 0.4 * plain


def test_cap_turns_into_a_clear_out_of_memory_error_and_nothing_leaks():
    unified, runtime = fake_unified(max_bytes=64 * 1024)
    build, data, loss_fn = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = data(512)
    with SwapRuntime(model, resolve_policy("offload", find_segments(model)), min_offload_bytes=0, unified=unified, device="cpu"):
        with pytest.raises(torch.OutOfMemoryError, match="would exceed um_max_bytes=65536"):
            loss_fn(model(x), y).backward()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    gc.collect()
    assert unified.memory.managed_bytes == 0 and runtime.buffers == {}


# -- um="all": the plan's parameters prefetched ahead of forward and backward --------------------
def _params_in_managed_memory(model: torch.nn.Module, unified: UnifiedMemory) -> dict[int, str]:
    """Move every parameter into a managed block (what um='all' does on a GPU); returns each
    storage's address and the segment (top-level child) it belongs to."""
    owner = {}
    pool = unified.host_pool()
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        buf = pool._allocate(nbytes)
        view = buf.view(p.dtype)[: p.numel()].view_as(p)
        view.copy_(p.data)
        p.data = view
        owner[p.untyped_storage().data_ptr()] = name.split(".")[0]
    return owner


def test_all_mode_prefetches_parameters_one_segment_ahead():
    build, data, loss_fn = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    unified, runtime = fake_unified(UMMode.ALL)
    owner = _params_in_managed_memory(model, unified)
    segments = find_segments(model)
    x, y = data(8)
    with SwapRuntime(model, resolve_policy("keep", segments), unified=unified, device="cpu"):
        unified.always_prefetch_parameters = True
        runtime.calls.clear()
        loss_fn(model(x), y).backward()
    order = []
    for call in runtime.of("prefetch"):
        assert call[3] == 0  # to the device
        segment = owner[call[1]]
        if not order or order[-1] != segment:
            order.append(segment)
    names = list(segments)
    # forward: the first segment, then each next one as the one before it starts; backward:
    # segment i-1 as segment i's backward starts
    assert names == ["0", "1", "2", "3", "4", "5", "6"]
    assert order == ["0", "1", "2", "3", "4", "5", "6"] + ["5", "4", "3", "2", "1", "0"]


def test_all_mode_does_not_prefetch_while_everything_fits():
    build, data, loss_fn = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    unified, runtime = fake_unified(UMMode.ALL)
    _params_in_managed_memory(model, unified)
    unified._device_total = unified.memory.managed_bytes + 1  # the device holds all of it
    x, y = data(8)
    with SwapRuntime(model, resolve_policy("keep", find_segments(model)), unified=unified, device="cpu") as rt:
        rt.begin_step([x, y])
        loss_fn(model(x), y).backward()
        assert rt.end_step().um_prefetched_bytes == 0
    assert runtime.of("prefetch") == []
    unified._device_total = 0  # now it does not fit: prefetch starts
    with SwapRuntime(model, resolve_policy("keep", find_segments(model)), unified=unified, device="cpu") as rt:
        rt.begin_step([x, y])
        loss_fn(model(x), y).backward()
        assert rt.end_step().um_prefetched_bytes > 0
    model.zero_grad(set_to_none=True)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())  # (c)


# -- GPU: run on the GPU machine (pytest -m cuda) --------------------------------------------------
def _cap_bytes() -> int:
    """Safety rule: never ask for more managed memory than the card has free."""
    free, _ = torch.cuda.mem_get_info()
    return min(4 << 30, free // 4)


@pytest.mark.cuda
def test_cuda_offload_mode_equals_pinned_offload():
    unified = install_unified_memory("offload", "cuda", max_bytes=_cap_bytes())
    try:
        for name in ("cnn", "gpt"):
            pinned, p_stats, _ = train_core(name, "offload", device="cuda", steps=3, batch=32)
            managed, m_stats, _ = train_core(name, "offload", device="cuda", steps=3, batch=32, unified=unified)
            assert_same_state(managed, pinned)
            assert all(s.um_prefetched_bytes > 0 and s.offloaded_bytes > 0 for s in m_stats)
            # (b) managed buffers are outside torch's allocator, as pinned ones are
            assert max(s.peak_device_bytes for s in m_stats) <= 1.02 * max(s.peak_device_bytes for s in p_stats)
        gc.collect()
        assert unified.memory.managed_bytes == 0  # (c)
    finally:
        unified.close()


_ALL_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, ".")
from lightning_swap import install_unified_memory
from tests.helpers import train_core
name, cap = sys.argv[1], int(sys.argv[2])
unified = None
if sys.argv[3] == "all":
    unified = install_unified_memory("all", "cuda", max_bytes=cap)
model, stats, grads = train_core(name, "offload" if sys.argv[4] == "offload" else None, device="cuda", steps=3, batch=32, unified=unified)
out = {"state": {k: v.double().sum().item() for k, v in model.state_dict().items()}}
if unified is not None:
    s = unified.stats()
    out.update(managed=s.managed_bytes, peak=s.peak_managed_bytes, reserved=torch.cuda.memory_reserved(), routing=unified.routing)
    unified.close()
print("RESULT" + json.dumps(out))
"""


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["resnet18", "gpt"])
@pytest.mark.parametrize("policy", ["keep", "offload"])
def test_cuda_all_mode_trains_like_the_default_allocator(name, policy, tmp_path):
    """um='all' must precede the first CUDA allocation, so each run is its own process."""
    import json
    import subprocess
    import sys

    results = {}
    for mode in ("off", "all"):
        proc = subprocess.run(
            [sys.executable, "-c", _ALL_SCRIPT, name, str(_cap_bytes()), mode, policy],
            capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
        results[mode] = json.loads(line[len("RESULT"):])
    off, on = results["off"], results["all"]
    assert on["state"].keys() == off["state"].keys()
    for key, value in off["state"].items():
        assert on["state"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # every byte torch reserved came from managed memory, within the cap
    assert on["peak"] >= on["reserved"] > 0 and on["routing"]


@pytest.mark.cuda
def test_cuda_all_mode_refused_once_cuda_memory_is_in_use():
    import subprocess
    import sys

    script = (
        "import torch; torch.ones(1, device='cuda');"
        "from lightning_swap import install_unified_memory, UnifiedMemoryError\n"
        "try:\n    install_unified_memory('all', 'cuda', max_bytes=1 << 28)\n"
        "except UnifiedMemoryError as e:\n    print('REFUSED', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=".")
    assert "REFUSED" in proc.stdout and "before the first CUDA allocation" in proc.stdout, proc.stderr[-2000:]


# -- the adapters hand the installed unified memory to the runtime ------------------------------
class _Tracked(UnifiedMemory):
    closed = 0

    def close(self) -> None:
        type(self).closed += 1
        super().close()


def _fake_install(monkeypatch) -> dict:
    """Every install returns a fake-backed handle: the adapters' wiring, on CPU."""
    made = {}

    def install(self, device):
        if self.um == "off":
            return None
        handle = _Tracked(UMMode(self.um), CPU, ManagedMemory(FakeRuntime(), 0, self.um_max_bytes or 1 << 30), None)
        made.setdefault("handles", []).append(handle)
        return handle

    monkeypatch.setattr(SwapConfig, "install_unified_memory", install)
    _Tracked.closed = 0
    return made


def test_lightning_strategy_uses_managed_buffers_and_closes_them(monkeypatch):
    from .lit import fit

    made = _fake_install(monkeypatch)
    plain, _ = fit("cnn")
    module, trainer = fit("cnn", CPUSwapStrategy(policy="offload", min_offload_bytes=0, um="offload", um_max_bytes=1 << 28))
    assert_same_state(module, plain)
    (handle,) = made["handles"]
    assert handle.memory.max_bytes == 1 << 28
    stats = trainer.strategy.stats_history
    assert stats and all(s.um_prefetched_bytes > 0 for s in stats)
    assert handle.memory.runtime.of("malloc")  # the offloaded bytes went to managed buffers
    # (c) teardown closed it and nothing managed is left
    assert trainer.strategy.unified_memory is None and _Tracked.closed == 1
    gc.collect()
    assert handle.memory.managed_bytes == 0


def test_accelerator_uses_managed_buffers_and_closes_them(monkeypatch):
    from accelerate.state import AcceleratorState, GradientState
    from accelerate_swap import SwapAccelerator, SwapPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    made = _fake_install(monkeypatch)
    accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(policy="offload", min_offload_bytes=0, um="offload"))
    (handle,) = made["handles"]
    assert accelerator.swap_unified_memory is handle
    build, data, loss_fn = MODELS["mlp"]
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(2):
        x, y = data(8 + step)
        accelerator.backward(loss_fn(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        assert accelerator.swap_step_stats.um_prefetched_bytes > 0
    plain, _, _ = train_core("mlp", None, steps=2, batch=8)
    assert_same_state(accelerator.unwrap_model(model), plain)
    accelerator.end_training()
    assert accelerator.swap_unified_memory is None and _Tracked.closed == 1
    gc.collect()
    assert handle.memory.managed_bytes == 0
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_old_torch_is_named_in_the_refusal(monkeypatch):
    from lightning_swap.core import unified

    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    missing = unified._missing_features()
    assert "torch >= 2.8" in missing
    why = refusal(UMMode.ALL, CUDA0, cuda_available=True, missing_features=missing)
    assert "torch >= 2.8" in why and "2.5.1" in why and "um='offload'" in why
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    assert "torch >= 2.8" not in unified._missing_features()


def test_install_all_routes_to_one_pool_per_process_without_a_gpu(monkeypatch):
    """install_unified_memory's own logic for um='all', with torch's CUDA surface faked: the
    refusal once torch holds memory, routing begun and ended on the pool, the pool reused by a
    second install in the same process (Lightning's fit then test), the default cap."""
    from types import SimpleNamespace

    from lightning_swap.core import unified as um

    calls = []

    class FakePool:
        def __init__(self, allocator):
            self.allocator = allocator
            self.id = (0, 7)

    reserved = [4096]
    monkeypatch.setattr(um, "_LIVE", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved[0])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 16 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=16 << 30))
    monkeypatch.setattr(torch.cuda, "MemPool", FakePool)
    for name in ("begin", "end", "release"):
        attr = {"begin": "_cuda_beginAllocateToPool", "end": "_cuda_endAllocateToPool", "release": "_cuda_releasePool"}[name]
        monkeypatch.setattr(torch._C, attr, lambda d, pid, name=name: calls.append((name, d, pid)), raising=False)

    with pytest.raises(UnifiedMemoryError, match="before the first CUDA allocation"):
        install_unified_memory("all", "cuda", max_bytes=1 << 30, runtime=FakeRuntime())
    assert um._LIVE == {} and calls == []

    reserved[0] = 0
    handle = install_unified_memory("all", "cuda", max_bytes=1 << 30, runtime=FakeRuntime())
    assert handle.routing and calls == [("begin", 0, (0, 7))]
    assert um._LIVE[0] is handle._allocator and handle.memory.max_bytes == 1 << 30
    assert isinstance(handle._allocator.allocator, torch._C._cuda_CUDAAllocator)  # torch's object over our pointers
    handle.close()
    handle.close()  # idempotent
    assert calls[1:] == [("end", 0, (0, 7)), ("release", 0, (0, 7))] and not handle.routing

    reserved[0] = 1 << 20  # the weights of the first run, in our pool
    again = install_unified_memory("all", "cuda")
    assert again._allocator is handle._allocator and again.memory is handle.memory and again.routing
    assert again.memory.max_bytes == 8 << 30  # default cap: the free memory
    again.close()
    assert calls[3:] == [("begin", 0, (0, 7)), ("end", 0, (0, 7)), ("release", 0, (0, 7))]


def test_plugin_um_options_round_trip_through_env_and_file(tmp_path):
    from accelerate_swap import SwapPlugin
    from accelerate_swap.cli import main as cli_main

    plugin = SwapPlugin(um="ALL", um_max_bytes=2 << 30)
    assert plugin.um == "all" and plugin.to_config().um == "all"
    env = plugin.to_env()
    assert env["ACCELERATE_CPU_SWAP_UM"] == "all" and env["ACCELERATE_CPU_SWAP_UM_MAX_BYTES"] == str(2 << 30)
    assert SwapPlugin.from_env(env) == plugin
    path = tmp_path / "swap.yaml"
    assert cli_main(["config", "--config_file", str(path), "--um", "offload", "--um_max_bytes", "1GiB"]) == 0
    assert SwapPlugin.from_yaml(path) == SwapPlugin(um="offload", um_max_bytes=1 << 30)
    with pytest.raises(ValueError, match="ACCELERATE_CPU_SWAP_UM_MAX_BYTES.*applies only with um='offload' or um='all'"):
        SwapPlugin.from_env({"ACCELERATE_CPU_SWAP": "1", "ACCELERATE_CPU_SWAP_UM_MAX_BYTES": "1GiB"})


def test_fake_runtime_has_the_real_runtimes_signatures():
    """Everything on CPU runs against FakeRuntime; it must accept exactly what CudaRuntime
    accepts, or the GPU path fails where no CPU test looks."""
    import inspect

    for name in ("malloc_managed", "free", "prefetch", "advise", "as_tensor"):
        real = list(inspect.signature(getattr(CudaRuntime, name)).parameters)
        fake = list(inspect.signature(getattr(FakeRuntime, name)).parameters)
        assert real == fake, name
