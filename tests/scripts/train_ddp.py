"""Train the test CNN with 2-process DDP on CPU (gloo) under plain "ddp" and "ddp_cpu_swap"
with each given policy; rank 0 saves every resulting state_dict to --out.

Run as a script: Lightning's DDP launcher starts the second rank by re-running this file.
"""

import argparse
import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import lightning_swap  # noqa: E402,F401  registers "ddp_cpu_swap"
from lightning_swap import DDPCPUSwapStrategy  # noqa: E402
from tests.lit import LitModel  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--policies", nargs="+", default=["offload"])
    parser.add_argument("--finder-budget", type=int, default=0, help="run SwapBatchSizeFinder under this budget instead")
    parser.add_argument("--auto-budgets", type=int, nargs="*", default=[], help="train policy='auto' under each budget instead")
    parser.add_argument("--uneven", action="store_true", help="with --auto-budgets: rank 1's first batch is larger")
    args = parser.parse_args()
    if args.finder_budget:
        return find(args)
    if args.auto_budgets:
        return auto(args)
    results = {}
    for policy in [None, *args.policies]:
        L.seed_everything(0, verbose=False)
        module = LitModel(args.model, batch_size=4)
        strategy = "ddp" if policy is None else DDPCPUSwapStrategy(policy=policy, min_offload_bytes=0)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=3,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module)
        key = policy or "plain"
        results[key] = {k: v.clone() for k, v in module.state_dict().items()}
        if policy is not None:
            results[key + ":plan"] = {k: a.value for k, a in trainer.strategy.plan.actions.items()}
            results[key + ":offloaded"] = trainer.strategy.step_stats.offloaded_bytes
        results[key + ":world"] = trainer.world_size
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        torch.save(results, args.out)


def find(args):
    """Every rank saves what the finder agreed on and the peak of training at that batch."""
    from lightning_swap import SwapBatchSizeFinder

    L.seed_everything(0, verbose=False)
    module = LitModel(args.model, batch_size=8, samples=4096)
    finder = SwapBatchSizeFinder(mode="max", max_batch_size=512)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPCPUSwapStrategy(budget_bytes=args.finder_budget, min_offload_bytes=0),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[finder],
        default_root_dir=os.path.dirname(args.out),
    )
    trainer.fit(module)
    rank = trainer.global_rank
    torch.save(
        {
            "batch": finder.optimal_batch_size,
            "module_batch": module.batch_size,
            "trials": len(finder.result.trials),
            "peak": max(s.peak_device_bytes for s in trainer.strategy.stats_history),
            "plan": {k: a.value for k, a in trainer.strategy.plan.actions.items()},
        },
        f"{args.out}.rank{rank}",
    )


class PlanPerStep(L.Callback):
    """The plan each step ran under (its actions) and its batch size, on this rank."""

    def __init__(self):
        self.plans, self.batches = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plan = trainer.strategy.plan
        self.plans.append(None if plan is None else {k: a.value for k, a in plan.actions.items()})
        self.batches.append(len(batch[0]))


class UnevenFirstBatch(LitModel):
    """Each rank's own batches (no distributed sampler): rank 1's first batch has twice rank 0's
    rows, and so has its fifth (once a plan was made from rank 0's smaller batches); the others
    the same number."""

    def train_dataloader(self):
        from torch.utils.data import DataLoader, TensorDataset

        rank = self.trainer.global_rank
        sizes = [self.batch_size * (2 if rank == 1 and i in (0, 4) else 1) for i in range(16)]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        x, y = self._data
        n = sum(sizes)
        data = TensorDataset(x.repeat(-(-n // len(x)), *[1] * (x.dim() - 1))[:n], y.repeat(-(-n // len(y)))[:n])
        return DataLoader(data, batch_sampler=[list(range(s, s + k)) for s, k in zip(starts, sizes)])


def auto(args):
    """Every rank saves, per budget, its plan and every step's measured peak under policy="auto"
    (Note [Observe only what fits]: the guard steps' verdict is broadcast from rank 0)."""
    results = {}
    for budget in args.auto_budgets:
        L.seed_everything(0, verbose=False)
        module = (UnevenFirstBatch if args.uneven else LitModel)(args.model, batch_size=4)
        strategy = DDPCPUSwapStrategy(budget_bytes=budget, min_offload_bytes=0)
        plans = PlanPerStep()
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=8 if args.uneven else 6, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[plans],
            use_distributed_sampler=not args.uneven,
        )
        trainer.fit(module)
        results[budget] = {
            "plan": {k: a.value for k, a in trainer.strategy.plan.actions.items()},
            "peaks": [s.peak_device_bytes for s in trainer.strategy.stats_history],
            "plans": plans.plans,
            "batches": plans.batches,
        }
        rank = trainer.global_rank
    torch.save(results, f"{args.out}.rank{rank}")


if __name__ == "__main__":
    main()
