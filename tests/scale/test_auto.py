"""``AutoPlanner`` from values, without a model (Note [Auto decides from values]): its lifecycle as a
table (every edge and every refused one), the first step, plans from traced profiles, corrections
learned from the steps that ran, shapes covered and scaled, the least budget (Note [Auto learns
from the steps it runs])."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import types
import zlib

import pytest
import torch

from lightning_swap.core import Action, Collectives, InfeasibleBudgetError, SwapConfig, solve
from lightning_swap.core.decide.costmodel import copy_window_of, simulate
from lightning_swap.core.scale.auto import (
    COVER_FACTOR, MAX_ENTRIES, NEXT, AutoPlanner, BatchKey, Event, Outcome, Phase, StepInputs, StepKind, transition,
)
from lightning_swap.core.scale.steady_state import StateSizes

from ..decide.test_solver import random_chain

MiB = 1 << 20
TOKENS = (((32,), torch.int64),)  # a batch of token ids: its shape past the batch dimension, its dtype
SHORT = (((16,), torch.int64),)
LONG = (((64,), torch.int64),)
GROWN = StateSizes(10 * MiB, 20 * MiB, (4, 4))  # after the first optimizer step
PROFILE = random_chain(3, 4)


def step(size: int = 8, shape: tuple = TOKENS, state: StateSizes = StateSizes()) -> StepInputs:
    return StepInputs(BatchKey(shape, size), state)


def planner(budget_bytes, **kw) -> AutoPlanner:
    return AutoPlanner(budget_bytes=budget_bytes, segments=PROFILE.names, config=SwapConfig(), **kw)


def first_step(auto: AutoPlanner, *, shape: tuple = TOKENS, size: int = 8, profile=PROFILE, peak: int = 150 * MiB, least=None) -> None:
    """The first step as the session drives it: the lowest-memory plan, traced, its profile; the
    least budget its windows gave (the session sets it as the second step begins)."""
    decision = auto.next_step(step(size, shape))
    assert decision.kind is StepKind.FIRST and decision.trace
    assert set(decision.plan.actions.values()) == {Action.OFFLOAD} and decision.plan.prefetch_bytes == 0
    auto.applied(decision, decision.plan)
    auto.traced(dataclasses.replace(profile, batch_size=size), BatchKey(shape, size), StateSizes(), decision.plan)
    auto.finished(Outcome(peak), first=True)
    auto.least_bytes = least


def run(auto: AutoPlanner, *, shape: tuple = TOKENS, size: int = 8, state: StateSizes = GROWN, peak=None, moved: bool = False):
    """One later step: its decision, the plan (solved where the main process would), its outcome
    (``peak``: a function of the plan's prediction, by default the prediction)."""
    decision = auto.next_step(step(size, shape, state))
    plan = pickle.loads(pickle.dumps(auto.plan(decision)))  # as the other processes receive it
    auto.applied(decision, plan)
    predicted = auto.online.predicted_peak_bytes
    auto.finished(Outcome(predicted if peak is None else peak(predicted), moved=moved), first=False)
    return decision, plan, predicted


# -- Note [Auto learns from the steps it runs]: the lifecycle, as a table ------------------------------
def test_every_edge_of_the_lifecycle_and_every_refused_one():
    allowed = {
        (Phase.FIRST, Event.PROFILED): Phase.CHECK, (Phase.FIRST, Event.UNPROFILED): Phase.FIRST,
        (Phase.CHECK, Event.HELD): Phase.RUN, (Phase.CHECK, Event.MISSED): Phase.CHECK, (Phase.CHECK, Event.CHANGED): Phase.CHECK,
        (Phase.CHECK, Event.PROFILED): Phase.CHECK, (Phase.CHECK, Event.UNPROFILED): Phase.CHECK,
        (Phase.RUN, Event.HELD): Phase.RUN, (Phase.RUN, Event.MISSED): Phase.CHECK, (Phase.RUN, Event.CHANGED): Phase.CHECK,
        (Phase.RUN, Event.PROFILED): Phase.CHECK, (Phase.RUN, Event.UNPROFILED): Phase.RUN,
    }
    assert {(p, e): n for p, edges in NEXT.items() for e, n in edges.items()} == allowed
    for phase in Phase:
        for event in Event:
            if (phase, event) in allowed:
                assert transition(phase, event) is allowed[(phase, event)]
            else:
                with pytest.raises(RuntimeError, match=f"cannot take {event.name} in phase '{phase.value}'"):
                    transition(phase, event)


def test_step_kinds_are_the_four_names_the_step_api_returns():
    assert [k.value for k in StepKind] == ["first", "trace", "plan", "run"]


# -- the first step and the plans after it ---------------------------------------------------------
def test_the_first_step_runs_the_lowest_memory_plan_traced_then_plans_check_and_run():
    auto = planner(400 * MiB)
    assert auto.phase is Phase.FIRST
    first_step(auto)
    assert auto.phase is Phase.CHECK
    decision, plan, predicted = run(auto)
    assert decision.kind is StepKind.PLAN and not decision.trace
    assert predicted <= 400 * MiB and plan.budget_bytes == 400 * MiB
    assert auto.phase is Phase.RUN
    again, same, _ = run(auto)
    assert again.kind is StepKind.RUN and same == plan  # no solve: the plan in hand


def test_the_plan_is_the_solvers_for_the_profile_in_the_steady_state():
    """Plans are solved from the traced profile shifted to the state alive now (Note [Steady-state
    shift]), with the config's copy windows."""
    auto = planner(400 * MiB)
    first_step(auto)
    _, plan, _ = run(auto, state=GROWN)
    shifted = PROFILE.with_state(forward_bytes=GROWN.total_bytes, backward_bytes=GROWN.total_bytes)
    assert dict(plan.actions) == dict(solve(shifted, budget_bytes=400 * MiB, **copy_window_of(SwapConfig())).actions)


def test_without_a_budget_every_segment_is_kept_and_nothing_is_traced():
    auto = planner(None)
    decision = auto.next_step(step())
    assert decision.kind is StepKind.PLAN and not decision.trace
    assert set(decision.plan.actions.values()) == {Action.KEEP}
    auto.applied(decision, decision.plan)
    assert auto.next_step(step()) == dataclasses.replace(decision, kind=StepKind.RUN)


def test_the_state_growing_plans_again():
    auto = planner(400 * MiB)
    first_step(auto)
    run(auto, state=StateSizes(0, 0, (0, 0)))
    run(auto, state=StateSizes(0, 0, (0, 0)))
    assert auto.phase is Phase.RUN
    decision, _, _ = run(auto, state=GROWN)
    assert decision.kind is StepKind.PLAN


def test_a_refusal_plans_again_without_the_refused_action():
    auto = planner(260 * MiB, refusals={})
    first_step(auto)
    run(auto)
    run(auto)
    auto.refusals.update({name: "it writes into its input" for name in PROFILE.names})
    decision, plan, _ = run(auto)
    assert decision.kind is StepKind.PLAN
    assert not any(a.recomputes for a in plan.actions.values())


# -- corrections: what the steps that ran measured ------------------------------------------------------
def test_a_step_over_the_budget_learns_the_miss_and_plans_for_less(caplog):
    caplog.set_level(logging.INFO, logger="lightning_swap")
    auto = planner(300 * MiB)
    first_step(auto)
    _, plan, predicted = run(auto, peak=lambda p: 310 * MiB)  # over the budget: a transient the model missed
    miss = 310 * MiB - predicted
    assert f"peaked at 310.0 MiB against" in caplog.text and auto.phase is Phase.CHECK
    decision, again, predicted_again = run(auto)
    assert decision.kind is StepKind.PLAN
    assert predicted_again <= 300 * MiB - miss
    assert run(auto)[0].kind is StepKind.RUN


def test_a_step_the_online_budget_held_by_moving_segments_plans_again_for_less():
    auto = planner(210 * MiB)  # between the least (187 MiB in the steady state) and plain's peak (228 MiB)
    first_step(auto)
    _, _, predicted = run(auto)
    _, _, _ = run(auto, moved=True)
    assert auto.phase is Phase.CHECK
    decision, _, predicted_again = run(auto)
    learned = auto.correction_bytes
    assert decision.kind is StepKind.PLAN and learned >= int(0.01 * 210 * MiB)  # at least a little more after each move
    assert predicted_again <= 210 * MiB - learned


def test_a_plan_under_its_prediction_is_kept_as_it_is():
    """A step under its prediction teaches nothing (another plan's prediction need not be as far
    off): the plan is checked and runs."""
    auto = planner(210 * MiB)
    first_step(auto)
    run(auto, peak=lambda p: p - 60 * MiB)
    assert auto.phase is Phase.RUN and run(auto)[0].kind is StepKind.RUN


def test_a_step_that_ran_no_backward_teaches_nothing():
    auto = planner(300 * MiB)
    first_step(auto)
    decision = auto.next_step(step(state=GROWN))
    auto.applied(decision, auto.plan(decision))
    auto.finished(Outcome(None), first=False)
    assert auto.phase is Phase.CHECK and auto.correction_bytes == 0


# -- the least budget ----------------------------------------------------------------------------------
def test_where_the_model_finds_no_plan_but_the_least_fits_the_lowest_memory_plan_runs_held_online():
    auto = planner(130 * MiB)
    first_step(auto, peak=100 * MiB, least=100 * MiB)
    decision = auto.next_step(step(state=StateSizes()))
    plan = auto.plan(decision)
    assert set(plan.actions.values()) == {Action.OFFLOAD}


def test_the_lowest_memory_plan_measured_over_the_budget_raises_with_that_peak():
    auto = planner(130 * MiB)
    first_step(auto, peak=100 * MiB, least=100 * MiB)
    decision = auto.next_step(step(state=StateSizes()))
    auto.applied(decision, auto.plan(decision))
    with pytest.raises(InfeasibleBudgetError) as info:
        auto.finished(Outcome(140 * MiB, moved=True), first=False)  # moved lower still: nothing fits
    assert info.value.min_budget_bytes == 140 * MiB


# -- Note [A shape scaled from another] ------------------------------------------------------------------
def test_a_shorter_batch_is_covered_and_planned_from_the_longer_ones_profile_scaled_down():
    auto = planner(400 * MiB)
    first_step(auto, shape=TOKENS)
    decision = auto.next_step(step(shape=SHORT, state=GROWN))
    assert decision.kind is StepKind.PLAN and not decision.trace and decision.key[1] == 0.5
    plan = auto.plan(decision)
    assert plan.batch_size == 4  # half the activations: the batch's equivalent


def test_a_longer_batch_than_every_profile_is_traced_under_keep_and_offload_and_becomes_an_entry():
    auto = planner(400 * MiB)
    first_step(auto, shape=TOKENS)
    run(auto)
    decision = auto.next_step(step(shape=LONG, state=GROWN))
    assert decision.kind is StepKind.TRACE and decision.trace
    plan = auto.plan(decision)
    assert set(plan.actions.values()) <= {Action.KEEP, Action.OFFLOAD}
    auto.applied(decision, plan)
    auto.traced(PROFILE, BatchKey(LONG, 8), GROWN, plan)
    assert auto.next_step(step(shape=LONG, state=GROWN)).kind is StepKind.PLAN
    assert auto.next_step(step(shape=TOKENS, state=GROWN)).kind is StepKind.PLAN  # its own entry, still kept


def test_token_budget_batches_are_covered_by_the_shape_that_holds_their_length():
    """Batch size times length about constant: a shorter length with a larger batch fits in a longer
    one's shape with no more than ``COVER_FACTOR`` its activations, so it is planned, not traced."""
    auto = planner(400 * MiB)
    first_step(auto, shape=LONG, size=16)
    decision = auto.next_step(step(size=32, shape=TOKENS, state=GROWN))  # 32 x 32 against 16 x 64
    assert decision.kind is StepKind.PLAN and decision.key[1] <= COVER_FACTOR


def test_profiles_are_kept_by_what_they_cover():
    auto = planner(400 * MiB)
    first_step(auto, shape=(((8,), torch.int64),))
    for length in range(16, 16 + 2 * MAX_ENTRIES, 2):
        shape = (((length,), torch.int64),)
        auto.traced(PROFILE, BatchKey(shape, 8), GROWN, auto.lowest_memory())
    kept = sorted(e.shape[0][0][0] for e in auto._entries)
    assert len(kept) == MAX_ENTRIES and kept[-1] == 14 + 2 * MAX_ENTRIES  # the longest, which covers the rest, stays


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


def test_processes_whose_padded_lengths_differ_agree_on_the_longest_shape():
    """Each process pads its batch to its own longest sequence: every process decides from the
    longest shape where the others fit in it, else from the largest by elements."""
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
    tall = BatchKey((((32, 3), torch.int64),), 8)
    assert agreed(wide, tall) == agreed(tall, wide) == BatchKey(tall.shape, 8)


def test_each_change_of_phase_is_one_debug_line_with_its_reason(caplog):
    caplog.set_level(logging.DEBUG, logger="lightning_swap")
    auto = planner(400 * MiB)
    first_step(auto)
    run(auto)
    changes = [r.getMessage() for r in caplog.records if "lightning-swap: auto:" in r.getMessage()]
    assert changes == [
        "lightning-swap: auto: first -> check: a traced step gave a profile.",
        "lightning-swap: auto: check -> run: the step held its prediction.",
    ]
