"""The main job: train a torchvision ResNet on synthetic images with ``strategy="cpu_swap"``
under each policy and print what the plan did, side by side with plain training.

Runs on CPU in about 40 seconds (2 cores); on a CUDA machine pass ``--accelerator gpu``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import warnings
import time

import lightning as L
import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader
from torchvision import transforms

import lightning_swap
from lightning_swap import CPUSwapStrategy
from lightning_swap.core import DeviceMemoryMeter, format_bytes
from lightning_swap.core import tensors_in


class ResNetClassifier(L.LightningModule):
    def __init__(self, arch: str, classes: int, batch_size: int, image_size: int, samples: int) -> None:
        super().__init__()
        self.model = getattr(torchvision.models, arch)(num_classes=classes)
        self.batch_size = batch_size
        self.image_size = image_size
        self.samples = samples
        self.classes = classes

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        data = torchvision.datasets.FakeData(
            size=self.samples,
            image_size=(3, self.image_size, self.image_size),
            num_classes=self.classes,
            transform=transforms.ToTensor(),
            random_offset=0,
        )
        return DataLoader(data, batch_size=self.batch_size, shuffle=False, num_workers=0)


class StepTimer(L.Callback):
    """Wall time of each training batch after the first three (warm-up: ``policy="auto"``
    observes the first step, plans at the second and checks the plan at the third)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= 3:
            self.times.append(time.perf_counter() - self._start)


class PlainMeter(L.Callback):
    """The same device meter around each of plain training's steps (forward, backward and the
    optimizer step, as the strategy measures its own), for comparison."""

    def __init__(self, device: str) -> None:
        self.peak_bytes = 0
        self._meter = None
        self._device = device

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._meter = DeviceMemoryMeter(pl_module.device).__enter__()
        state = [o.state for o in trainer.optimizers]
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self._meter.track([*pl_module.parameters(), *pl_module.buffers(), *grads, *tensors_in([batch, state])])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            if batch_idx >= 1:  # the steady state: the optimizer state exists
                self.peak_bytes = max(self.peak_bytes, self._meter.peak_bytes)
            self._meter = None


def run(args, policy, budget_bytes=None, report_dir=None):
    L.seed_everything(0, verbose=False)
    module = ResNetClassifier(args.arch, 10, args.batch_size, args.image_size, args.batch_size * args.steps)
    timer = StepTimer()
    meter = PlainMeter(args.accelerator)
    strategy = (
        CPUSwapStrategy(
            policy=policy, min_offload_bytes=args.min_offload_bytes, budget_bytes=budget_bytes, report=report_dir is not None
        )
        if policy
        else "auto"
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer] if policy else [timer, meter],
        default_root_dir=report_dir,
    )
    trainer.fit(module)
    step_ms = [1e3 * t for t in timer.times]
    if policy:  # the steady state: every step after the first
        peak = max(s.peak_device_bytes for s in trainer.strategy.stats_history[1:] or trainer.strategy.stats_history)
    else:
        peak = meter.peak_bytes
    stats = trainer.strategy.step_stats if policy else None
    weights = torch.cat([p.detach().flatten().cpu() for p in module.parameters()])
    return step_ms, peak, stats, weights, trainer.strategy


def _repeated(args, policy, budget_bytes=None, report_dir=None):
    """``run`` ``args.repeats`` times: every timed step of every run, the rest of the last run."""
    times = []
    for _ in range(max(args.repeats, 1)):
        step_ms, *rest = run(args, policy, budget_bytes, report_dir)
        times += step_ms
    return (times, *rest)


def _spread(times: list[float]) -> float:
    """Half the range of ``times``, in percent of their median."""
    return 50 * (max(times) - min(times)) / statistics.median(times) if len(times) > 1 else 0.0


def _ms(times: list[float]) -> str:
    return f"{statistics.median(times):.0f} +-{_spread(times):.0f}%" if times else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--min-offload-bytes", type=int, default=1 << 14)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--budget-fraction", type=float, default=0.85, help="auto's budget, a fraction of plain's peak")
    parser.add_argument("--report-dir", default="swap_demo_output", help="where the memory timeline PNG goes")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration (step times: their median and spread)")
    args = parser.parse_args()
    # Quiet: Lightning's banners and tips, and the plans the strategy logs through Lightning's
    # logger (the one plan that matters is printed below); warnings from its internals.
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning", "lightning_swap"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    torch.set_num_threads(max(torch.get_num_threads(), 1))

    print(f"lightning-swap {lightning_swap.__version__}, torch {torch.__version__}, device {args.accelerator}")
    print(f"{args.arch}, FakeData {args.image_size}x{args.image_size}, batch {args.batch_size}, {args.steps} steps\n")
    plain_ms, plain_peak, _, plain_weights, _ = _repeated(args, None)
    spreads = [_spread(plain_ms)]
    rows = [("plain (strategy='auto')", format_bytes(plain_peak), _ms(plain_ms), "1.00", "-", "-", "-")]
    budget = int(args.budget_fraction * plain_peak)
    runs = [(p, p, None) for p in ("keep", "offload", "recompute", "selective", "recompute_offload")]
    runs.append((f"auto, budget {args.budget_fraction:.0%} of plain", "auto", budget))
    auto_strategy = None
    for label, policy, budget_bytes in runs:
        step_ms, peak, stats, weights, strategy = _repeated(args, policy, budget_bytes, args.report_dir if budget_bytes else None)
        spreads.append(_spread(step_ms))
        if budget_bytes:
            auto_strategy = strategy
        same = torch.equal(weights, plain_weights)
        recompute = "-" if stats.recompute_ms is None else f"{stats.recompute_ms:.1f}"
        rows.append((f"cpu_swap policy={label}", format_bytes(peak), _ms(step_ms), f"{peak / plain_peak:.2f}",
                     format_bytes(stats.offloaded_bytes), recompute, "yes" if same else "NO"))
    header = ("run", "peak device", "step ms", "peak/plain", "offloaded", "recompute ms", "weights = plain")
    table = [header] + rows
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    over = f"{args.repeats} runs of each" if args.repeats > 1 else "one run of each"
    print(
        "\npeak device = most bytes alive on the training device during a steady-state step, its"
        "\noptimizer step included (on CPU: a tracker of live tensor storages that does not count the"
        "\noffload host pool); exact, the same from run to run. step ms = median wall time per batch"
        f"\nafter the first three ({over}), +- half its range: on this machine the timed steps of one"
        f"\nconfiguration spread by up to +-{max(spreads):.0f}%, so differences in step ms below that are"
        "\nnoise (and auto's plan, which weighs measured times, may differ between runs). Every row"
        "\ntrains the same weights as plain training."
    )
    plan = auto_strategy.plan
    print(f"\nThe auto plan for a budget of {format_bytes(budget)} ({args.budget_fraction:.0%} of plain):\n{plan.render()}")
    if auto_strategy.report_path is not None:
        print(f"\nMemory over one steady step under the auto plan, with its budget: {auto_strategy.report_path}")


if __name__ == "__main__":
    main()
