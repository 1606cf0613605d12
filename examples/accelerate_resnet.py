"""A plain Accelerate training loop on a torchvision ResNet, with the swap plugin switched on
from the command line and nothing in the loop about it but the class name:

    ACCELERATE_CPU_SWAP=true ACCELERATE_CPU_SWAP_POLICY=offload accelerate launch examples/accelerate_resnet.py

With ``ACCELERATE_CPU_SWAP`` unset (or false) the same script is plain Accelerate. On a
machine without a GPU add ``--cpu`` to ``accelerate launch``; the defaults below (ResNet-18,
FakeData 64x64, batch 16, 5 steps) take a few seconds per step on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision
from torch.nn import functional as F
from torch.utils.data import DataLoader
from torchvision import transforms

from accelerate_swap import SwapAccelerator
from lightning_swap.core import format_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18", help="a torchvision.models builder (default: resnet18)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--classes", type=int, default=10)
    args = parser.parse_args()

    accelerator = SwapAccelerator()  # reads ACCELERATE_CPU_SWAP*; exactly Accelerator when off
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.arch)(num_classes=args.classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torchvision.datasets.FakeData(
        size=args.batch_size * args.steps * accelerator.num_processes,
        image_size=(3, args.image_size, args.image_size),
        num_classes=args.classes,
        transform=transforms.ToTensor(),
    )
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    if accelerator.swap_enabled:
        plugin = accelerator.swap_plugin
        budget = format_bytes(plugin.budget_bytes) if plugin.budget_bytes is not None else "none given"
        accelerator.print(f"swap plugin on: policy {plugin.policy!r}, budget {budget}")
    else:
        accelerator.print("swap plugin off (set ACCELERATE_CPU_SWAP=true to switch it on)")

    model.train()
    shown = None
    for step, (images, labels) in enumerate(loader):
        start = time.perf_counter()
        loss = F.cross_entropy(model(images), labels)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        line = f"step {step}: loss {loss.item():.4f}, {1e3 * (time.perf_counter() - start):.0f} ms"
        stats = accelerator.swap_step_stats
        if stats is not None:
            # Device times are None until the device has finished the step (on CUDA, a step or two later).
            line += (
                f", peak device {format_bytes(stats.peak_device_bytes)}, offloaded {format_bytes(stats.offloaded_bytes)}, "
                f"recompute {_ms(stats.recompute_ms)}"
            )
        accelerator.print(line)
        plan = accelerator.swap_plan
        if plan is not None and plan.rows and plan != shown:  # once its rows are known (predicted or measured)
            shown = plan
            accelerator.print(f"swap plan ({plan.summary()}):\n{plan.render()}")
    accelerator.end_training()


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f} ms"


if __name__ == "__main__":
    main()
