"""Batch-size search: Lightning's ``BatchSizeFinder`` (power, binsearch) against ours.

For ResNet-50 and a GPT-2-small-like model under one budget (the plain-training peak at the
model's base batch), each searcher runs in a fresh ``Trainer`` and reports: the batch found, the
trial runs of the fit loop, how many crashed out of memory (or, for ours, measured over the
budget), the wall time of the whole ``fit`` that searched, and samples/s at the batch found
(plain-loop steps with the method the searcher trains with: plain for Lightning's, the plan
found for ours; timed at the same steady state for every searcher: Note [Every method at the
same steady state] in ``common.py``).

- Lightning: ``Tuner.scale_batch_size(mode=...)`` with its defaults (init 2, 3 steps per trial)
  on ``CPUSwapStrategy(policy="keep")`` subclassed to raise
  ``torch.OutOfMemoryError("CUDA out of memory (simulated: ...)")`` when a step's measured peak
  exceeds the budget (on a GPU without a simulated budget it would be the real error).
- Ours: ``SwapBatchSizeFinder(mode="max")`` and ``mode="throughput"`` with
  ``CPUSwapStrategy(budget_bytes=budget)``; its trial runs include its warm-up: one run in
  ``mode="max"``, in ``mode="throughput"`` runs of 4 steps until the step time is steady (Note
  [Steady before timing] in ``lightning_swap/core/scale/warmup.py``).

Trial runs are counted by wrapping Lightning's ``_try_loop_run`` for the duration of the
benchmark (restored afterwards). Both searchers stop at ``--cap`` times the base batch.

    python benchmarks/batch_search.py --quick     # CPU, small sizes, simulated budget
    python benchmarks/batch_search.py             # full sizes on a GPU
    python benchmarks/batch_search.py --smoke     # tiny, seconds (the smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import time
import warnings
from typing import Any, Iterator

import lightning as L
import torch
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.tuner import batch_size_scaling as bss
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from common import MiB, Bench, common_args, denormals_flushed, fmt, model_specs, print_table, setup
from lightning_swap import CPUSwapStrategy, Plan, SwapBatchSizeFinder

HEADER = ("searcher", "batch found", "trial runs", "OOM crashes", "search wall s", "samples/s at batch", "x Lightning power")


class _Samples(Dataset):
    """A long synthetic dataset cycling through one pre-made pool of samples."""

    def __init__(self, spec, device_pool: int = 64) -> None:
        self.x, self.y = spec.make_batch(device_pool, torch.device("cpu"))

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int):
        return self.x[i % len(self.x)], self.y[i % len(self.y)]


class LitBench(L.LightningModule):
    def __init__(self, spec, batch_size: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = spec.build()
        self.spec = spec
        self.batch_size = batch_size
        self._data = _Samples(spec)

    def training_step(self, batch, batch_idx):
        return self.spec.loss(self.model, batch[0], batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(self._data, batch_size=self.batch_size, shuffle=False)


class SimulatedOOMStrategy(CPUSwapStrategy):
    """Plain training (every segment kept) on a device of ``simulated_budget_bytes``: a step whose
    measured peak exceeds it raises the error CUDA would have raised."""

    def __init__(self, simulated_budget_bytes: int, **kwargs: Any) -> None:
        super().__init__(policy="keep", log_stats=False, **kwargs)
        self.simulated_budget_bytes = simulated_budget_bytes

    @override
    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        stats = self.swap_session.last_stats if self.swap_session is not None else None
        if stats is not None and stats.peak_device_bytes > self.simulated_budget_bytes:
            self.swap_session.last_stats = None
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated: peak {stats.peak_device_bytes / MiB:.1f} MiB > "
                f"budget {self.simulated_budget_bytes / MiB:.1f} MiB)"
            )
        return out


@contextlib.contextmanager
def counted_trial_runs() -> Iterator[dict[str, int]]:
    """Counts calls of Lightning's ``_try_loop_run`` and those that raised out-of-memory."""
    counts = {"runs": 0, "oom": 0}
    original = bss._try_loop_run

    def counting(trainer: Any, params: Any) -> None:
        counts["runs"] += 1
        try:
            original(trainer, params)
        except torch.OutOfMemoryError:
            counts["oom"] += 1
            raise

    bss._try_loop_run = counting
    try:
        yield counts
    finally:
        bss._try_loop_run = original


def _quiet() -> None:
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(("lightning", "pytorch_lightning")):
            logging.getLogger(name).setLevel(logging.WARNING)


def _trainer(device: torch.device, strategy: Any, root: str, callbacks=()) -> L.Trainer:
    _quiet()
    return L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=list(callbacks),
    )


def search_lightning(spec, device, budget: int, mode: str, cap: int, root: str):
    module = LitBench(spec, batch_size=2)
    trainer = _trainer(device, SimulatedOOMStrategy(budget), root)
    with counted_trial_runs() as counts:
        start = time.perf_counter()
        found = Tuner(trainer).scale_batch_size(module, mode=mode, max_val=cap)
        wall = time.perf_counter() - start
    return found, counts["runs"], counts["oom"], wall, None, 0


def search_ours(spec, device, budget: int, mode: str, cap: int, root: str):
    module = LitBench(spec, batch_size=2)
    finder = SwapBatchSizeFinder(mode=mode, budget_bytes=budget, max_batch_size=cap)
    finder._early_exit = True  # as Lightning's Tuner sets it: stop after the search, train nothing
    trainer = _trainer(device, CPUSwapStrategy(budget_bytes=budget, log_stats=False), root, callbacks=[finder])
    with counted_trial_runs() as counts:
        start = time.perf_counter()
        trainer.fit(module)
        wall = time.perf_counter() - start
    result = finder.result
    # The plan names the LightningModule's segments ("model.layer1.0"); the plain loop has the bare model.
    plan = Plan(actions={name.removeprefix("model."): action for name, action in result.plan.actions.items()})
    warm = counts["runs"] - len(result.trials)  # the warm-up's runs (Note [Steady before timing] in throughput mode)
    return result.batch_size, counts["runs"], result.failed_trials, wall, plan, warm


def lightning_plain_peak(spec, device, batch_size: int, root: str) -> int:
    """The plain peak of Lightning's loop at ``batch_size`` (its loop holds a little more than a bare one)."""
    module = LitBench(spec, batch_size=batch_size)
    strategy = CPUSwapStrategy(policy="keep", log_stats=False)
    trainer = _trainer(device, strategy, root)
    trainer.fit_loop.epoch_loop.max_steps = 2
    trainer.fit(module)
    return max(s.peak_device_bytes for s in strategy.stats_history)


def run_model(spec, device, args) -> None:
    bench = Bench(spec, device, steady=args.steady)
    with tempfile.TemporaryDirectory() as root:
        budget = lightning_plain_peak(spec, device, spec.base_batch, root)
    cap = args.cap * spec.base_batch
    print(f"\n== {spec.name} ({spec.kind} {spec.size}): budget {budget / MiB:.1f} MiB = plain peak of Lightning's loop at batch "
          f"{spec.base_batch}; searches capped at batch {cap}")
    searchers = [
        ("Lightning power", lambda root: search_lightning(spec, device, budget, "power", cap, root)),
        ("Lightning binsearch", lambda root: search_lightning(spec, device, budget, "binsearch", cap, root)),
        ("ours: max", lambda root: search_ours(spec, device, budget, "max", cap, root)),
        ("ours: throughput", lambda root: search_ours(spec, device, budget, "throughput", cap, root)),
    ]
    rows, base_rate = [], None
    for name, search in searchers:
        with tempfile.TemporaryDirectory() as root:
            batch, runs, ooms, wall, plan, warm = search(root)
        m = bench.measure("plain" if plan is None else name, batch, plan=plan, repeats=args.repeats)
        rate = m.samples_per_s
        base_rate = base_rate or rate
        note = "" if m.peak_bytes <= budget else f" (peak {m.peak_bytes / MiB:.1f} MiB OVER)"
        rows.append((
            name + (f" [{plan.summary()}]" if plan is not None else ""),
            str(batch),
            str(runs) + (f" incl. {warm} warm-up" if plan is not None else ""),
            str(ooms) + (" over budget" if plan is not None else ""),
            f"{wall:.1f}",
            fmt(rate, ".1f") + note,
            fmt(rate / base_rate if rate and base_rate else None, ".2f"),
        ))
    print_table(HEADER, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(parser)
    parser.add_argument("--cap", type=int, default=None, help="largest batch searched, as a multiple of the base batch")
    args = parser.parse_args(argv)
    size, device = setup(args)
    if args.cap is None:
        args.cap = {"smoke": 4, "quick": 6, "full": 16}[size]
    warnings.filterwarnings("ignore", module="lightning")
    names = args.models or (["gpt2-small-like"] if size == "smoke" else ["resnet50", "gpt2-small-like"])
    # At 32 px ResNet-50's static bytes fill the budget and the 5% margins leave no batch.
    with denormals_flushed(args.flush):
        for spec in model_specs(size, names, image=64 if size == "quick" else None):
            run_model(spec, device, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
