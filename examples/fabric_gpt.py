"""A LitGPT-style pretraining loop in Lightning Fabric, with ``strategy="cpu_swap"``.

The model is written the way LitGPT writes its GPT (``transformer.wte`` / ``transformer.h`` /
``transformer.ln_f``, RMSNorm, rotary position embeddings, a LLaMA MLP), small, on random tokens;
the loop is LitGPT's ``pretrain`` loop in miniature (``fabric.setup``, ``fabric.backward``,
gradient clipping, AdamW). The one line that differs from plain Fabric is the strategy::

    fabric = Fabric(strategy=CPUSwapFabricStrategy(policy="auto", budget_bytes=budget))  # or strategy="cpu_swap"

On CPU the budget is the simulated device capacity: by default 70% of the plain step's peak, as
``lightning_swap.profile`` predicts it on fake tensors (no arithmetic), so ``auto`` has to offload
or recompute something. Prints the plan and what each step did::

    python examples/fabric_gpt.py                      # about 10 s on 2 CPU cores
    python examples/fabric_gpt.py --policy offload     # one action for every block
    python examples/fabric_gpt.py --accelerator cuda --budget 20GiB --layers 12 --dim 768
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Optional

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.nn import functional as F

import lightning_swap
from lightning_swap.core import format_bytes
from lightning_swap.fabric import CPUSwapFabricStrategy


@dataclass
class Config:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cache(config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    head = config.n_embd // config.n_head
    theta = 1.0 / (10000 ** (torch.arange(0, head, 2).float() / head))
    angles = torch.outer(torch.arange(config.block_size).float(), theta).repeat(1, 2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, time, embd = x.shape
        heads = self.attn(x).view(batch, time, 3, self.n_head, embd // self.n_head).permute(2, 0, 3, 1, 4)
        q, k, v = apply_rope(heads[0], cos, sin), apply_rope(heads[1], cos, sin), heads[2]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, embd))


class LLaMAMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        hidden = 4 * config.n_embd
        self.fc_1 = nn.Linear(config.n_embd, hidden, bias=False)
        self.fc_2 = nn.Linear(config.n_embd, hidden, bias=False)
        self.proj = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.norm_1, self.attn = RMSNorm(config.n_embd), CausalSelfAttention(config)
        self.norm_2, self.mlp = RMSNorm(config.n_embd), LLaMAMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), cos, sin)
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    """LitGPT's layout; its ``h`` blocks are the segments the planner finds by itself."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=RMSNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        cos, sin = rope_cache(config)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        time = idx.size(1)
        cos, sin = self.cos[:time], self.sin[:time]
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        return self.lm_head(self.transformer.ln_f(x))


def random_batches(config: Config, batch_size: int, steps: int, device: torch.device):
    """Random tokens; targets are the inputs shifted by one, as in LitGPT's pretraining."""
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=g)
        yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def plain_peak(config: Config, batch_size: int) -> int:
    """A plain step's peak bytes, predicted on fake tensors (nothing is computed; the optimizer
    state, made by the first step, left out)."""
    idx, targets = next(random_batches(config, batch_size, 1, torch.device("cpu")))
    step_fn = lambda model, batch: loss_fn(model(batch[0]), batch[1])  # noqa: E731
    return lightning_swap.profile(GPT(config), (idx, targets), step_fn=step_fn, fake=True, scale=False).peak_bytes


def train(args: argparse.Namespace, config: Config, budget: Optional[int]) -> CPUSwapFabricStrategy:
    strategy = CPUSwapFabricStrategy(policy=args.policy, budget_bytes=budget, log_plan=False)
    fabric = Fabric(accelerator=args.accelerator, devices=1, strategy=strategy, precision="32-true")
    fabric.launch()
    fabric.seed_everything(42, verbose=False)
    with fabric.init_module():
        model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(model, optimizer)
    for step, (idx, targets) in enumerate(random_batches(config, args.batch_size, args.steps, fabric.device)):
        loss = loss_fn(model(idx), targets)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        stats = strategy.step_stats  # on CUDA: the newest step the device has finished
        if stats is not None:
            print(
                f"step {step}: loss {loss.item():.3f}, peak {format_bytes(stats.peak_device_bytes)}, "
                f"offloaded {format_bytes(stats.offloaded_bytes)}, recomputed for {stats.recompute_ms or 0:.1f} ms"
            )
    strategy.teardown()  # hooks and wrappers off the model; the plan and the statistics stay
    return strategy


def main(argv: Optional[list[str]] = None) -> CPUSwapFabricStrategy:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="auto", help="auto, keep, offload, recompute, selective, recompute_offload")
    parser.add_argument("--budget", default=None, help="device budget, e.g. 20GiB (default: --budget-fraction of plain's peak)")
    parser.add_argument("--budget-fraction", type=float, default=0.7)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)
    config = Config(block_size=args.seq, n_layer=args.layers, n_embd=args.dim)
    budget = args.budget
    if budget is None and args.accelerator == "cpu":
        plain = plain_peak(config, args.batch_size)
        budget = int(args.budget_fraction * plain)
        print(f"a plain step peaks at {format_bytes(plain)} (predicted on fake tensors); budget {args.budget_fraction:.0%} of it")
    strategy = train(args, config, budget)
    plan = strategy.plan
    print(f"policy {args.policy!r}, budget {format_bytes(strategy.swap_session.budget_bytes())}: plan ({plan.summary()})")
    print(plan.render())
    peaks = [s.peak_device_bytes for s in strategy.stats_history]
    print(f"{len(peaks)} steps, highest peak {format_bytes(max(peaks))}")
    return strategy


if __name__ == "__main__":
    main()
