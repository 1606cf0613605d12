"""A segment's replay runs what the step ran, without its side effects (issue 33 item 2; Note [A
replay has no side effects] in ``lightning_swap/core/measure/replay.py``), and a segment that
cannot be replayed is named in one WARNING and planned without it (Note [A segment that cannot be
replayed] in ``lightning_swap/core/measure/observe.py``).

Hugging Face GPT-2 and Llama are built from tiny configs at their default settings (``use_cache``
left as the config has it: on), never downloaded, and trained a few SGD steps through
:class:`SwapSession` as the adapters drive it, plain and under ``policy="auto"`` at a budget
halfway between the lowest-memory forced plan's measured peak and plain's.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch import nn

from lightning_swap.core import Action, DeviceMemoryMeter, SwapConfig, SwapSession

from ..helpers import assert_same_state

SEQ, BATCH, STEPS, VOCAB = 16, 4, 6, 100
LOWEST = ["offload", "recompute", "recompute_offload"]  # the forced plans that hold least



def _train_step(session, optimizer, loss_fn, batch, track):
    """One training step, under ``session`` when given (through its lower-level calls, as a loop
    of one's own drives it); returns the step's kind (``None`` without a session)."""
    states = [optimizer.state]
    kind = session.before_step(batch, [*track, states], states) if session is not None else None
    loss = loss_fn()
    if session is not None:
        session.backward_begins()
    loss.backward()
    if session is not None:
        session.backward_done()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if session is not None:
        session.end_step()
        session.step_done()
    return kind

def _transformers():
    return pytest.importorskip("transformers", reason="the Hugging Face models need transformers (the `test` extra)")


def _gpt2() -> nn.Module:
    t = _transformers()
    torch.manual_seed(0)
    return t.GPT2LMHeadModel(t.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=None, eos_token_id=None,
    ))


def _llama() -> nn.Module:
    t = _transformers()
    torch.manual_seed(0)
    return t.LlamaForCausalLM(t.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    ))


HF = {"gpt2": _gpt2, "llama": _llama}


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _train(name: str, policy, budget=None) -> tuple:
    """``STEPS`` SGD steps of ``HF[name]()`` (``policy=None``: plain): the model, each step's peak
    from a meter of the test's own (weights, optimizer state and batch tracked), the plan, and the
    kinds of the steps."""
    model = HF[name]()
    assert model.config.use_cache  # the default, left on
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = None if policy is None else SwapConfig(policy=policy, budget_bytes=budget, min_offload_bytes=0, log_plan=False)
    session = None if config is None else SwapSession(model, config, "cpu")
    peaks, kinds, plan = [], [], None
    try:
        for ids in _batches():
            with DeviceMemoryMeter("cpu") as meter:
                meter.track([*model.parameters(), *(t for s in optimizer.state.values() for t in s.values()), ids])
                kinds.append(_train_step(session, optimizer, lambda: model(input_ids=ids, labels=ids).loss, ids, [ids]))
            peaks.append(meter.peak_bytes)
        plan = None if session is None else session.plan
    finally:
        if session is not None:
            session.close()
    return model, peaks, plan, kinds


@functools.cache
def _plain(name: str) -> tuple:
    return _train(name, None)


@functools.cache
def _budget(name: str) -> int:
    plain = max(_plain(name)[1])
    least = min(max(_train(name, policy)[1]) for policy in LOWEST)
    assert least < plain, (least, plain)
    return (least + plain) // 2


@pytest.mark.parametrize("name", sorted(HF))
def test_hf_models_at_their_defaults_get_a_planned_mix_equal_to_plain(name, caplog):
    """Before: every replay of a block ran on the step's filled cache and failed (logged at DEBUG),
    no profile was made, and ``auto`` stayed on the lowest-memory plan (every block offloaded)."""
    caplog.set_level(logging.WARNING, logger="lightning_swap")
    budget = _budget(name)
    model, peaks, plan, kinds = _train(name, "auto", budget)
    assert plan is not None
    blocks = {n: a for n, a in plan.actions.items() if ".layers." in n or ".h." in n}
    assert len(blocks) == 2, plan.actions
    assert Action.KEEP in blocks.values(), plan.summary()  # a mix: the lowest-memory plan keeps no block
    assert set(blocks.values()) != {Action.KEEP}, plan.summary()  # plain does not fit
    assert plan.predicted_peak_bytes <= budget
    assert max(peaks) <= budget, (peaks, budget)
    assert_same_state(model, _plain(name)[0])
    assert not [r for r in caplog.records if "could not be run again" in r.getMessage()]


@pytest.mark.parametrize("name", sorted(HF))
def test_profiling_leaves_the_steps_cache_and_batch_as_they_were(name):
    """The cache the model filled in each observed step (the output's: the guard step's, whose
    segments are measured alone, then plain's), the batch and the weights are bit-identical after
    the segments were replayed (in ``step_done``)."""
    model = HF[name]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    session = SwapSession(model, SwapConfig(policy="auto", budget_bytes=1 << 40, min_offload_bytes=0, log_plan=False), "cpu")
    kinds = []
    try:
        for ids in _batches()[:2]:
            states = [optimizer.state]
            kinds.append(session.before_step(ids, [ids, states], states).value)
            output = model(input_ids=ids, labels=ids)
            cache = output.cache
            assert cache is not None and cache.get_seq_length() == SEQ  # filled by the step, as the default does
            before = [(layer.keys.detach().clone(), layer.values.detach().clone()) for layer in cache.layers]
            batch = ids.clone()
            loss = output.loss
            del output
            session.backward_begins()
            loss.backward()
            session.backward_done()
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            weights = {k: p.detach().clone() for k, p in model.named_parameters()}
            session.end_step()
            session.step_done()  # an observed step's segments are replayed here
            assert cache.get_seq_length() == SEQ and len(cache.layers) == len(before)
            for layer, (keys, values) in zip(cache.layers, before):
                assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
            assert torch.equal(ids, batch)
            assert all(torch.equal(p, weights[k]) and torch.equal(p.grad, grads[k]) for k, p in model.named_parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert kinds == ["guard", "observe"]
        assert session.profile is not None
        assert all(s.recompute_ms is not None for s in session.profile.segments)  # each measured by a replay
    finally:
        session.close()


# -- a model of the test's own ---------------------------------------------------------------------
class Tally:
    """An object a layer writes into: each call adds one."""

    def __init__(self) -> None:
        self.n = 0


class Block(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor, *, tally: Tally, seen: list) -> torch.Tensor:
        self.calls += 1
        tally.n += 1
        seen.append(x.shape[0])
        return x + self.fc2(torch.relu(self.fc1(x)))


class Fragile(Block):
    """A block that reads what the model's forward sets up around it, as some layers do: run on
    its own, it raises."""

    def forward(self, x: torch.Tensor, *, tally: Tally, seen: list) -> torch.Tensor:
        if not self.owner_running:
            raise RuntimeError("Fragile block called outside its model's forward")
        return super().forward(x, tally=tally, seen=seen)


class Net(nn.Module):
    def __init__(self, fragile: bool = False, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([(Fragile if fragile and i == 1 else Block)(width) for i in range(depth)])
        self.head = nn.Linear(width, 10)
        self.tally = Tally()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seen: list = []
        for block in self.blocks:
            block.owner_running = True
            try:
                x = block(x, tally=self.tally, seen=seen)
            finally:
                block.owner_running = False
        return self.head(x)


def _net_steps(model: Net, session, steps: int = 4) -> list[int]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    peaks = []
    for _ in range(steps):
        x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
        with DeviceMemoryMeter("cpu") as meter:
            meter.track([*model.parameters(), x, y])
            _train_step(session, optimizer, lambda: nn.functional.cross_entropy(model(x), y), x, [x, y])
        peaks.append(meter.peak_bytes)
    return peaks


def _net_session(model: Net, budget, policy: str = "auto") -> SwapSession:
    names = [f"blocks.{i}" for i in range(len(model.blocks))]
    return SwapSession(model, SwapConfig(policy=policy, budget_bytes=budget, segments=names, min_offload_bytes=0, log_plan=False), "cpu")


def _net_peak(policy) -> int:
    """The measured peak of ``Net(fragile=True)`` trained plain (``None``) or under a forced policy."""
    model = Net(fragile=True)
    session = None if policy is None else _net_session(model, None, policy)
    try:
        return max(_net_steps(model, session, steps=3))
    finally:
        if session is not None:
            session.close()


def test_a_replay_writes_into_no_object_of_the_users():
    """A layer that counts its calls on itself and in an object it is given: after ``auto``
    profiled it (its segments replayed several times), both counts are plain training's."""
    model = Net()
    session = _net_session(model, 1 << 40)
    try:
        _net_steps(model, session)
        assert session.profile is not None and session.profile.segments[0].recompute_ms is not None  # replayed
    finally:
        session.close()
    assert model.tally.n == 4 * 4
    assert [b.calls for b in model.blocks] == [4] * 4


def test_a_segment_that_cannot_be_replayed_is_named_once_and_planned_without_recomputation(caplog):
    """Before: the failure was a DEBUG line, and the segment had no refusal: the planner could
    recompute a segment never run alone."""
    caplog.set_level(logging.WARNING, logger="lightning_swap")
    model = Net(fragile=True)
    plain = Net(fragile=True)
    _net_steps(plain, None, steps=6)
    session = _net_session(model, 1 << 40)
    try:
        _net_steps(model, session, steps=6)
        profile, plan = session.profile, session.plan
    finally:
        session.close()
    assert profile is not None and plan is not None
    warnings = [r.getMessage() for r in caplog.records if "could not be run again" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "'blocks.1'" in warnings[0] and "outside its model's forward" in warnings[0]
    assert "blocks.0" not in warnings[0]
    fragile = next(s for s in profile.segments if s.name == "blocks.1")
    assert Action.RECOMPUTE in fragile.refused and Action.SELECTIVE in fragile.refused
    assert fragile.forward_ms > 0 and fragile.backward_ms > 0  # the step's own times
    others = [s for s in profile.segments if s.name != "blocks.1"]
    assert others and all(not s.refused and s.recompute_ms is not None for s in others)
    assert_same_state(model, plain)


def test_a_segment_that_cannot_be_replayed_under_a_plan_is_named_once(caplog):
    """Under ``auto``'s guard step (the budget below plain's peak) the segment's bytes when kept are
    unknown without its run alone: the WARNING says the plan stays the lowest-memory one, and
    every step is within the budget."""
    caplog.set_level(logging.WARNING, logger="lightning_swap")
    plain, least = _net_peak(None), _net_peak("offload")  # (it cannot be recomputed)
    assert least < plain, (least, plain)
    budget = (least + plain) // 2
    model = Net(fragile=True)
    session = _net_session(model, budget)
    try:
        peaks = _net_steps(model, session, steps=5)
    finally:
        session.close()
    warnings = [r.getMessage() for r in caplog.records if "could not be run again" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "'blocks.1'" in warnings[0] and "lowest-memory" in warnings[0]
    assert max(peaks[1:]) <= budget, (peaks, budget)  # the first step holds no optimizer state yet


def _observed(model: Net, costs=None):
    """One plain step of ``model`` observed (Note [Observe, do not re-run]): the observation, after ``finish``."""
    from lightning_swap.core.measure.observe import ObservedStep

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)
    names = [f"blocks.{i}" for i in range(len(model.blocks))]
    observation = ObservedStep(model, names, device=torch.device("cpu"), batch=x, track=[x, y], min_offload_bytes=0, costs=costs).begin()
    loss = nn.functional.cross_entropy(model(x), y)
    observation.backward_begins()
    loss.backward()
    observation.backward_done()
    observation.close()
    return observation, observation.finish()


def test_a_step_that_reuses_the_costs_of_its_shape_still_refuses_the_unreplayable_segment():
    """Note [A segment that cannot be replayed]: a later observation on the same shape is given the
    costs measured first (the session's ``_costs_for``); the segment they leave out is still not
    planned to be recomputed."""
    model = Net(fragile=True)
    first, profile = _observed(model)
    assert "blocks.1" not in first.costs and "blocks.0" in first.costs
    _, again = _observed(model, costs=first.costs)
    for p in (profile, again):
        fragile = next(s for s in p.segments if s.name == "blocks.1")
        assert Action.RECOMPUTE in fragile.refused, fragile.refusal
        assert not next(s for s in p.segments if s.name == "blocks.0").refused
