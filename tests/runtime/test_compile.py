"""``torch.compile`` under the runtime (Note [Actions around compiled segments] in
``core/compiled.py``, Notes [Regional compilation is taken over] and [No dispatch mode under
compile] in ``core/runtime/runtime.py``): every way users compile (``torch.compile(model)``,
``model.compile()``, each block on its own, a LightningModule compiled before ``fit`` or in
``configure_model``) under ``keep``, ``offload``, ``recompute`` and ``auto`` trains to the same
weights as the same compiled model without the library, Dynamo really compiles, the graph
breaks are the ones stated, and ``remove()`` gives the user's compiled module back.

Every run uses the ``aot_eager`` backend (through :class:`Counting`, which counts the graphs it
compiles and how often they run): AOTAutograd's graphs without Inductor's code generation, so
the tests are fast on CPU and, running the same aten ops as eager, give bit-identical results,
hence ``torch.equal`` throughout.

Graph breaks are read from Dynamo's counters: ``graph_break`` counts breaks Dynamo resumed
after (one per call of a non-``KEEP`` segment, or of any segment when the offload engine's
hooks are on every segment); a break inside a ``for`` loop cannot be resumed, so Dynamo runs
that frame eagerly, once per code object (``loop_skips``), and the segments inside it are still
compiled, each as its own graph.
"""

from __future__ import annotations

import logging
import os
import shutil

import lightning as L
import pytest
import torch
from torch import nn
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from lightning_swap import Action, CPUSwapStrategy, SwapRuntime, find_segments
from lightning_swap.core import resolve_policy
from lightning_swap.core.config import SwapConfig
from lightning_swap.core.scale.session import SwapSession

from ..helpers import QUIET_TRAINER, assert_same_state, swap_runtime

STEPS = 3


class Counting:
    """A Dynamo backend: ``aot_eager`` (or ``inner``), counting graphs compiled and graph runs (forwards)."""

    def __init__(self, inner=aot_eager) -> None:
        self.inner = inner
        self.compiled = 0
        self.runs = 0

    def __call__(self, gm, example_inputs):
        self.compiled += 1
        compiled = self.inner(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)

        return run


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Blocks called in a loop, as transformers do."""

    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class Unrolled(Net):
    """The same blocks called one by one: Dynamo resumes after each graph break."""

    def forward(self, x):
        x = self.inp(x)
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        x = self.blocks[2](x)
        return self.out(x)


class NormBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.BatchNorm1d(d)

    def forward(self, x):
        return x + torch.relu(self.norm(self.fc(x)))


class NormNet(Net):
    """Blocks with BatchNorm: the recomputation must not update the running statistics twice."""

    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__(d, n)
        self.blocks = nn.ModuleList(NormBlock(d) for _ in range(n))


class InPlaceBlock(nn.Module):
    """In-place ops on what selective caches: ``relu_`` on a matmul's output, ``+=`` into another's."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        out = self.fc2(self.act(self.fc1(self.norm(x))))
        out += x
        return out


class InPlaceNet(Net):
    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__(d, n)
        self.blocks = nn.ModuleList(InPlaceBlock(d) for _ in range(n))


def _batches(steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(steps)]


def _breaks() -> tuple[int, int]:
    """(graph breaks Dynamo resumed after, frames it ran eagerly for a break in a loop)."""
    resumed = sum(counters["graph_break"].values())
    skipped = sum(v for k, v in counters["unimplemented"].items() if "graph break in loop" in k and "While handling" in k)
    return resumed, skipped


def _compile(model: nn.Module, how: str, backend: Counting, fullgraph: bool = False) -> nn.Module:
    if how == "torch.compile":
        return torch.compile(model, backend=backend, fullgraph=fullgraph)
    if how == "module.compile":
        model.compile(backend=backend, fullgraph=fullgraph)
        return model
    if how == "regional":
        for block in model.blocks:
            block.compile(backend=backend, fullgraph=fullgraph)
        return model
    if how == "regional torch.compile":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend=backend, fullgraph=fullgraph)
        return model
    assert how == "eager"
    return model


def _fresh(how: str, cls, fullgraph: bool):
    """Dynamo reset, a new counting backend, a seeded model, its optimizer and its compiled form."""
    torch._dynamo.reset()
    counters.clear()
    backend = Counting()
    torch.manual_seed(0)
    model = cls()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return backend, model, optimizer, _compile(model, how, backend, fullgraph)


def _train(how: str, policy, *, cls=Net, fullgraph: bool = False, measure: bool = False, steps: int = STEPS):
    """Train ``cls`` compiled ``how``; ``policy`` None is the compiled model without the library.
    Returns (model, stats, backend, graph runs in the last step, (resumed, skipped) breaks)."""
    backend, model, optimizer, compiled = _fresh(how, cls, fullgraph)
    runtime = None
    if policy is not None:
        plan = policy if isinstance(policy, dict) else resolve_policy(policy, find_segments(compiled))
        runtime = SwapRuntime(compiled, plan, device="cpu", min_offload_bytes=0).install()
    stats, last_runs = [], 0
    try:
        for x, y in _batches(steps):
            runs = backend.runs
            if runtime is not None:
                runtime.begin_step([x, y, optimizer.state], measure=measure)
            loss = nn.functional.mse_loss(compiled(x), y)
            loss.backward()
            if runtime is not None:
                stats.append(runtime.end_step())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            last_runs = backend.runs - runs
    finally:
        if runtime is not None:
            runtime.remove()
    return model, stats, backend, last_runs, _breaks()


_PLAIN: dict = {}


def _plain(how: str, cls=Net):
    key = (how, cls)
    if key not in _PLAIN:
        _PLAIN[key] = _train(how, None, cls=cls)
    return _PLAIN[key]


# -- the core runtime ------------------------------------------------------------------------------
#: how -> policy -> (graph runs in a compiled step, (resumed breaks, loop-skipped frames)), measured.
#: Whole model: plain runs one graph per step. KEEP with no hooks leaves the model as compiled.
#: A recomputed segment (recompute, selective) is traced into that graph as a checkpoint, no break
#: (Note [Recomputation inside the compiled graph] in ``core/compiled.py``; its first call ran
#: eagerly in the metered first step). An offloaded segment breaks the graph at its call; in the
#: loop Dynamo runs ``Net.forward`` eagerly and each block runs its own graph (3 per step).
#: Regional: taken over, no break at all; a recomputed block's graph runs once, its recomputation
#: inside its backward graph (it ran again, 6, when checkpoint recomputed it eagerly).
EXPECTED = {
    "torch.compile": {None: (1, (0, 0)), "keep": (1, (0, 0)), "offload": (3, (0, 1)), "recompute": (1, (0, 0))},
    "module.compile": {None: (1, (0, 0)), "keep": (1, (0, 0)), "offload": (3, (0, 1)), "recompute": (1, (0, 0))},
    "regional": {None: (3, (0, 0)), "keep": (3, (0, 0)), "offload": (3, (0, 0)), "recompute": (3, (0, 0))},
    "regional torch.compile": {None: (3, (0, 0)), "keep": (3, (0, 0)), "offload": (3, (0, 0)), "recompute": (3, (0, 0))},
}
for _row in EXPECTED.values():
    _row["selective"] = _row["recompute"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["keep", "offload", "recompute", "selective"])
@pytest.mark.parametrize("how", sorted(EXPECTED))
def test_runtime_equals_compiled_plain_and_compiles(how, policy):
    plain, _, plain_backend, plain_runs, plain_breaks = _plain(how)
    assert (plain_runs, plain_breaks) == EXPECTED[how][None]
    model, stats, backend, runs, breaks = _train(how, policy)
    assert_same_state(model, plain)
    assert backend.compiled > 0
    # The last step (not measured, so not under the CPU meter) ran compiled graphs.
    assert stats[-1].peak_device_bytes is None
    assert (runs, breaks) == EXPECTED[how][policy]
    if policy == "offload":
        assert stats[-1].offloaded_bytes > 0 and stats[-1].fetched_bytes + stats[-1].reused_bytes == stats[-1].offloaded_bytes


@pytest.mark.parametrize(
    "plan, resumed",
    [
        ({"blocks.0": Action.KEEP, "blocks.1": Action.OFFLOAD, "blocks.2": Action.KEEP}, 3),
        ({"blocks.0": Action.KEEP, "blocks.1": Action.RECOMPUTE_OFFLOAD, "blocks.2": Action.KEEP}, 3),
        # Recomputed: traced into the graph (Note [Recomputation inside the compiled graph]).
        ({"blocks.0": Action.KEEP, "blocks.1": Action.RECOMPUTE, "blocks.2": Action.KEEP}, 0),
        ({"blocks.0": Action.RECOMPUTE, "blocks.1": Action.SELECTIVE, "blocks.2": Action.RECOMPUTE}, 0),
    ],
)
@pytest.mark.slow
def test_one_graph_break_per_segment_that_acts(plan, resumed):
    """The offload engine's hooks are on every segment (Note [Stream protocol]): each call breaks;
    a recomputed segment is traced into the enclosing graph."""
    plain = _plain("torch.compile", Unrolled)[0]
    model, stats, backend, runs, breaks = _train("torch.compile", plan, cls=Unrolled)
    assert_same_state(model, plain)
    assert breaks == (resumed, 0)
    # Graphs: the code between breaks, and each acting segment's own graph; else one graph.
    assert runs > 0 and (backend.compiled > 1 if resumed else runs == 1)


def test_fullgraph_whole_model_with_an_action_is_refused_clearly():
    model = torch.compile(Net(), backend=Counting(), fullgraph=True)
    with pytest.raises(ValueError, match=r"compiled with fullgraph=True.*compile each block on its own"):
        swap_runtime(model, "recompute", device="cpu").install()
    with pytest.raises(ValueError, match=r"fullgraph=True.*offload engine"):  # its hooks are on KEEP segments too
        SwapRuntime(model, {"blocks.0": Action.KEEP, "blocks.1": Action.OFFLOAD}, device="cpu").install()
    assert "forward" not in model._orig_mod.blocks[0].__dict__  # nothing left installed
    # KEEP alone runs nothing around the segments: accepted, the graph stays whole.
    plain = _plain("torch.compile")[0]
    trained, _, _, runs, breaks = _train("torch.compile", "keep", fullgraph=True)
    assert_same_state(trained, plain)
    assert (runs, breaks) == (1, (0, 0))


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_regional_fullgraph_works(policy):
    plain = _plain("regional")[0]
    model, stats, backend, runs, breaks = _train("regional", policy, fullgraph=True)
    assert_same_state(model, plain)
    assert runs == EXPECTED["regional"][policy][0] and breaks == (0, 0)


@pytest.mark.parametrize("how", ["torch.compile", "regional"])
def test_compiled_after_install_is_rewrapped(how):
    """A runtime installed on the eager model sees the compilation at the next step."""
    torch._dynamo.reset()
    counters.clear()
    backend = Counting()
    torch.manual_seed(0)
    model = Net()
    runtime = swap_runtime(model, "offload", device="cpu", min_offload_bytes=0).install()
    try:
        if how == "torch.compile":
            model.compile(backend=backend)
        else:
            _compile(model, "regional", backend)
        for x, y in _batches(2):  # the first step measures the plan's rows (Note [Measured rows]): eager
            runs = backend.runs
            runtime.begin_step([x, y])
            nn.functional.mse_loss(model(x), y).backward()
            stats = runtime.end_step()
        assert runtime.compiled and stats.peak_device_bytes is None
        assert backend.runs - runs == 3 and stats.offloaded_bytes > 0
    finally:
        runtime.remove()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torch.compile", "regional"])
def test_recompute_of_compiled_batch_norm_updates_statistics_once(how):
    """Note [Recompute leaves buffers alone] in recompute.py, with the segment's graph compiled."""
    plain = _plain(how, NormNet)[0]
    model, _, backend, runs, _ = _train(how, "recompute", cls=NormNet)
    assert_same_state(model, plain)  # running_mean, running_var, num_batches_tracked included
    assert int(model.blocks[0].norm.num_batches_tracked) == STEPS
    assert runs == 6  # 3 forwards and 3 recomputations, compiled


def _inductor_train(how: str, policy, cls=Net) -> dict:
    """Two SGD steps of ``cls`` compiled ``how`` by Inductor (``policy`` None: without the library)."""
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()
    backend = Counting(compile_fx)
    torch.manual_seed(0)
    model = cls()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    compiled = _compile(model, how, backend)
    runtime = None
    if policy is not None:
        runtime = swap_runtime(compiled, policy, device="cpu").install()
    try:
        for x, y in _batches(2):
            runs = backend.runs
            if runtime is not None:
                runtime.begin_step([x, y, optimizer.state])
            nn.functional.mse_loss(compiled(x), y).backward()
            if runtime is not None:
                runtime.end_step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        if runtime is not None:
            runtime.remove()
    # Recomputed or not, each block's graph runs once a step (Note [Recomputation inside the compiled graph]).
    assert backend.compiled > 0 and (how != "regional" or backend.runs - runs == 3)
    return model.state_dict()


def _worst_relative(ours: dict, plain: dict) -> float:
    return max(float((ours[k] - plain[k]).abs().max() / plain[k].abs().max().clamp_min(1e-12)) for k in plain)


_NEEDS_CC = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="Inductor on CPU needs a C compiler")


@pytest.mark.slow
@_NEEDS_CC
def test_inductor_regional_recompute_matches_inductor_plain():
    """The backend users run (about 15 s here, compiling C++ once). Tolerance: the library's
    first step measures the plan's rows under the CPU meter, so it runs eagerly (Note [No
    dispatch mode under compile]), and eager and Inductor's fused kernels round float32
    differently; after two steps the weights differ by at most 3e-7 of their size (measured),
    bounded here by 1e-5. Every later step runs Inductor's code, checked by the counting backend."""
    assert _worst_relative(_inductor_train("regional", "recompute"), _inductor_train("regional", None)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("how", ["regional", "torch.compile"])
@pytest.mark.parametrize("action", [Action.RECOMPUTE, Action.SELECTIVE])
def test_a_compiled_segment_recomputed_without_a_metered_step_equals_compiled_plain(action, how):
    """Note [Checkpointed segments must not modify their input]: a segment's first checkpointed
    call runs eagerly under the in-place watch, and so must its recomputation: the compiled graph
    saves other tensors than the eager ops (checkpoint refused the mismatch when the runtime was
    used without ``begin_step``, whose metered first step runs everything eagerly). The whole
    model compiled: the first call breaks the graph at each segment, later ones trace it in
    (Note [Recomputation inside the compiled graph]); three steps, so one runs that graph again."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    models = []
    for ours in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Unrolled()
        if how == "regional":
            for block in model.blocks:
                block.compile(backend=aot_eager)
        else:
            model.compile(backend=aot_eager)
        runtime = SwapRuntime(model, {n: action for n in find_segments(model)}, device="cpu").install() if ours else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if runtime is not None:
            runtime.remove()
        models.append(model)
    assert_same_state(models[1], models[0])


# -- selective with in-place ops (issue 22) -----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("how", ["eager", "regional", "torch.compile", "module.compile"])
def test_selective_with_in_place_ops_equals_compiled_plain(how):
    """Notes [Selective never replays a mutated tensor] and [Selective under compile] in
    ``engine/recompute.py``: ``relu_`` and ``+=`` on outputs selective would cache; eager and
    compiled (``aot_eager``: bit-identical), regional and whole model."""
    plain = _plain(how, InPlaceNet)[0]
    model, _, backend, _, _ = _train(how, "selective", cls=InPlaceNet)
    assert_same_state(model, plain)
    assert how == "eager" or backend.compiled > 0


_WHOLE = ["torch.compile"] if os.environ.get("LIGHTNING_SWAP_ZOO", "").strip().lower() == "full" else []


@pytest.mark.slow
@_NEEDS_CC
@pytest.mark.parametrize("how", ["regional", *_WHOLE])
def test_inductor_selective_with_in_place_ops_matches_inductor_plain(how):
    """The issue's crash (``Tensor cached during selective activation checkpoint has been
    mutated``): Inductor calls ``mm`` with ``out=`` buffers it reuses. The tolerance of
    :func:`test_inductor_regional_recompute_matches_inductor_plain`. The whole model compiled by
    Inductor (another 15 s) runs with ``LIGHTNING_SWAP_ZOO=full``."""
    assert _worst_relative(_inductor_train(how, "selective", InPlaceNet), _inductor_train(how, None, InPlaceNet)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("cls, refused", [(InPlaceNet, ()), (NormNet, (Action.SELECTIVE,))])
def test_auto_plans_selective_for_a_compiled_segment_only_where_it_recomputes_in_graph(cls, refused):
    """Note [Refused actions]: a compiled segment recomputes inside its graph (Note [Recomputation
    inside the compiled graph]), selective included, unless it holds buffers (BatchNorm's running
    statistics): then checkpoint recomputes it eagerly, selective would cache nothing, and the
    observed profile marks selective refused."""
    backend, model, optimizer, compiled = _fresh("regional", cls, False)
    session = SwapSession(compiled, SwapConfig(budget_bytes=1 << 30, min_offload_bytes=0, log_plan=False), "cpu")
    try:
        _session_steps(session, compiled, optimizer, backend, 3)
        assert session.profile is not None
        blocks = [s for s in session.profile.segments if s.name.startswith("blocks.")]
        assert len(blocks) == 3 and all(s.refused == refused for s in blocks)
        assert all("compiled" in s.refusal for s in blocks if s.refused)
    finally:
        session.remove()


def _saved_bytes_of_a_compiled_step(policy, how: str) -> int:
    """The bytes autograd holds for backward after a compiled forward (regional, Inductor's
    partitioner through ``aot_eager``): every tensor the graphs save, by storage, parameters left
    out. The CPU meter cannot watch compiled code (Note [No dispatch mode under compile]); the
    saved-tensor hooks see what each compiled graph saves."""
    backend, model, optimizer, compiled = _fresh(how, lambda: Net(d=64), False)
    plan = resolve_policy(policy, find_segments(compiled)) if policy is not None else None
    runtime = SwapRuntime(compiled, plan, device="cpu", min_offload_bytes=0).install() if plan is not None else None
    x = torch.randn(256, 8)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    try:
        if runtime is not None:  # the first call: eager, metered (its input check), as begin_step runs it
            runtime.begin_step([x], measure=True)
        compiled(x).sum().backward()
        if runtime is not None:
            runtime.end_step()
        runs = backend.runs
        saved = _saved_storage_bytes(lambda: compiled(x), skip=params)
        assert backend.runs - runs == (3 if how == "regional" else 1)  # compiled, not eager
    finally:
        if runtime is not None:
            runtime.remove()
    return saved


def _saved_storage_bytes(forward, skip=frozenset()) -> int:
    """``forward()`` under saved-tensor hooks, then its backward: the bytes of the storages autograd
    held for backward, those whose data pointer is in ``skip`` left out."""
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    out.sum().backward()
    return sum(storages.values())


@pytest.mark.slow
@pytest.mark.parametrize("how", ["regional", "torch.compile"])
def test_a_compiled_segment_recomputed_in_graph_saves_less(how):
    """Memory of Note [Recomputation inside the compiled graph]: recomputed, each block keeps its
    input alone (256 x 64 float32 = 64 KiB, and the model's input and output layers theirs);
    selective keeps its matmuls' outputs besides (the ``fc1`` output, 128 KiB, less what it
    recomputes); keep, everything. Measured: 846 KiB kept, 648 selective, 264 recomputed."""
    keep, selective, recompute = (_saved_bytes_of_a_compiled_step(p, how) for p in (None, "selective", "recompute"))
    block_input = 256 * 64 * 4
    assert recompute < selective < keep
    assert keep - recompute >= 3 * 2 * block_input  # each block's norm, fc1 and relu outputs, at least
    assert selective - recompute >= 3 * 2 * block_input  # each block's fc1 output (128 KiB)


def _snapshot(model: nn.Module) -> dict:
    """What compilation put in each module's ``__dict__`` (forward, _compiled_call_impl)."""
    return {
        name: {k: m.__dict__.get(k) for k in ("forward", "_compiled_call_impl")}
        for name, m in model.named_modules()
    }


@pytest.mark.parametrize("how", ["torch.compile", "module.compile", "regional", "regional torch.compile"])
@pytest.mark.parametrize("policy", ["keep", "offload", "recompute"])
def test_remove_restores_the_compiled_module(how, policy):
    torch._dynamo.reset()
    model = Net()
    compiled = _compile(model, how, Counting())
    before = _snapshot(compiled)
    outer = compiled.__dict__.get("forward"), compiled.__dict__.get("_compiled_call_impl")
    runtime = swap_runtime(compiled, policy, device="cpu").install()
    x, y = _batches(1)[0]
    runtime.begin_step([x, y])
    nn.functional.mse_loss(compiled(x), y).backward()
    runtime.end_step()
    if how.startswith("regional") and policy != "keep":  # Note [Regional compilation is taken over]
        for i, slot in enumerate(compiled.blocks):
            block = model.blocks[i] if how == "regional" else slot._orig_mod
            assert "_compiled_call_impl" not in block.__dict__ or block._compiled_call_impl is None
            if how == "regional torch.compile":
                assert slot.forward == block.__call__  # the wrapper calls the module, uncompiled
            assert callable(block.__dict__["forward"])  # the runtime's, compiling the forward itself
    runtime.remove()
    after = _snapshot(compiled)
    assert after.keys() == before.keys()
    assert all(after[n][k] is before[n][k] for n in before for k in before[n])
    assert (compiled.__dict__.get("forward"), compiled.__dict__.get("_compiled_call_impl")) == outer
    runtime.remove()  # idempotent
    assert _snapshot(compiled) == after


def test_peak_is_measured_only_when_asked_under_compile_on_cpu(caplog):
    with caplog.at_level(logging.INFO, logger="lightning_swap.core.runtime.runtime"):
        _, stats, backend, runs, _ = _train("torch.compile", "offload")
    # The first step measures the plan's rows with the meter (Note [Measured rows]): eager.
    assert isinstance(stats[0].peak_device_bytes, int) and stats[0].peak_device_bytes > 0
    assert [s.peak_device_bytes for s in stats[1:]] == [None, None]
    assert sum("not measured on CPU" in r.getMessage() for r in caplog.records) == 1  # logged once
    assert runs == 3
    _, stats, _, runs, _ = _train("torch.compile", "offload", measure=True)
    assert all(isinstance(s.peak_device_bytes, int) and s.peak_device_bytes > 0 for s in stats)
    assert runs == 0  # the dispatch-mode meter makes Dynamo run the step eagerly
    _, stats, _, _, _ = _train("eager", "offload")  # not compiled: every step measured
    assert all(isinstance(s.peak_device_bytes, int) for s in stats)


def test_offload_engine_offloads_what_the_compiled_graphs_save():
    eager = _train("eager", "offload")[1][-1]
    for how in ("torch.compile", "regional"):
        stats = _train(how, "offload")[1]
        last = stats[-1]
        assert last.peak_device_bytes is None  # a compiled step
        assert last.offloaded_bytes > 0 and last.fetched_bytes + last.reused_bytes == last.offloaded_bytes
        assert last.offloaded_tensors > 0
        # What the compiled graphs save passes through the hooks: here (aot_eager's default
        # partition of these blocks) the same bytes and tensors as eager saves (measured: 25344, 15).
        assert (last.offloaded_bytes, last.offloaded_tensors) == (eager.offloaded_bytes, eager.offloaded_tensors)


# -- the session (policy "auto" driven directly) ------------------------------------------------------
def _session_steps(session, compiled, optimizer, backend, steps: int) -> tuple[list, list]:
    """``steps`` training steps driven through ``session`` as the adapters drive it: each step's
    kind and the compiled graph runs its forward and backward made."""
    kinds, runs = [], []
    for x, y in _batches(steps):
        kinds.append(session.open_step(x, [x, y, optimizer.state], [optimizer]))
        before = backend.runs
        loss = nn.functional.mse_loss(compiled(x), y)
        with session.backward():
            loss.backward()
        ran = backend.runs - before
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        session.close_step()
        runs.append(ran)
    return kinds, runs


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torch.compile", "regional"])
def test_session_auto_plans_and_trains_compiled(how):
    steps = 6
    plain = _train(how, None, steps=steps)[0]
    backend, model, optimizer, compiled = _fresh(how, Net, False)
    # A budget below the steady plain peak (67 KB eager; offload: 54 KB), so the plan acts.
    session = SwapSession(compiled, SwapConfig(budget_bytes=60_000, min_offload_bytes=0, log_plan=False), "cpu")
    try:
        kinds, runs = _session_steps(session, compiled, optimizer, backend, steps)
        assert set(session.plan.actions.values()) != {Action.KEEP}
    finally:
        session.remove()
    assert_same_state(model, plain)
    # The first step (the lowest-memory plan, traced: eager; Note [Auto learns from the steps it
    # runs]), then the plan's first step, measured (eager: its check), and from there the plan runs
    # compiled, unmetered on CPU (Note [No dispatch mode under compile]).
    assert kinds == ["first", "plan"] + ["run"] * (steps - 2)
    assert runs[:2] == [0, 0] and all(r > 0 for r in runs[2:])
    peaks = [s.peak_device_bytes for s in session.records.all()]
    assert all(p is not None and p <= 60_000 for p in peaks[:2])  # the steps measured, within the budget


# -- Lightning -----------------------------------------------------------------------------------
class Lit(L.LightningModule):
    def __init__(self, compile_in: str = "none", backend=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Net()
        self.compile_in = compile_in
        self.backend = backend
        self.calls = 0

    def configure_model(self):
        if self.compile_in == "configure_model":
            self.model = torch.compile(self.model, backend=self.backend)
        elif self.compile_in == "configure_model regional":
            for block in self.model.blocks:
                block.compile(backend=self.backend)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        self.calls += 1
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(160, 8, generator=g), torch.randn(160, 1, generator=g)), batch_size=32)


def _fit(compile_in: str, strategy, steps: int = 5):
    torch._dynamo.reset()
    counters.clear()
    backend = Counting()
    L.seed_everything(0, verbose=False)
    module = Lit(compile_in, backend)
    given = torch.compile(module, backend=backend) if compile_in == "before fit" else module
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, num_sanity_val_steps=0, **QUIET_TRAINER,
    )
    plans = PlansSeen()
    trainer.callbacks.append(plans)
    trainer.fit(given)
    module.plans = plans.ids
    return module, trainer, backend


class PlansSeen(L.Callback):
    """The plan in force after each batch: ``auto`` must settle, not re-plan every step."""

    def __init__(self) -> None:
        self.ids: list = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.ids.append(id(getattr(trainer.strategy, "plan", None)))


_LIT_PLAIN: dict = {}


@pytest.mark.parametrize(
    "compile_in, policy",
    [
        ("configure_model", "keep"),
        ("configure_model", "offload"),
        ("configure_model", "recompute"),
        ("configure_model", "auto"),
        ("before fit", "offload"),
        ("before fit", "auto"),
        ("configure_model regional", "recompute"),
        ("configure_model regional", "auto"),
    ],
)
@pytest.mark.slow
def test_lightning_compiled_equals_compiled_plain(compile_in, policy):
    if compile_in not in _LIT_PLAIN:
        _LIT_PLAIN[compile_in] = _fit(compile_in, "auto")
    plain, _, plain_backend = _LIT_PLAIN[compile_in]
    assert plain_backend.compiled > 0
    kwargs = dict(budget_bytes=60_000) if policy == "auto" else dict(policy=policy)
    ours, trainer, backend = _fit(compile_in, CPUSwapStrategy(min_offload_bytes=0, **kwargs))
    assert_same_state(ours, plain)
    assert ours.calls == plain.calls == 5  # no hidden extra run of training_step
    assert backend.compiled > 0 and backend.runs > 0
    stats = trainer.strategy.stats_history
    assert stats[-1].peak_device_bytes is None  # the last step ran compiled, without the meter
    resumed, skipped = _breaks()
    acting = policy not in ("keep", "recompute")  # recompute: traced into the graph, no break
    if compile_in == "configure_model":  # the model's loop over blocks: as in the core tests
        assert (resumed, skipped) == (0, int(acting))
    elif compile_in == "before fit":
        # Lightning compiles training_step too, and Dynamo recompiles it every step (it
        # specializes on the int self.calls; plain does too): at most one resumed break per
        # compiled training_step frame (measured: offload 5, auto 4), one loop frame skipped.
        assert resumed <= 5 * acting and skipped == int(acting)
    else:  # regional: taken over, no break
        assert (resumed, skipped) == (0, 0)
    if policy == "auto":
        assert set(trainer.strategy.plan.actions.values()) != {Action.KEEP}
        assert len(set(ours.plans[-3:])) == 1  # the plan settled: its check step was measured


# -- Hugging Face models compiled whole, recomputed inside the graph ----------------------------------
def _hf_causal(name: str):
    t = pytest.importorskip("transformers", reason="Hugging Face models need transformers (the `test` extra)")
    common = dict(vocab_size=64, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if name == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                              attn_pdrop=0.0, **common))
    return t.LlamaForCausalLM(t.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                            num_key_value_heads=1, max_position_embeddings=32, **common))


@pytest.mark.slow
@pytest.mark.parametrize("name, policy", [("gpt2", "selective"), ("llama", "recompute")])
def test_hugging_face_model_compiled_whole_recomputes_in_graph_to_the_same_weights(name, policy):
    """Note [Recomputation inside the compiled graph] on models users bring: blocks called in a
    loop with a key/value cache argument (Note [A recomputed segment fills no cache]), the whole
    model compiled (``aot_eager``); three steps, the first measured eagerly as the strategy runs
    it. Same weights as the compiled model without the library, the same graph breaks (the
    segments traced in), and no segment refused."""
    states, breaks = [], []
    for ours in (False, True):
        backend, _, _, _ = _fresh("eager", Net, False)  # a reset Dynamo and a fresh counting backend
        torch.manual_seed(0)
        model = _hf_causal(name)
        model.train()
        compiled = torch.compile(model, backend=backend)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runtime = None
        if ours:
            runtime = SwapRuntime(compiled, resolve_policy(policy, find_segments(compiled)), device="cpu").install()
        try:
            for step in range(3):
                ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(step))
                if runtime is not None:
                    runtime.begin_step([ids, optimizer.state])
                compiled(input_ids=ids, labels=ids).loss.backward()
                if runtime is not None:
                    runtime.end_step()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            assert backend.compiled > 0 and backend.runs > 0
            breaks.append(_breaks())
            if runtime is not None:
                assert runtime.refusals == {}
        finally:
            if runtime is not None:
                runtime.remove()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    assert breaks[1] == breaks[0]
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0]), [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]


class InputWritingBlock(Block):
    """Writes into its input: checkpoint cannot recompute it from that input (Note [Checkpointed
    segments must not modify their input])."""

    def forward(self, x):
        x.mul_(0.5)
        return super().forward(x)


class InputWritingNet(Net):
    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__(d, n)
        self.blocks = nn.ModuleList(InputWritingBlock(d) for _ in range(n))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["regional", "torch.compile"])
def test_a_compiled_segment_writing_into_its_input_is_recomputed_eagerly_from_a_copy(how):
    """Such a segment never takes the traced checkpoint (Note [Recomputation inside the compiled
    graph]): the eager one recomputes it from a copy of its input, with selective caching nothing
    around the compiled code (Note [Selective under compile]); same weights as compiled plain."""
    plain = _plain(how, InputWritingNet)[0]
    model, _, backend, _, _ = _train(how, "selective", cls=InputWritingNet)
    assert_same_state(model, plain)
    assert backend.compiled > 0


@pytest.mark.slow
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_compiled_segments_with_other_ops_saved_do_not_share_a_graph(order):
    """Dynamo caches compiled code per code object and does not guard on the policy a closure
    holds: each policy gets its own code object (``_in_graph``), so two regional blocks whose
    plan saves other ops keep other bytes, whichever compiles first (found by the second reader:
    the first block's policy ran for both)."""
    from lightning_swap.core import Plan

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net(n=2)
    for block in model.blocks:
        block.compile(backend=aot_eager)
    saves = {"blocks.0": ("aten.addmm.default", "aten.native_layer_norm.default"), "blocks.1": ()}
    runtime = SwapRuntime(model, Plan(actions={n: Action.SELECTIVE for n in saves}, selective_ops=saves), device="cpu").install()
    x = torch.randn(32, 16, requires_grad=True)
    try:
        runtime.begin_step([x], measure=True)  # each block's first call: eager, checked
        for block in model.blocks:
            block(x).sum().backward()
        runtime.end_step()
        saved = {i: _saved_storage_bytes(lambda: model.blocks[i](x)) for i in order}
    finally:
        runtime.remove()
    assert saved[0] > saved[1]  # blocks.0 keeps its matmuls' and norm's outputs; blocks.1 recomputes them


@pytest.mark.slow
def test_a_compiled_policy_counts_calls_as_the_trace_did():
    """Note [Selective saves per call] under compile: the policy sees the traced ops in the
    order the eager trace recorded them, its counts fresh for each trace, so ``addmm#0`` is each
    block's ``fc1`` and ``addmm#1`` its ``fc2``: saving ``fc1``'s output keeps what saving every
    ``addmm`` keeps (``fc2``'s output is not needed in backward, so the partitioner does not save
    it), and saving ``fc2``'s alone keeps what recomputing everything does."""
    from lightning_swap.core import Plan

    def saved(ops):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Net(d=64)
        for block in model.blocks:
            block.compile(backend=aot_eager)
        names = [f"blocks.{i}" for i in range(3)]
        plan = Plan(actions={n: Action.SELECTIVE for n in names}, selective_ops={n: ops for n in names})
        runtime = SwapRuntime(model, plan, device="cpu", min_offload_bytes=0).install()
        x = torch.randn(256, 8)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        try:
            runtime.begin_step([x], measure=True)  # each block's first call: eager, checked
            model(x).sum().backward()
            runtime.end_step()
            return _saved_storage_bytes(lambda: model(x), skip=params)
        finally:
            runtime.remove()

    every, first, second, none = (saved(ops) for ops in (("aten.addmm.default",), ("aten.addmm.default#0",),
                                                         ("aten.addmm.default#1",), ()))
    assert first == every and second == none
    assert every - none >= 3 * 256 * 128 * 4  # each block's fc1 output
