"""``policy="auto"`` under dynamic padding and token-budget batching (issues 33 and 41,
"Performance"): a GPT-2-like LM whose every batch is padded to its own longest sequence, so the
batch's shape changes from step to step.

    python benchmarks/dynamic_shapes.py            # default sizes (CPU: 8 min on 2 busy shared cores)
    python benchmarks/dynamic_shapes.py --quick    # tiny sizes, few steps (the suite's smoke test; 1-2 min)
    python benchmarks/dynamic_shapes.py --no-fsdp  # the single-process part only
    python benchmarks/dynamic_shapes.py --log INFO # the library's log (logging.getLogger("lightning_swap")) on stderr
    python benchmarks/dynamic_shapes.py --pad-to-multiple-of 64   # fewer shapes: lengths rounded up, as a collator can
    python benchmarks/dynamic_shapes.py --batching token-budget    # batch size x length about constant (fairseq's max_tokens)
    python benchmarks/dynamic_shapes.py --online-cost              # the budget held online: its cost per step, on vs off
    python benchmarks/dynamic_shapes.py --no-fsdp --steps 128      # a longer run: new longest shapes get rarer, traced steps amortize

**The data.** Each batch is ``batch`` documents; a document's length is drawn from a seeded
log-normal, ``round(exp(N(ln(median), sigma)))`` clipped to ``[min_len, max_len]`` (default:
median 128 tokens, sigma 0.75, clipped to [32, 512]: the long right tail of document lengths in
LM fine-tuning sets; about 3% of documents are clipped at 512, and 3% raised to 32). Every batch is padded to its own
longest document (Hugging Face's ``DataCollatorWithPadding`` default, no ``pad_to_multiple_of``):
inputs with token 0, targets with -100 (ignored by the loss); the model is causal, so no real
token attends to padding. Default model: ``examples.models.GPT`` with 4 blocks, width 96, 4 heads,
a 1024-token vocabulary, 512 positions; 4 documents a batch, 32 steps (12 per rank under FSDP).
``--quick``: median 16, clipped to [8, 64], a 3-block GPT of width 32, 2 documents, 10 steps (6).
``--batching token-budget``: each step draws one length and takes as many documents of it as fit
``tokens`` (default 1024, ``--quick`` 64), so the batch size falls as the length grows.

**Single process.** One seeded sequence of batches, run whole by every method, each on a fresh
model (the same seed) with AdamW at learning rate 0 (every method trains on the same weights):

- plain (every segment ``keep``), each uniform forced plan (one action for every segment:
  ``offload``, ``recompute``, ``selective``, ``recompute_offload``), and the lowest-memory plan
  (``Plan.lowest_memory``: every segment ``offload``, as ``auto``'s first step, and the regions
  outside the segments offloaded too), each under a ``SwapRuntime``;
- ``auto`` (``SwapSession`` with ``SwapConfig(policy="auto", budget_bytes=...)``, driven through
  its step API: ``open_step`` / ``backward`` / ``close_step``) at budgets 0.6 / 0.8 / 1.2 x plain's
  largest step peak over the sequence (the longest batch's), a fresh session each.

Every step's peak is the library's CPU meter (``StepStats.peak_device_bytes``: on CPU every step
of an uncompiled model is metered, for every method alike, so the meter's per-op cost is in every
time). A method's time is the wall time of the whole sequence (``auto``'s first and traced steps
included), after a warm-up by the benchmarks' rule on one batch of the sequence (Note [Every method
at the same steady state] in ``common.py``; ``auto``'s warm-up is a throwaway session, the timed
sequence a fresh one), denormals flushed unless ``--keep-denormals``. Plain is timed again last:
the two plain times show how far the shared machine drifted during the run.

Printed per budget: ``auto``'s total time over the fastest uniform plan whose largest peak fits
the budget (target <= 1.15x) and over plain where plain fits every batch (target <= 1.05x), the
steps of each kind the session returned (``StepKind``: first, trace, plan, run), and the largest
step peak over the budget (target: none). Targets are printed PASS/MISS, never asserted.

**FSDP2.** The same on 2 gloo processes (every block, then the model, ``fully_shard``-ed, as
``fsdp.py``), each rank on its own seeded sequence: plain, the lowest-memory plan and ``auto`` at a
per-rank budget halfway between the lowest-memory plan's largest per-rank peak and plain's. Two
paddings: ``per-rank`` (each rank pads its batch to its own longest document, as a
``DistributedSampler`` and a collator do: the ranks' shapes differ) and ``across-ranks`` (both
ranks pad to the longer of the two, so their shapes agree). Target: ``auto`` faster than the
lowest-memory plan.

**The online budget's cost** (``--online-cost``): the GPT-2-small-like model of ``common.py``
(``quick`` size) under ``auto`` at 1.2 x plain's peak, its plan settled, steps timed in turn with
the budget held online (a check before every segment's forward) and without (the check turned off
after the step opens); target: the difference within 1% of a step. Measured numbers, on the
machine it runs on; RESULTS.md says which.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: examples/, lightning_swap

from common import MiB, STEADY, denormals_flushed, denormals_line, keep_denormals_arg, print_table  # noqa: E402
from examples.models import GPT  # noqa: E402
from lightning_swap.core import Action, InfeasibleBudgetError, Plan, SwapConfig, SwapRuntime, SwapSession, find_segments  # noqa: E402

SIZES = {
    "default": dict(vocab=1024, dim=96, heads=4, layers=4, batch=4, steps=32, median=128, sigma=0.75, min_len=32, max_len=512,
                    fsdp_steps=12, rule="full", tokens=1024),
    "quick": dict(vocab=128, dim=32, heads=2, layers=3, batch=2, steps=10, median=16, sigma=0.75, min_len=8, max_len=64,
                  fsdp_steps=6, rule="smoke", tokens=64),
}
BUDGETS = (0.6, 0.8, 1.2)
#: Where the single-process part trains (``--device``); the FSDP part's processes train on the CPU (gloo).
DEVICE = torch.device("cpu")
UNIFORM = (Action.OFFLOAD, Action.RECOMPUTE, Action.SELECTIVE, Action.RECOMPUTE_OFFLOAD)
LOWEST = "lowest-memory"
#: The action of ``auto``'s first step (the lowest-memory plan's).
FIRST_ACTION = Action.OFFLOAD
TARGET_UNIFORM, TARGET_PLAIN, TARGET_ONLINE = 1.10, 1.03, 0.01
FSDP_PADDINGS = ("per-rank", "across-ranks")
KIND_LETTERS = {"first": "F", "trace": "T", "plan": "P", "run": "r"}


# -- the data: dynamic padding ----------------------------------------------------------------
def document_lengths(size: dict, count: int, seed: int) -> list[int]:
    """``count`` document lengths: ``round(exp(N(ln(median), sigma)))`` clipped to ``[min_len, max_len]``."""
    rng = random.Random(seed)
    mu = math.log(size["median"])
    return [min(size["max_len"], max(size["min_len"], round(rng.lognormvariate(mu, size["sigma"])))) for _ in range(count)]


def padded_batch(size: dict, lengths: list[int], seed: int, pad_to: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents of ``lengths`` (random tokens), padded to the longest (or ``pad_to``), rounded up
    to a multiple of ``size["multiple"]`` (a collator's ``pad_to_multiple_of``) when set: inputs
    with token 0, targets with -100 (ignored by the loss)."""
    t = pad_to or max(lengths)
    if size.get("multiple"):
        t = min(-(-t // size["multiple"]) * size["multiple"], size["max_len"])  # never past the model's positions
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(len(lengths), t, dtype=torch.long)
    y = torch.full((len(lengths), t), -100, dtype=torch.long)
    for i, n in enumerate(lengths):
        doc = torch.randint(1, size["vocab"], (n + 1,), generator=g)
        x[i, :n], y[i, :n] = doc[:-1], doc[1:]
    return x, y


def sequence(size: dict, steps: int, seed: int) -> list[list[int]]:
    """The documents' lengths of each of ``steps`` batches: ``batch`` documents each, or under a
    token budget (``size["token_budget"]``) one length a step, as many documents of it as fit
    ``size["tokens"]``."""
    if size.get("token_budget"):
        return [[n] * max(1, size["tokens"] // n) for n in document_lengths(size, steps, seed)]
    flat = document_lengths(size, steps * size["batch"], seed)
    return [flat[i * size["batch"] : (i + 1) * size["batch"]] for i in range(steps)]


def describe_lengths(padded: list[int]) -> str:
    """The padded lengths, and where the running longest grows (the shapes a plan made for a
    longer shape cannot cover)."""
    records, longest = [], 0
    for i, n in enumerate(padded):
        if n > longest:
            records.append(f"{n}@{i}")
            longest = n
    return (f"padded lengths {min(padded)}..{max(padded)}, median {statistics.median(padded):g}, {len(set(padded))} distinct in "
            f"{len(padded)} steps; a new longest at step (length@step): {' '.join(records)}")


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1), ignore_index=-100)


def build_gpt(size: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=size["vocab"], dim=size["dim"], heads=size["heads"], layers=size["layers"], seq=size["max_len"])


# -- one method over the sequence ---------------------------------------------------------------
@dataclass
class Run:
    """One method over the sequence: each step's peak (CPU meter) and wall ms, and under ``auto``
    each step's kind and the plans it ran."""

    name: str
    peaks: list[int]
    ms: list[float]
    warmup_steps: int
    kinds: list[str] = field(default_factory=list)
    plans: list[str] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return sum(self.ms) / 1e3

    @property
    def peak(self) -> int:
        return max(self.peaks)

    def over(self, budget: int) -> list[int]:
        """Bytes over ``budget`` of each step that was over."""
        return [p - budget for p in self.peaks if p > budget]


class Stepper:
    """One method on one model: ``step(batch)`` runs one training step and returns its peak.
    ``plan`` (a forced plan, under a ``SwapRuntime``) or ``budget`` (``auto``, under a ``SwapSession``)."""

    def __init__(self, model: torch.nn.Module, *, plan: Optional[Plan] = None, budget: Optional[int] = None,
                 collectives: Any = None) -> None:
        self.model = model
        self.online = True  # False: the budget is not held online in the steps (its cost measured)
        self.opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: every method trains on the same weights
        self.kinds: list[str] = []
        self.plans: list[str] = []
        if plan is not None:
            self.runtime, self.session = SwapRuntime(model, plan, device=_device_of(model)).install(), None
        else:
            config = SwapConfig(policy="auto", budget_bytes=budget, log_plan=False)
            kwargs = {} if collectives is None else dict(collectives=collectives)
            self.runtime, self.session = None, SwapSession(model, config, _device_of(model), **kwargs)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        track = [batch, self.opt.state]
        if self.session is None:
            self.runtime.begin_step(track)
            loss_of(self.model, batch).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return self.runtime.end_step().peak_device_bytes
        kind = self.session.open_step(batch, track, [self.opt.state])
        if not self.online:
            self.session.runtime._online = None  # the checks before each segment's forward, off
        self.kinds.append(kind.value)
        loss = loss_of(self.model, batch)
        with self.session.backward():
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        stats = self.session.close_step()
        self.plans.append(self.session.plan.summary())
        return stats.peak_device_bytes

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        else:
            self.runtime.remove()


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def timed(step: Callable[[], int], sync: Callable[[float], float] = lambda ms: ms) -> tuple[int, float]:
    """(the step's peak, its wall ms; ``sync``: the ms every process agrees on). On CUDA the
    device is idle at both ends (the harness's own waits: a step's time is its kernels')."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    peak = step()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return peak, sync((time.perf_counter() - start) * 1e3)


def warm_up(stepper: Stepper, batch: tuple[torch.Tensor, torch.Tensor], rule: Any, sync: Callable[[float], float] = lambda ms: ms) -> int:
    """Steps on ``batch`` until the rule finds their times steady (Note [Every method at the same
    steady state] in ``common.py``): how many ran."""
    warm: list[float] = []
    while not rule.done(warm):
        warm.append(timed(lambda: stepper.step(batch), sync)[1])
    return len(warm)


def run_method(name: str, size: dict, batches: list, warm_batch: tuple, rule: Any, *, plan_for: Optional[Callable] = None,
               budget: Optional[int] = None, collectives: Any = None, sync: Callable[[float], float] = lambda ms: ms,
               model_for: Callable[[], torch.nn.Module] = None) -> Run:
    """``name`` over ``batches``: warmed up on ``warm_batch`` (``auto``: in a throwaway session),
    then every batch once, each step's peak and wall ms."""
    model_for = model_for or (lambda: build_gpt(size).to(DEVICE))

    def stepper() -> Stepper:
        model = model_for()
        plan = plan_for(find_segments(model)) if plan_for is not None else None
        return Stepper(model, plan=plan, budget=budget, collectives=collectives)

    first = stepper()
    warmup = warm_up(first, warm_batch, rule, sync)
    if budget is not None:  # auto: the timed sequence starts from a fresh session, as training does
        first.close()
        first = stepper()
    peaks, ms = [], []
    for batch in batches:
        peak, t = timed(lambda: first.step(batch), sync)
        peaks.append(peak)
        ms.append(t)
    first.close()
    return Run(name, peaks, ms, warmup, first.kinds, first.plans)


def uniform_plan(action: Action) -> Callable[[list[str]], Plan]:
    return lambda segments: Plan(actions={n: action for n in segments})


def lowest_memory_plan(segments: list[str]) -> Plan:
    return Plan.lowest_memory(segments, action=FIRST_ACTION)


# -- output ----------------------------------------------------------------------------------
def verdict(value: Optional[float], target: float) -> str:
    return "-" if value is None else f"{value:.2f}x {'PASS' if value <= target else 'MISS'}"


def kinds_summary(kinds: list[str]) -> str:
    counts = Counter(kinds)
    return " ".join(f"{k}={counts[k]}" for k in KIND_LETTERS if counts[k])


def plans_ran(run: Run) -> str:
    """The plans ``auto`` ran, with how many steps each, most used first."""
    return "; ".join(f"{plan} x{n}" for plan, n in Counter(run.plans).most_common())


def pad_multiple(size: dict) -> str:
    return f", padded up to a multiple of {size['multiple']}" if size.get("multiple") else ""


def kinds_line(kinds: list[str]) -> str:
    return "".join(KIND_LETTERS.get(k, "?") for k in kinds)


def over_text(run: Run, budget: int) -> str:
    over = run.over(budget)
    return "none PASS" if not over else f"{max(over) / MiB:.2f} MiB ({len(over)} step(s)) MISS"


# -- single process ------------------------------------------------------------------------------
def single_process(size: dict, args: argparse.Namespace) -> None:
    rule = STEADY[size["rule"]]
    lengths = sequence(size, size["steps"], seed=args.seed)
    batches = [tuple(t.to(DEVICE) for t in padded_batch(size, b, seed=args.seed * 100_000 + i)) for i, b in enumerate(lengths)]
    padded = [b[0].shape[1] for b in batches]
    warm_index = sorted(range(len(padded)), key=lambda i: padded[i])[len(padded) // 2]  # a batch of the median length
    warm_batch = batches[warm_index]
    batching = f"a token budget of {size['tokens']} tokens a batch" if size.get("token_budget") else f"batch {size['batch']} documents"
    print(f"\n== single process: GPT {size['layers']} blocks, width {size['dim']}, {size['heads']} heads, vocab {size['vocab']}, "
          f"{batching}, {size['steps']} steps; AdamW at lr 0")
    print(f"   documents: log-normal, median {size['median']}, sigma {size['sigma']}, clipped to [{size['min_len']}, {size['max_len']}], "
          f"seed {args.seed}{pad_multiple(size)}; {describe_lengths(padded)}")
    print(f"   every method warmed up on step {warm_index}'s batch (length {padded[warm_index]}), then the whole sequence timed")

    runs: dict[str, Run] = {}
    started = time.perf_counter()
    runs["plain"] = run_method("plain", size, batches, warm_batch, rule, plan_for=uniform_plan(Action.KEEP))
    for action in UNIFORM:
        runs[action.value] = run_method(action.value, size, batches, warm_batch, rule, plan_for=uniform_plan(action))
    runs[LOWEST] = run_method(LOWEST, size, batches, warm_batch, rule, plan_for=lowest_memory_plan)
    plain_peak = runs["plain"].peak
    budgets = {f: int(f * plain_peak) for f in BUDGETS}
    autos, infeasible = {}, {}
    for f, b in budgets.items():
        try:
            autos[f] = run_method(f"auto @ {f}x", size, batches, warm_batch, rule, budget=b)
        except InfeasibleBudgetError as err:  # below the lowest-memory plan's peak: auto says so before a step runs over
            infeasible[f] = err.min_budget_bytes
    again = run_method("plain (again, last)", size, batches, warm_batch, rule, plan_for=uniform_plan(Action.KEEP))
    wall = time.perf_counter() - started

    plain = runs["plain"]
    print(f"\n   plain's largest step peak {plain_peak / MiB:.2f} MiB (the longest batch's); budgets: "
          + ", ".join(f"{f}x = {b / MiB:.2f} MiB" for f, b in budgets.items()))
    header = ("method", "total s", "x plain", "median step ms", "largest peak MiB", "x plain peak", "warm-up steps")
    rows = [
        (r.name, f"{r.total_s:.2f}", f"{r.total_s / plain.total_s:.2f}", f"{statistics.median(r.ms):.1f}", f"{r.peak / MiB:.2f}",
         f"{r.peak / plain_peak:.2f}", str(r.warmup_steps))
        for r in [*runs.values(), *autos.values(), again]
    ]
    print()
    print_table(header, rows)

    header = ("budget", "fastest uniform that fits", "auto s", f"auto / uniform (<= {TARGET_UNIFORM})", f"auto / plain (<= {TARGET_PLAIN})", "step kinds",
              "largest over budget (none)", "auto's last plan")
    rows = []
    for f, budget in budgets.items():
        if f in infeasible:
            rows.append((f"{f}x {budget / MiB:.2f} MiB", "none fits" if runs[LOWEST].peak > budget else "?", "-", "-", "-",
                         f"InfeasibleBudgetError (min {infeasible[f] / MiB:.2f} MiB)", "none PASS", "-"))
            continue
        auto = autos[f]
        fits = [r for r in runs.values() if r.peak <= budget]
        fastest = min(fits, key=lambda r: r.total_s) if fits else None
        rows.append((
            f"{f}x {budget / MiB:.2f} MiB",
            f"{fastest.name} {fastest.total_s:.2f} s" if fastest else "none fits",
            f"{auto.total_s:.2f}",
            verdict(auto.total_s / fastest.total_s if fastest else None, TARGET_UNIFORM),
            verdict(auto.total_s / plain.total_s if plain.peak <= budget else None, TARGET_PLAIN),
            kinds_summary(auto.kinds),
            over_text(auto, budget),
            auto.plans[-1] if auto.plans else "-",
        ))
    print()
    print_table(header, rows)
    print(f"\n   padded length of each step: {' '.join(map(str, padded))}")
    print("   auto's steps (F first, T traced, P planned, r run), one letter per step, and the plans it ran (steps each):")
    for f in autos:
        print(f"   {f}x: {kinds_line(autos[f].kinds)}  {plans_ran(autos[f])}")
    print(f"\n   plain first {plain.total_s:.2f} s, again last {again.total_s:.2f} s ({again.total_s / plain.total_s:.2f}x: the "
          f"machine's drift over the run); single-process part {wall:.0f} s")


# -- the online budget's cost ----------------------------------------------------------------------
def online_cost(args: argparse.Namespace, rounds: int = 6, steps: int = 4) -> None:
    """The GPT-2-small-like model (``common.py``, ``quick``) under ``auto`` at 1.2 x plain's peak:
    once its plan runs, ``rounds`` of ``steps`` steps with the budget held online and as many
    without, in turn; the medians' difference over the step."""
    from common import model_specs

    spec = model_specs("quick", ["gpt2-small-like"])[0]
    torch.manual_seed(0)
    vocab, seq, batch = spec.classes, spec.size, spec.base_batch
    data = (torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq)))
    probe = Stepper(spec.build(), plan=uniform_plan(Action.KEEP)(find_segments(spec.build())))
    plain_peak = max(probe.step(data) for _ in range(3))
    probe.close()
    stepper = Stepper(spec.build(), budget=int(1.2 * plain_peak))
    while not stepper.kinds or stepper.kinds[-1] != "run":
        stepper.step(data)
    on, off = [], []
    for _ in range(rounds):
        for flag, times in ((True, on), (False, off)):
            stepper.online = flag
            times.extend(timed(lambda: stepper.step(data))[1] for _ in range(steps))
    stepper.close()
    on_ms, off_ms = statistics.median(on), statistics.median(off)
    cost = (on_ms - off_ms) / off_ms
    print(f"\n== the online budget's cost: GPT-2-small-like ({spec.name}, quick size), batch {batch} x {seq} tokens, auto at 1.2 x "
          f"plain's peak ({stepper.plans[-1]}); {rounds} rounds of {steps} steps each way, in turn")
    print(f"   median step {on_ms:.1f} ms held online, {off_ms:.1f} ms without: {100 * cost:+.2f}% "
          f"(target within {100 * TARGET_ONLINE:.0f}%: {'PASS' if abs(cost) <= TARGET_ONLINE else 'MISS'})")


# -- FSDP2 on 2 gloo processes ----------------------------------------------------------------------
def _fsdp_gpt(size: dict) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = build_gpt(size)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _fsdp_rank(rank: int, port: int, size: dict, padding: str, seed: int, flush: bool, log: Optional[str], results) -> None:
    import torch.distributed as dist

    from fsdp import _collectives, _largest  # noqa: E402 - fsdp.py's collectives and its slower-rank rule

    torch.set_num_threads(1)
    if log:
        logging.basicConfig(level=getattr(logging, log), format=f"[rank {rank}] %(name)s %(levelname)s: %(message)s")
        logging.getLogger("lightning_swap").setLevel(getattr(logging, log))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        steps = size["fsdp_steps"]
        lengths = sequence(size, steps, seed=seed + 1000 * (rank + 1))  # each rank its own documents
        pad_to = [None] * steps
        if padding == "across-ranks":
            pad_to = [int(_largest(float(max(b)))) for b in lengths]
        batches = [
            padded_batch(size, b, seed=seed * 100_000 + 1000 * rank + i, pad_to=p) for i, (b, p) in enumerate(zip(lengths, pad_to))
        ]
        padded = [b[0].shape[1] for b in batches]
        warm_index = sorted(range(steps), key=lambda i: padded[i])[steps // 2]
        # every rank warms up on a batch of one length (rank 0's median): the collectives match
        warm_len = int(_largest(float(padded[warm_index]) if rank == 0 else 0.0))
        warm_batch = padded_batch(size, [warm_len] * size["batch"], seed=seed * 100_000 + 999)
        rule = STEADY[size["rule"]]
        kwargs = dict(model_for=lambda: _fsdp_gpt(size), sync=_largest)
        runs = {}
        with denormals_flushed(flush):
            runs["plain FSDP2"] = run_method("plain FSDP2", size, batches, warm_batch, rule, plan_for=uniform_plan(Action.KEEP), **kwargs)
            runs[LOWEST] = run_method(LOWEST, size, batches, warm_batch, rule, plan_for=lowest_memory_plan, **kwargs)
            plain, lowest = _largest(runs["plain FSDP2"].peak), _largest(runs[LOWEST].peak)
            budget = int(lowest + 0.5 * (plain - lowest))
            runs["FSDP2 + auto"] = run_method("FSDP2 + auto", size, batches, warm_batch, rule, budget=budget, collectives=_collectives(),
                                              **kwargs)
        # plain dicts: the manager's process cannot import this script's classes
        results[rank] = dict(
            runs={k: dataclasses.asdict(v) for k, v in runs.items()}, budget=budget, plain=plain, lowest=lowest, padded=padded,
            warm_len=warm_len, lowest_plan=lowest_memory_plan(find_segments(build_gpt(size))).summary(),
        )
    finally:
        dist.destroy_process_group()


def fsdp(size: dict, args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    from fsdp import _free_port

    for padding in args.fsdp_padding:
        started = time.perf_counter()
        results = mp.Manager().dict()
        mp.spawn(_fsdp_rank, args=(_free_port(), size, padding, args.seed, args.flush, args.log, results), nprocs=2)
        wall = time.perf_counter() - started
        results = {rank: dict(results[rank]) for rank in (0, 1)}
        for rank in (0, 1):
            results[rank]["runs"] = {k: Run(**v) for k, v in results[rank]["runs"].items()}
        r0 = results[0]
        budget = r0["budget"]
        print(f"\n== FSDP2, 2 CPU processes (gloo), padding {padding}{pad_multiple(size)}: GPT {size['layers']} blocks, width "
              f"{size['dim']}, vocab {size['vocab']}, batch {size['batch']} documents per rank, {size['fsdp_steps']} steps; AdamW at lr 0; "
              f"step time the slower rank's")
        for rank in (0, 1):
            print(f"   rank {rank}: {describe_lengths(results[rank]['padded'])}")
        print(f"   warm-up on a batch of length {r0['warm_len']}; per-rank budget {budget / MiB:.2f} MiB, halfway between the "
              f"lowest-memory plan's largest per-rank peak ({r0['lowest'] / MiB:.2f} MiB) and plain's ({r0['plain'] / MiB:.2f} MiB)")
        header = ("method", "rank", "total s", "x lowest-memory", "median step ms", "largest peak MiB", "over budget", "step kinds",
                  "last plan")
        rows = []
        for rank in (0, 1):
            runs = results[rank]["runs"]
            lowest = runs[LOWEST]
            for name, run in runs.items():
                is_auto = bool(run.kinds)
                fits = f"over by {(run.peak - budget) / MiB:.2f} MiB" if run.peak > budget else "fits"
                rows.append((
                    name, str(rank), f"{run.total_s:.2f}", f"{run.total_s / lowest.total_s:.2f}", f"{statistics.median(run.ms):.1f}",
                    f"{run.peak / MiB:.2f}", over_text(run, budget) if is_auto else fits,
                    kinds_summary(run.kinds) if is_auto else "-", (run.plans[-1] if run.plans else "-") if is_auto else "-",
                ))
        print()
        print_table(header, rows)
        auto, lowest = results[0]["runs"]["FSDP2 + auto"], results[0]["runs"][LOWEST]
        ratio = auto.total_s / lowest.total_s
        same = set(auto.plans) == {r0["lowest_plan"]}
        note = " (auto ran the lowest-memory plan on every step: the difference is noise)" if same else ""
        print(f"\n   auto / lowest-memory plan (total time, slower rank's steps): {ratio:.2f}x, target < 1: "
              f"{'PASS' if ratio < 1 else 'MISS'}{note}")
        print(f"   auto's steps: {kinds_line(auto.kinds)}; the plans it ran: {plans_ran(auto)}; FSDP part ({padding}) {wall:.0f} s")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few steps (the smoke test)")
    parser.add_argument("--seed", type=int, default=0, help="the documents' lengths and tokens")
    parser.add_argument("--no-fsdp", action="store_true", help="the single-process part only")
    parser.add_argument("--fsdp-padding", nargs="+", choices=FSDP_PADDINGS, default=list(FSDP_PADDINGS),
                        help="the FSDP part's paddings (default: both)")
    parser.add_argument("--pad-to-multiple-of", type=int, default=None,
                        help="round each batch's padded length up to a multiple of this (a collator's pad_to_multiple_of; default: none)")
    parser.add_argument("--batching", choices=("padding", "token-budget"), default="padding",
                        help="dynamic padding (a fixed number of documents a batch) or a token budget (default: padding)")
    parser.add_argument("--steps", type=int, default=None, help="the single-process part's steps (default: the size's, 32 / 10 quick)")
    parser.add_argument("--online-cost", action="store_true", help="only the online budget's cost, on vs off")
    parser.add_argument("--log", choices=("DEBUG", "INFO", "WARNING"), default=None, help="the library's log level, on stderr")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the single-process part trains (cuda: peaks are the CUDA allocator's; FSDP stays on CPU)")
    keep_denormals_arg(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    global DEVICE
    DEVICE = torch.device(args.device)
    size = dict(SIZES["quick" if args.quick else "default"], multiple=args.pad_to_multiple_of, token_budget=args.batching == "token-budget")
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps must be a positive integer, got {args.steps}")
        size["steps"] = args.steps
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if args.log:
        logging.basicConfig(level=getattr(logging, args.log), format="%(name)s %(levelname)s: %(message)s")
        logging.getLogger("lightning_swap").setLevel(getattr(logging, args.log))
    args.flush = not args.keep_denormals
    where = (f"cuda ({torch.cuda.get_device_name()}), budgets on the CUDA allocator's peak" if DEVICE.type == "cuda" else
             "cpu (1 thread per process), simulated budget (CPU live-storage meter, every step metered)")
    print(f"dynamic shapes (issues 33, 41): device {where}, torch {torch.__version__}, size {'quick' if args.quick else 'default'}, "
          f"{denormals_line(DEVICE, args.keep_denormals)}, {time.strftime('%Y-%m-%d')}")
    print(f"timing: each method on a fresh seeded model, {STEADY[size['rule']].describe()} on one batch, then the whole sequence "
          f"once (its wall time; auto from a fresh session)")
    started = time.perf_counter()
    with denormals_flushed(args.flush):
        if args.online_cost:
            online_cost(args)
        else:
            single_process(size, args)
    if not args.no_fsdp and not args.online_cost and not size["token_budget"]:
        fsdp(size, args)
    print(f"\ntotal wall time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
