"""``AutoPlanner``'s decision table from values, without a model (Note [Auto decides from
values]): exact expected decisions, verdicts and plans for given budgets, batches, states and
measurements (Notes [Auto: observe, plan, check], [Observe only what fits])."""

from __future__ import annotations

import dataclasses
import logging
import pickle
from typing import Optional

import pytest
import torch

from lightning_swap.core import Action, Collectives, InfeasibleBudgetError, PlanRow, SwapConfig, min_budget_bytes, solve
from lightning_swap.core.decide.costmodel import copy_window_of, recompute_ms
from lightning_swap.core.scale.auto import MAX_SHAPES, REVISIT_AFTER_STEPS, REVISIT_TOLERANCE, AutoPlanner, BatchKey, Phase, StepInputs, StepKind, Verdict
from lightning_swap.core.scale.steady_state import StateSizes, state_growth

from ..decide.test_solver import random_chain

#: The copy windows a session's planner prices (Note [The planner chooses the copy windows]).
WINDOWS = copy_window_of(SwapConfig())

MiB = 1 << 20
TOKENS = (((32,), torch.int64),)  # a batch of token ids: its shape past the batch dimension, its dtype


def step(size: int = 8, shape: tuple = TOKENS, state: StateSizes = StateSizes()) -> StepInputs:
    return StepInputs(BatchKey(shape, size), state)


def _as_received(decide):
    """The main process's decision as the other processes receive it (pickled)."""
    return pickle.loads(pickle.dumps(decide()))


def planner(budget_bytes, *, freed: bool = False, names=("a", "b", "c", "d")) -> AutoPlanner:
    return AutoPlanner(
        budget_bytes=budget_bytes, segments=list(names), config=SwapConfig(), grads_freed_before_backward=freed, on_main=_as_received,
    )


def rows(held_bytes: int) -> list[PlanRow]:
    """A guard step's measured rows: ``held_bytes`` recomputed and offloaded in all."""
    return [PlanRow("a", Action.RECOMPUTE_OFFLOAD, recomputed_bytes=held_bytes // 3, offloaded_bytes=held_bytes - held_bytes // 3)]


#: The state after the first optimizer step: 10 MiB of gradients, 20 MiB of optimizer state.
GROWN = StateSizes(10 * MiB, 20 * MiB, (4, 4))


def guard_step(
    auto: AutoPlanner, *, peak: int, backward_peak: int, held: int, before: StateSizes, after: StateSizes, forward_peak: int = 80 * MiB,
    offloaded: Optional[int] = None, shape: tuple = TOKENS,
) -> None:
    """One guard step, as the session drives it: the plan, the forward's and the backward's
    peaks, the step's end (``offloaded``: what the step offloaded in all, the regions outside
    the segments included; ``None``: not told)."""
    assert auto.next_step(step(shape=shape, state=before)) is StepKind.GUARD
    plan = auto.begin_guard(step(shape=shape, state=before))
    # the lowest-memory uniform plan: on CPU, with no prefetch, offload (Note [Observe only what fits])
    assert dict(plan.actions) == {name: Action.OFFLOAD for name in auto.segments}
    assert auto.guarding
    auto.guard_forward_done(min(forward_peak, backward_peak))
    auto.guard_backward_done(backward_peak)
    if offloaded is None:
        auto.end_guard(peak, rows(held), after)
    else:
        auto.end_guard(peak, rows(held), after, offloaded_bytes=offloaded)
    assert not auto.guarding


def test_step_kinds_are_an_enum_of_the_names_adapters_logged():
    assert [k.value for k in StepKind] == ["guard", "observe", "plan", "run"]
    assert StepKind.GUARD == "guard" and StepKind("run") is StepKind.RUN


def test_the_first_step_guards_and_a_verdict_follows_every_guard_step():
    auto = planner(200 * MiB)
    assert auto.phase is Phase.GUARD
    guard_step(auto, peak=100 * MiB, backward_peak=90 * MiB, held=30 * MiB, before=StateSizes(), after=GROWN)
    assert auto.phase is Phase.VERDICT  # taken on the main process before the next step, inside next_step
    assert auto.next_step(step(state=GROWN)) is StepKind.OBSERVE and auto.phase is Phase.OBSERVE


@pytest.mark.parametrize(
    ("budget_mib", "freed", "expected"),
    [
        # Not yet steady (the state grew in the step): least = max(peak, backward peak (90) +
        # growth, forward peak (80) + forward growth), growth = optimizer 20 + gradients 10 (or the
        # optimizer's 20 alone in the backward when the loop frees the gradients before it: the
        # forward still holds them); plain's bound = least + held (30).
        (200, False, Verdict(StepKind.OBSERVE, 150 * MiB, 120 * MiB)),
        (150, False, Verdict(StepKind.OBSERVE, 150 * MiB, 120 * MiB)),
        (149, False, Verdict(StepKind.GUARD, None, 120 * MiB)),
        (140, True, Verdict(StepKind.OBSERVE, 140 * MiB, 110 * MiB)),
        (139, True, Verdict(StepKind.GUARD, None, 110 * MiB)),
    ],
)
def test_verdict_after_the_first_guard_step(budget_mib, freed, expected):
    auto = planner(budget_mib * MiB, freed=freed)
    guard_step(auto, peak=100 * MiB, backward_peak=90 * MiB, held=30 * MiB, before=StateSizes(), after=GROWN)
    verdict = auto.guard_verdict()
    assert verdict == expected
    auto.take_verdict(pickle.loads(pickle.dumps(verdict)))  # as the other processes receive it
    assert auto.next_step(step(state=GROWN)) is expected.decision


def test_a_steady_forward_holds_the_last_gradients_even_when_the_backward_does_not():
    auto = planner(200 * MiB, freed=True)
    guard_step(auto, peak=100 * MiB, backward_peak=96 * MiB, forward_peak=95 * MiB, held=30 * MiB, before=StateSizes(), after=GROWN)
    # least = max(100, 96 + 20 (optimizer), 95 + 10 + 20 (gradients and optimizer)) = 125
    assert auto.guard_verdict() == Verdict(StepKind.OBSERVE, 155 * MiB, 125 * MiB)


def test_a_guard_step_over_the_budget_is_infeasible_with_the_least_it_measured():
    auto = planner(99 * MiB)
    guard_step(auto, peak=100 * MiB, backward_peak=90 * MiB, held=30 * MiB, before=StateSizes(), after=GROWN)
    with pytest.raises(InfeasibleBudgetError) as info:
        auto.guard_verdict()
    assert (info.value.min_budget_bytes, info.value.budget_bytes, info.value.batch_size) == (120 * MiB, 99 * MiB, 8)


def _two_guard_steps(budget_bytes: int) -> AutoPlanner:
    """The first guard step grows the state (verdict: guard again); the second ends with no more
    state than the first ended with, so plain's bound = peak (115) + held (30) = 145 MiB."""
    auto = planner(budget_bytes)
    guard_step(auto, peak=100 * MiB, backward_peak=90 * MiB, held=30 * MiB, before=StateSizes(), after=GROWN)
    auto.take_verdict(Verdict(StepKind.GUARD, None, 120 * MiB))
    guard_step(auto, peak=115 * MiB, backward_peak=95 * MiB, held=30 * MiB, before=GROWN, after=GROWN)
    assert auto.phase is Phase.VERDICT
    return auto


@pytest.mark.parametrize(
    ("budget_mib", "expected"),
    [
        (150, Verdict(StepKind.OBSERVE, 145 * MiB, 115 * MiB)),  # plain's bound fits: observe plain
        (145, Verdict(StepKind.OBSERVE, 145 * MiB, 115 * MiB)),
        (144, Verdict(StepKind.RUN, 145 * MiB, 115 * MiB)),  # over the budget: the lowest-memory plan stays
        (115, Verdict(StepKind.RUN, 145 * MiB, 115 * MiB)),
    ],
)
def test_verdict_once_steady(budget_mib, expected):
    auto = _two_guard_steps(budget_mib * MiB)
    assert auto.guard_verdict() == expected


def test_steady_guard_over_the_budget_names_its_measured_peak():
    auto = _two_guard_steps(114 * MiB)
    with pytest.raises(InfeasibleBudgetError) as info:
        auto.guard_verdict()
    assert info.value.min_budget_bytes == 115 * MiB


def test_bound_over_budget_runs_the_lowest_memory_plan_until_a_larger_batch_or_a_new_shape():
    auto = _two_guard_steps(130 * MiB)
    auto.take_verdict(auto.guard_verdict())
    assert auto.guard_measured == (115 * MiB, 8)
    assert [auto.next_step(step(size, state=GROWN)) for size in (8, 8, 5)] == [StepKind.RUN] * 3
    assert auto.next_step(step(16, state=GROWN)) is StepKind.GUARD  # larger than the guard's batch
    assert auto.next_step(step(8, shape=(((64,), torch.int64),), state=GROWN)) is StepKind.GUARD  # a new shape


def _observed(budget_bytes, profile, *, freed=False, observed_state=StateSizes(), least=None) -> AutoPlanner:
    """Guarded once, the verdict to observe taken (the guard's measured steady peak ``least``;
    ``None``: not measured), the step observed: ``profile`` is its profile."""
    auto = planner(budget_bytes, freed=freed, names=profile.names)
    guard_step(auto, peak=1, backward_peak=1, held=1, before=StateSizes(), after=GROWN)
    auto.take_verdict(Verdict(StepKind.OBSERVE, 2, least))
    assert auto.next_step(step(state=observed_state)) is StepKind.OBSERVE
    auto.begin_observe(step(state=observed_state))
    auto.finish_observe(profile)
    return auto


def test_observe_then_plan_then_check_then_run():
    profile = random_chain(0, 4)
    budget = (min_budget_bytes(profile) + profile.peak_bytes) // 2
    auto = _observed(budget, profile)
    assert auto.next_step(step()) is StepKind.PLAN
    plan = auto.plan(StateSizes())
    assert plan == solve(profile, budget_bytes=budget, **WINDOWS) and plan.predicted_peak_bytes <= budget
    auto.applied(plan, StateSizes())
    assert auto.check_pending
    assert auto.next_step(step()) is StepKind.PLAN  # the check: the plan's first step was measured
    assert auto.plan(StateSizes(), plan.predicted_peak_bytes - 1) is plan  # within the prediction: kept
    assert auto.correction_bytes == 0
    auto.applied(plan, StateSizes())
    assert not auto.check_pending  # the same plan in the same state: no second check
    assert [auto.next_step(step(size)) for size in (8, 8, 3)] == [StepKind.RUN] * 3


def test_a_check_over_the_budget_learns_the_miss_and_plans_for_less():
    profile = random_chain(0, 4)
    budget = (min_budget_bytes(profile) + profile.peak_bytes) // 2
    auto = _observed(budget, profile)
    assert auto.next_step(step()) is StepKind.PLAN  # the plan's first step
    plan = auto.plan(StateSizes())
    auto.applied(plan, StateSizes())
    assert auto.next_step(step()) is StepKind.PLAN  # its check (Note [A check is of its own batch])
    miss = budget - plan.predicted_peak_bytes + MiB
    replanned = auto.plan(StateSizes(), plan.predicted_peak_bytes + miss)
    assert auto.correction_bytes == miss
    expected = solve(profile, budget_bytes=budget - miss)
    assert dict(replanned.actions) == dict(expected.actions) and replanned.predicted_peak_bytes == expected.predicted_peak_bytes
    assert replanned.budget_bytes == budget  # the user's budget, not the corrected one


def test_a_grown_optimizer_state_plans_again_and_a_same_signature_runs():
    profile = random_chain(0, 4)
    auto = _observed(10 * profile.peak_bytes, profile)
    plan = auto.plan(StateSizes())
    auto.applied(plan, StateSizes())
    auto.plan(StateSizes(), plan.predicted_peak_bytes)  # the check passes
    auto.applied(plan, StateSizes())
    assert auto.next_step(step(state=StateSizes())) is StepKind.RUN
    assert auto.next_step(step(state=GROWN)) is StepKind.PLAN  # new signature, more bytes
    auto.applied(auto.plan(GROWN), GROWN)
    auto.applied(auto.plan(GROWN, 0), GROWN)
    assert auto.next_step(step(state=GROWN)) is StepKind.RUN
    fewer = StateSizes(0, 20 * MiB, (0, 4))  # gradients freed by zero_grad: a new signature, fewer bytes
    assert auto.next_step(step(state=fewer)) is StepKind.RUN


@pytest.mark.parametrize(("freed", "expected"), [(False, (30 * MiB, 30 * MiB)), (True, (30 * MiB, 20 * MiB))])
def test_plans_are_solved_for_the_steady_state(freed, expected):
    """Note [Steady-state shift]: the profile observed without gradients or optimizer state is
    planned with both alive (the gradients in the backward only when the loop keeps them)."""
    assert state_growth(StateSizes(), GROWN, grads_freed_before_backward=freed) == expected
    profile = random_chain(1, 4)
    auto = _observed(10 * profile.peak_bytes, profile, freed=freed)
    assert auto.steady_shift(GROWN) == expected
    forward, backward = expected
    steady = profile.with_state(forward_bytes=forward, backward_bytes=backward)
    assert auto.plan(GROWN) == solve(steady, budget_bytes=10 * profile.peak_bytes, **WINDOWS)


def test_a_larger_batch_of_a_scalable_profile_plans_and_of_an_observed_one_guards():
    profile = random_chain(2, 4)
    scalable = dataclasses.replace(profile, reference=dataclasses.replace(profile, batch_size=16))
    auto = planner(10 * profile.peak_bytes, names=profile.names)
    auto.set_profile(scalable, BatchKey(TOKENS, 8), steady=True)
    assert auto.next_step(step(8)) is StepKind.PLAN
    auto.applied(auto.plan(StateSizes()), StateSizes())
    assert auto.next_step(step(16)) is StepKind.PLAN  # rescaled (Note [Batch scaling])
    assert auto.plan(StateSizes()).batch_size == 16
    observed = _observed(10 * profile.peak_bytes, profile)
    observed.applied(observed.plan(StateSizes()), StateSizes())
    assert observed.next_step(step(16)) is StepKind.GUARD


def test_a_profile_adopted_without_a_batch_plans_at_the_next_steps_shape():
    profile = random_chain(3, 4)
    auto = planner(10 * profile.peak_bytes, names=profile.names)
    auto.set_profile(profile, None, steady=True)  # a batch-size search's, at its own batch
    assert auto.next_step(step(8, shape=(((7,), torch.float32),))) is StepKind.PLAN
    auto.applied(auto.plan(StateSizes()), StateSizes())
    auto.applied(auto.plan(StateSizes(), 0), StateSizes())
    assert auto.next_step(step(8, shape=(((7,), torch.float32),))) is StepKind.RUN
    assert auto.next_step(step(8)) is StepKind.GUARD  # another shape


def test_infeasible_plan_names_the_smallest_budget_plus_what_was_learned():
    profile = random_chain(0, 4)
    least = min_budget_bytes(profile)
    auto = _observed(least - 1, profile)
    with pytest.raises(InfeasibleBudgetError) as info:
        auto.plan(StateSizes())
    assert (info.value.min_budget_bytes, info.value.budget_bytes, info.value.batch_size) == (least, least - 1, 8)


@pytest.mark.parametrize("over", [False, True])
def test_where_the_model_finds_no_plan_the_guards_measured_peak_decides(over):
    """The lowest-memory plan's peak was measured (the guard): where it fits, that plan runs even
    when the model predicts nothing fits; where not, the error names the measured peak."""
    profile = random_chain(0, 4)
    budget = min_budget_bytes(profile) - 1
    auto = _observed(budget, profile, least=budget + 1 if over else budget - MiB)
    if over:
        with pytest.raises(InfeasibleBudgetError) as info:
            auto.plan(StateSizes())
        assert info.value.min_budget_bytes == budget + 1
    else:
        plan = auto.plan(StateSizes())
        assert set(plan.actions.values()) == {Action.OFFLOAD} and plan.predicted_peak_bytes == budget - MiB


def test_without_a_budget_every_segment_is_kept_and_nothing_is_guarded():
    auto = planner(None)
    assert auto.next_step(step()) is StepKind.PLAN
    plan = auto.plan(StateSizes())
    assert dict(plan.actions) == {name: Action.KEEP for name in "abcd"} and plan.predicted_peak_bytes is None
    auto.applied(plan, StateSizes())
    assert not auto.check_pending
    assert [auto.next_step(step(size, state=GROWN)) for size in (8, 64)] == [StepKind.RUN] * 2


# -- Note [Re-plan from the steady state] --------------------------------------------------------
def _recomputing_plan():
    """A chain whose plan at its budget recomputes two segments (recomputation priced at the
    segment's forward, as measured alone), planned, applied and checked."""
    profile = random_chain(3, 4)
    profile = dataclasses.replace(profile, segments=tuple(dataclasses.replace(s, recompute_ms=s.forward_ms) for s in profile.segments))
    budget = int(min_budget_bytes(profile) + 0.2 * (profile.peak_bytes - min_budget_bytes(profile)))
    auto = _observed(budget, profile)
    assert auto.next_step(step()) is StepKind.PLAN
    plan = auto.plan(StateSizes())
    assert [a for a in plan.actions.values()] == [Action.RECOMPUTE, Action.RECOMPUTE, Action.KEEP, Action.KEEP]
    auto.applied(plan, StateSizes())
    assert auto.next_step(step()) is StepKind.PLAN  # its check
    auto.applied(auto.plan(StateSizes(), plan.predicted_peak_bytes), StateSizes())
    return auto, profile, plan


def _steady_times(profile, plan, *, recompute_factor=1.0, compute_factor=1.0):
    """Measured (step, recomputation, exposed copies) milliseconds of the plan's steady steps."""
    recompute = sum(recompute_ms(s, a) for s, a in zip(profile.segments, plan.actions.values()) if a.recomputes)
    step_ms = compute_factor * profile.step_ms + recompute_factor * recompute
    return [(step_ms, recompute_factor * recompute, 0.0)] * REVISIT_AFTER_STEPS


def test_a_plan_within_the_tolerance_of_its_steady_steps_stays_and_is_not_revisited_again(caplog):
    auto, profile, plan = _recomputing_plan()
    assert [auto.next_step(step()) for _ in range(REVISIT_AFTER_STEPS)] == [StepKind.RUN] * REVISIT_AFTER_STEPS
    assert auto.next_step(step()) is StepKind.PLAN and auto.revisit_due  # the steady steps were measured
    times = _steady_times(profile, plan, compute_factor=1 + REVISIT_TOLERANCE / 2)
    assert auto.plan(StateSizes(), plan.predicted_peak_bytes, times) is plan
    auto.applied(plan, StateSizes())
    assert not auto.check_pending and not auto.revisit_due
    assert [auto.next_step(step()) for _ in range(3 * REVISIT_AFTER_STEPS)] == [StepKind.RUN] * 3 * REVISIT_AFTER_STEPS


def test_recomputation_measured_slower_than_priced_replans_and_the_log_says_why(caplog):
    caplog.set_level(logging.INFO, logger="lightning_swap")
    auto, profile, plan = _recomputing_plan()
    [auto.next_step(step()) for _ in range(REVISIT_AFTER_STEPS + 1)]
    assert auto.revisit_due
    replanned = auto.plan(StateSizes(), plan.predicted_peak_bytes, _steady_times(profile, plan, recompute_factor=10.0))
    assert [a for a in replanned.actions.values()] == [Action.OFFLOAD, Action.OFFLOAD, Action.KEEP, Action.KEEP]
    assert replanned.predicted_peak_bytes <= auto.budget_bytes
    why = [r.getMessage() for r in caplog.records if "re-planning with the measured times" in r.getMessage()]
    assert len(why) == 1 and "median of 5" in why[0] and "ms predicted" in why[0], why
    auto.applied(replanned, StateSizes())
    assert auto.check_pending  # a new plan: its first step is checked like any other


def test_a_plan_whose_steady_steps_are_slower_everywhere_is_repriced_not_replaced(caplog):
    """Everything slower by the same factor (a loaded machine) changes no choice: the plan stays,
    its prediction re-priced, and the log says so."""
    caplog.set_level(logging.INFO, logger="lightning_swap")
    auto, profile, plan = _recomputing_plan()
    [auto.next_step(step()) for _ in range(REVISIT_AFTER_STEPS + 1)]
    times = _steady_times(profile, plan, recompute_factor=2.0, compute_factor=2.0)
    repriced = auto.plan(StateSizes(), plan.predicted_peak_bytes, times)
    assert dict(repriced.actions) == dict(plan.actions)
    assert repriced.predicted_step_ms == pytest.approx(times[0][0], rel=1e-6)
    assert [r for r in caplog.records if "it stays" in r.getMessage()]


def test_a_revisit_does_not_reprice_from_steps_still_speeding_up(caplog):
    """Note [Auto's times in a fresh model's first steps]: steps 2x slow and falling (a fresh
    model's transient) are not read as the plan's cost; the same steps flat re-price it."""
    caplog.set_level(logging.INFO, logger="lightning_swap")
    auto, profile, plan = _recomputing_plan()
    [auto.next_step(step()) for _ in range(REVISIT_AFTER_STEPS + 1)]
    slow = _steady_times(profile, plan, recompute_factor=2.0, compute_factor=2.0)
    falling = [(t[0] * f, t[1], t[2]) for t, f in zip(slow, (1.6, 1.45, 1.3, 1.15, 1.0))]
    assert auto.plan(StateSizes(), plan.predicted_peak_bytes, falling) is plan
    assert [r for r in caplog.records if "still changing: the plan is not re-priced" in r.getMessage()]
    assert auto.plan(StateSizes(), plan.predicted_peak_bytes, slow).predicted_step_ms == pytest.approx(slow[0][0], rel=1e-6)


# -- Note [Plans per batch shape], Note [A check is of its own batch] ------------------------------
SHORT = (((16,), torch.int64),)  # the same model's batches padded to another length


class _Loop:
    """The session's side of the decision table, from values: each step's kind carried out, a
    step under a plan measured at ``measured(plan, batch size)`` (its prediction, unless told),
    a guard step at ``guard_peak`` with ``held`` bytes not held, an observed step giving its
    shape's profile from ``profiles``. The state is steady from the start (``GROWN``)."""

    def __init__(self, auto: AutoPlanner, profiles: dict, *, measured=None, guard_peak: int = MiB, held: int = MiB) -> None:
        self.auto, self.profiles, self.guard_peak, self.held = auto, profiles, guard_peak, held
        self.measured = measured or (lambda plan, size: plan.predicted_peak_bytes)
        self.peak = None  # the newest step's measured peak, as the session hands it to plan()
        self.installed = None  # the plan the session has installed
        self.kinds, self.ran, self.peaks = [], [], []

    def step(self, shape: tuple = TOKENS, size: int = 8) -> StepKind:
        auto, inputs = self.auto, StepInputs(BatchKey(shape, size), GROWN)
        kind = auto.next_step(inputs)
        if kind is StepKind.GUARD:
            self.installed = auto.begin_guard(inputs)
            auto.guard_forward_done(self.guard_peak)
            auto.guard_backward_done(self.guard_peak)
            auto.end_guard(self.guard_peak, rows(self.held), GROWN)
            self.peak = self.guard_peak
        elif kind is StepKind.OBSERVE:
            self.installed = None
            auto.begin_observe(inputs)
            auto.finish_observe(self.profiles[shape])
            self.peak = self.profiles[shape].peak_bytes
        else:
            if kind is StepKind.PLAN:
                self.installed = auto.plan(GROWN, self.peak)
                auto.applied(self.installed, GROWN)
            self.peak = self.measured(self.installed, size)
        self.kinds.append(kind)
        self.ran.append(self.installed)
        self.peaks.append(self.peak)
        return kind


def _two_profiles():
    long, short = random_chain(0, 4), random_chain(1, 4)
    assert long.names == short.names  # the same model's segments
    budget = (max(min_budget_bytes(long), min_budget_bytes(short)) + min(long.peak_bytes, short.peak_bytes)) // 2
    return {TOKENS: long, SHORT: short}, budget


def _alternating(rounds: int):
    """The long and the short shape alternating for ``rounds`` rounds: (the planner, the loop,
    the shapes' profiles, the budget)."""
    profiles, budget = _two_profiles()
    auto = planner(budget, names=profiles[TOKENS].names)
    loop = _Loop(auto, profiles)
    for _ in range(rounds):
        loop.step(TOKENS)
        loop.step(SHORT)
    return auto, loop, profiles, budget


def test_dynamic_padding_guards_each_shape_once_and_each_shape_gets_its_own_plan_back():
    """Note [Plans per batch shape]: lengths alternating every step. Each shape is guarded once,
    observed once, planned once and checked once (against a step of its own); then every step
    gets its own shape's plan back, the one solved from its own profile."""
    auto, loop, profiles, budget = _alternating(8)
    G, O, P = StepKind.GUARD, StepKind.OBSERVE, StepKind.PLAN
    # every step after the first plans is PLAN: the other shape's plan is installed, so this
    # shape's goes back in (the session applies it only where it differs)
    assert loop.kinds == [G, G, O, O] + [P] * 12
    for shape, plans in ((TOKENS, loop.ran[4::2]), (SHORT, loop.ran[5::2])):
        expected = solve(profiles[shape], budget_bytes=budget, **WINDOWS)
        assert all(dict(p.actions) == dict(expected.actions) and p.predicted_peak_bytes == expected.predicted_peak_bytes for p in plans)
        assert all(p is plans[0] for p in plans)  # the shape's plan, remembered, never solved again
    assert not auto.check_pending and auto.correction_bytes == 0
    assert max(loop.peaks[4:]) <= budget  # (the guard's made-up numbers let plain be observed: not a plan's step)


def test_a_returning_shape_runs_its_plan_without_reinstalling_when_it_is_installed():
    profiles, budget = _two_profiles()
    auto = planner(budget, names=profiles[TOKENS].names)
    loop = _Loop(auto, profiles)
    for shape in (TOKENS, SHORT, TOKENS, SHORT, TOKENS, SHORT, TOKENS, TOKENS, TOKENS, TOKENS):
        loop.step(shape)
    # guard, guard, observe, observe, plan, plan, the long plan back, its check, then its own steps
    assert loop.kinds[-3:] == [StepKind.RUN] * 3


def test_shapes_beyond_the_remembered_ones_are_forgotten_least_recently_used_first():
    auto = planner(200 * MiB)
    shapes = [(((n,), torch.int64),) for n in range(1, MAX_SHAPES + 2)]
    for shape in shapes:
        assert auto.next_step(step(shape=shape, state=GROWN)) is StepKind.GUARD
        auto.begin_guard(step(shape=shape, state=GROWN))
        auto.end_guard(MiB, rows(MiB), GROWN)
    for shape in (shapes[-1], shapes[1]):  # remembered: the verdict on their guard step is taken, no guard step again
        assert auto.next_step(step(shape=shape, state=GROWN)) is not StepKind.GUARD
    assert auto.next_step(step(shape=shapes[0], state=GROWN)) is StepKind.GUARD  # the oldest, forgotten


def test_a_plan_is_checked_against_a_step_of_its_own_batch_size():
    """Note [A check is of its own batch]: a plan made for batch 9 (its profile's), applied at
    a batch-8 step, is checked by the next batch-9 step, not by the batch-8 one (which peaks
    lower): the miss of the batch-9 step is learned and the plan solved again for less."""
    profile = dataclasses.replace(random_chain(0, 4), batch_size=9)
    budget = (min_budget_bytes(profile) + profile.peak_bytes) // 2
    first = solve(profile, budget_bytes=budget, **WINDOWS)
    miss = budget - first.predicted_peak_bytes + MiB  # batch 9 peaks 1 MiB over the budget under the first plan

    def measured(plan, size):
        return plan.predicted_peak_bytes + (miss if size == 9 else -MiB)

    auto = planner(budget, names=profile.names)
    loop = _Loop(auto, {TOKENS: profile}, measured=measured)
    for size in (9, 9, 8, 9, 8, 9, 8, 9, 8, 9):
        loop.step(TOKENS, size)
    G, O, P, R = StepKind.GUARD, StepKind.OBSERVE, StepKind.PLAN, StepKind.RUN
    # plan (at 8), its own batch's step, the check (miss learned, re-planned), the new plan's own
    # batch's step, its check (kept), then it runs
    assert loop.kinds == [G, O, P, R, P, R, P, R, R, R]
    assert auto.correction_bytes == miss
    assert loop.ran[2] == first and loop.peaks[3] > budget
    assert max(loop.peaks[5:]) <= budget  # no step over after the first plan's check



def test_a_new_shape_that_fits_in_a_planned_one_runs_its_plan_without_a_guard():
    """Note [A smaller shape runs a larger one's plan]: once the long shape's plan is checked, a
    new shorter length runs it at once (never guarded); a longer length, another dtype or a
    larger batch is guarded."""
    profile = random_chain(0, 4)
    budget = (min_budget_bytes(profile) + profile.peak_bytes) // 2
    auto = planner(budget, names=profile.names)
    loop = _Loop(auto, {TOKENS: profile})
    for _ in range(4):  # guard, observe, plan, its check
        loop.step(TOKENS)
    assert not auto.check_pending
    long_plan = loop.ran[-1]
    G, P, R = StepKind.GUARD, StepKind.PLAN, StepKind.RUN
    assert [loop.step(SHORT), loop.step(SHORT), loop.step((((24,), torch.int64),), 4)] == [P, R, P]
    assert all(plan is long_plan for plan in loop.ran[-3:])  # its plan, installed again (not a new one)
    assert not auto.check_pending
    longer, other_dtype = (((64,), torch.int64),), (((16,), torch.int32),)
    for shape, size in ((longer, 8), (other_dtype, 8), (SHORT, 16)):
        assert auto.next_step(step(size, shape=shape, state=GROWN)) is G, (shape, size)

@pytest.mark.parametrize(
    ("budget_mib", "offloaded_mib", "expected"),
    [
        # least 120 (test_verdict_after_the_first_guard_step); rows: 10 recomputed, 20 offloaded;
        # the regions outside the segments (a stem, the head's input) offloaded 25 more: plain's
        # bound = 120 + 10 + 45
        (175, 45, Verdict(StepKind.OBSERVE, 175 * MiB, 120 * MiB)),
        (174, 45, Verdict(StepKind.GUARD, None, 120 * MiB)),  # the rows alone said 150: observed, and over
        (150, 20, Verdict(StepKind.OBSERVE, 150 * MiB, 120 * MiB)),  # nothing outside the segments
    ],
)
def test_the_bound_on_plain_counts_the_regions_outside_the_segments(budget_mib, offloaded_mib, expected):
    """Note [Observe only what fits]: plain holds what the guard step did not, the regions
    outside the segments included."""
    auto = planner(budget_mib * MiB)
    guard_step(auto, peak=100 * MiB, backward_peak=90 * MiB, held=30 * MiB, before=StateSizes(), after=GROWN, offloaded=offloaded_mib * MiB)
    assert auto.guard_verdict() == expected


def test_the_steady_bound_counts_the_regions_outside_the_segments():
    auto = planner(160 * MiB)
    guard_step(auto, peak=100 * MiB, backward_peak=90 * MiB, held=30 * MiB, before=StateSizes(), after=GROWN, offloaded=45 * MiB)
    auto.take_verdict(auto.guard_verdict())
    guard_step(auto, peak=115 * MiB, backward_peak=95 * MiB, held=30 * MiB, before=GROWN, after=GROWN, offloaded=45 * MiB)
    assert auto.guard_verdict() == Verdict(StepKind.RUN, 170 * MiB, 115 * MiB)  # 115 + 10 + 45: the rows alone said 145


def _least_warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING and "ran the lowest-memory plan" in r.getMessage()]


@pytest.mark.parametrize(("budget_mib", "warned"), [(130, True), (120, False)])
def test_the_lowest_memory_plan_kept_with_room_in_the_budget_says_why_once(caplog, budget_mib, warned):
    """Note [Say why the lowest-memory plan stays]: plain's bound (145) over the budget, no
    profile: the lowest-memory plan (115) stays. More than a few steps of it with 5% of the
    budget unused: one WARNING with the reason; at 120 (4% unused) none."""
    caplog.set_level(logging.INFO, logger="lightning_swap")
    auto = _two_guard_steps(budget_mib * MiB)
    auto.take_verdict(auto.guard_verdict())
    kinds = [auto.next_step(step(state=GROWN)) for _ in range(2)]
    assert not _least_warnings(caplog)  # two guard steps and two steps of the plan: a few
    kinds += [auto.next_step(step(state=GROWN)) for _ in range(10)]
    assert kinds == [StepKind.RUN] * 12
    said = _least_warnings(caplog)
    assert len(said) == (1 if warned else 0)
    if warned:
        assert "no profile could be made" in said[0].getMessage() and "115.0 MiB" in said[0].getMessage(), said[0].getMessage()


def test_a_new_shape_at_every_step_says_why_once(caplog):
    caplog.set_level(logging.INFO, logger="lightning_swap")
    auto = planner(200 * MiB)
    for n in range(1, 9):
        guard_step(auto, peak=100 * MiB, backward_peak=90 * MiB, held=30 * MiB, before=GROWN, after=GROWN, shape=(((n,), torch.int64),))
    said = _least_warnings(caplog)
    assert len(said) == 1 and "the batch shape was new in each of the last 5 steps" in said[0].getMessage(), said


# -- Collectives.on_main: the one way processes agree -----------------------------------------------
def test_on_main_hands_every_process_the_main_result_or_its_error():
    sent = []

    def broadcast(payload):
        sent.append(payload)
        return payload

    main = Collectives(is_main=True, broadcast=broadcast)
    assert main.on_main(lambda: 7) == 7 and sent == [("ok", 7)]
    error = InfeasibleBudgetError(budget_bytes=1, min_budget_bytes=2)
    with pytest.raises(InfeasibleBudgetError) as info:
        main.on_main(lambda: (_ for _ in ()).throw(error))
    assert info.value is error  # the main process raises its own
    other = Collectives(is_main=False, broadcast=lambda payload: pickle.loads(pickle.dumps(sent[-1])))
    with pytest.raises(InfeasibleBudgetError) as info:
        other.on_main(lambda: pytest.fail("only the main process decides"))
    assert info.value.min_budget_bytes == 2  # the others raise a copy


def test_on_main_sends_an_error_that_cannot_travel_as_a_runtime_error():
    class Local(Exception):
        def __reduce__(self):
            raise TypeError("not picklable")

    sent = []
    main = Collectives(is_main=True, broadcast=lambda payload: sent.append(payload) or payload)
    with pytest.raises(Local):
        main.on_main(lambda: (_ for _ in ()).throw(Local("boom")))
    kind, body = sent[0]
    assert kind == "error" and isinstance(body, RuntimeError) and "Local: boom" in str(body)


# -- Note [A shape's lifecycle] -------------------------------------------------------------------
def test_each_shape_goes_through_its_phases_and_the_log_says_why_at_debug(caplog):
    """Two shapes alternating: each goes guard -> verdict -> observe -> plan -> check -> run, every
    change one DEBUG line with its reason; a change the table does not allow is refused."""
    caplog.set_level(logging.DEBUG, logger="lightning_swap")
    auto, _, _, _ = _alternating(4)
    for shape in ("[32]int64", "[16]int64"):
        changes = [r.getMessage().split(": ")[2] for r in caplog.records if f"batch shape {shape}:" in r.getMessage()]
        assert [c.split(" -> ")[1] for c in changes] == ["verdict", "observe", "plan", "check", "run"], changes
    assert auto.phase is Phase.RUN
    with pytest.raises(RuntimeError, match="cannot go from 'run' to 'refined'"):
        auto._go(auto._s, Phase.REFINED, "not a change the table has")


def test_processes_whose_padded_lengths_differ_agree_on_the_longest_shape():
    """Each process pads its batch to its own longest sequence: every process decides from the
    longest shape where the others fit in it (its plan bounds theirs), and from a shape no profile
    has where none holds the others (here a longer sequence beside a wider one)."""
    import types
    import zlib

    from lightning_swap.core.scale.session import SwapSession

    def agreed(mine: BatchKey, other: BatchKey) -> BatchKey:
        packed = [zlib.crc32(repr(k.shape).encode()) * (1 << 20) + k.size for k in (mine, other)]
        collectives = types.SimpleNamespace(
            reduce_max=lambda _: max(packed), reduce_min=lambda _: min(packed), gather=lambda key: [key, other],
        )
        return SwapSession._agreed(types.SimpleNamespace(collectives=collectives), mine)

    short, long = BatchKey(SHORT, 8), BatchKey(TOKENS, 6)
    assert agreed(short, long) == agreed(long, short) == BatchKey(TOKENS, 8)
    wide = BatchKey((((16, 4), torch.int64),), 8)
    tall = BatchKey((((32, 2), torch.int64),), 8)
    differ = agreed(wide, tall)
    assert differ.shape[0][0] == "shapes differ across processes" and differ.size == 8
