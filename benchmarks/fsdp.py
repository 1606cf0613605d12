"""FSDP2 on 2 processes, side by side: plain, with ``torch.utils.checkpoint`` on every block, under
the library's lowest-memory plan (the one ``auto`` guards with), and with ``policy="auto"`` under a
per-rank budget — each rank's peak and step time, their ratios to plain, and ``auto``'s step time
over the lowest-memory plan's.

    python benchmarks/fsdp.py              # a 6-block GPT, width 256, 256 tokens, batch 8 per rank (CPU, ~1 min)
    python benchmarks/fsdp.py --smoke      # tiny sizes (the suite's smoke test)
    python benchmarks/fsdp.py --budget-fraction 0.25   # auto's budget nearer checkpointing's peak

Every method is the same training loop (AdamW) on a GPT whose blocks, then the whole model,
are ``fully_shard``-ed (FSDP2, gloo on the CPU, NCCL on CUDA), each rank on its own half of the
batch. Peak memory is each rank's, from the library's ``DeviceMemoryMeter`` around every step
(the CPU's live-storage tracker, or the CUDA allocator's peak), the same for every method
(plain and checkpointing run under an all-``keep`` runtime that only meters, the lowest-memory
plan under its own runtime: ``Plan.lowest_memory`` with ``auto``'s guard action); step time is the
median wall time of ``steps`` steps after a warm-up that lasts until the step time (the slower
rank's) is steady, every one metered (the CPU meter slows every op alike); AdamW at learning rate
0, so every method is timed on the seeded weights, and denormals flushed on CPU unless
``--keep-denormals`` (Note [Every method at the same steady state] in ``common.py``). ``auto`` runs its own decisions in those steps (Note [Auto learns from the steps it runs]):
its per-rank budget lies ``--budget-fraction`` of the way from checkpointing's peak to plain's
(the largest over the ranks of each), so it has more memory than checkpointing and less than
plain needs. Under FSDP ``auto`` plans a mix from its first step, traced on both ranks (Note
[Sharded steps are traced on every rank] in ``core/sharded.py``), so its steps should be faster
than the lowest-memory plan's: the last line says by how much.
Measured numbers, on the machine it runs on; RESULTS.md says which.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: examples/, lightning_swap

from common import STEADY, denormals_flushed, denormals_line, keep_denormals_arg  # noqa: E402
from examples.models import GPT  # noqa: E402
from lightning_swap.core import Action, Collectives, Plan, SwapConfig, SwapRuntime, SwapSession, find_segments  # noqa: E402

METHODS = ("plain FSDP2", "FSDP2 + checkpoint", "FSDP2 + lowest-memory", "FSDP2 + auto")
SIZES = {
    "default": dict(vocab=512, dim=256, heads=4, layers=6, seq=256, batch=8, steps=5, rule="full"),
    "smoke": dict(vocab=64, dim=32, heads=2, layers=3, seq=16, batch=2, steps=2, rule="smoke"),
}


def _model(size: dict, checkpointed: bool) -> torch.nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(vocab=size["vocab"], dim=size["dim"], heads=size["heads"], layers=size["layers"], seq=size["seq"])
    for i, block in enumerate(model.blocks):
        if checkpointed:  # torchtitan's order: checkpoint each block, then shard it
            block = model.blocks[i] = checkpoint_wrapper(block)
        fully_shard(block)
    fully_shard(model)
    return model


def _collectives() -> Collectives:
    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def reduce(value: float, op) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return float(t.item())

    def gather(obj):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    return Collectives(
        is_main=dist.get_rank() == 0, broadcast=broadcast, reduce_max=lambda v: reduce(v, dist.ReduceOp.MAX),
        reduce_min=lambda v: int(reduce(v, dist.ReduceOp.MIN)), gather=gather,
    )


def _batch(size: dict, rank: int):
    g = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _loss(model, batch):
    logits = model(batch[0])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def _steady(step, size: dict) -> tuple[list, list[float], int]:
    """``step()`` (it returns the step's peak) until the slower rank's step times are steady by the
    benchmarks' rule, then ``size["steps"]`` timed steps: (every peak, the timed ms, warm-up steps).
    Every rank judges the same (the largest) times, so all run the same steps."""
    rule, peaks, warm, times = STEADY[size["rule"]], [], [], []
    while len(times) < size["steps"]:
        start = time.perf_counter()
        peaks.append(step())
        ms = _largest((time.perf_counter() - start) * 1e3)
        (times if rule.done(warm) else warm).append(ms)
    return peaks, times, len(warm)


def _run_metered(size: dict, checkpointed: bool, rank: int, *, lowest: bool = False) -> tuple[list[int], list[float], int]:
    """Plain training (or every block checkpointed) under an all-keep runtime that only meters;
    ``lowest``: under the lowest-memory plan (``auto``'s guard steps' plan)."""
    model = _model(size, checkpointed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # the same weights for every method
    batch = _batch(size, rank)
    segments = find_segments(model)
    plan = Plan.lowest_memory(segments, action=Action.OFFLOAD) if lowest else {n: Action.KEEP for n in segments}
    with SwapRuntime(model, plan, device="cpu") as runtime:

        def step() -> int:
            runtime.begin_step([batch, optimizer.state])
            _loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return runtime.end_step().peak_device_bytes

        return _steady(step, size)


def _run_auto(size: dict, budget: int, rank: int) -> tuple[list[int], list[float], int, str]:
    model = _model(size, False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # the same weights for every method
    batch = _batch(size, rank)
    config = SwapConfig(policy="auto", budget_bytes=budget)
    session = SwapSession(model, config, "cpu", collectives=_collectives())

    def step():
        session.open_step(batch, [batch, optimizer.state], [optimizer])
        loss = _loss(model, batch)
        with session.backward():
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        session.close_step()
        newest = session.records.newest()
        return newest.peak_device_bytes if newest is not None else None

    peaks, times, warm = _steady(step, size)
    plan = session.plan.summary() if session.plan is not None else "-"
    session.close()
    return peaks, times, warm, plan


def _largest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rank(rank: int, port: int, size: dict, fraction: float, flush: bool, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = {}
    try:
        with denormals_flushed(flush):
            for name, checkpointed, lowest in ((METHODS[0], False, False), (METHODS[1], True, False), (METHODS[2], False, True)):
                peaks, times, warm = _run_metered(size, checkpointed, rank, lowest=lowest)
                rows[name] = (max(peaks), statistics.median(times), warm, "")
            plain, checkpointed = _largest(rows[METHODS[0]][0]), _largest(rows[METHODS[1]][0])
            budget = int(checkpointed + fraction * (plain - checkpointed))
            peaks, times, warm, plan = _run_auto(size, budget, rank)
        rows[METHODS[3]] = (max(p for p in peaks if p is not None), statistics.median(times), warm, plan)
        results[rank] = (rows, budget)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument(
        "--budget-fraction", type=float, default=0.5,
        help="auto's per-rank budget: this far from checkpointing's peak (0) to plain's (1), the largest over the ranks",
    )
    keep_denormals_arg(parser)
    args = parser.parse_args()
    size = SIZES["smoke" if args.smoke else "default"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(_free_port(), size, args.budget_fraction, not args.keep_denormals, results), nprocs=2)
    budget = results[0][1]
    print(
        f"FSDP2, 2 CPU processes (gloo); GPT: {size['layers']} blocks, width {size['dim']}, {size['seq']} tokens, "
        f"vocab {size['vocab']}, batch {size['batch']} per rank; AdamW at lr 0 (the same weights for every method); "
        f"{denormals_line(torch.device('cpu'), args.keep_denormals)}; {time.strftime('%Y-%m-%d')}, torch {torch.__version__}. "
        f"Measured on this machine (the CPU live-storage meter, every step metered; step time the median of {size['steps']} steps "
        f"after a {STEADY[size['rule']].describe()}, judged on the slower rank's times)."
    )
    warm = ", ".join(f"{name} {results[0][0][name][2]}" for name in METHODS)
    print(
        f"auto's budget: {budget / 2**20:.2f} MiB per rank ({args.budget_fraction:.0%} of the way from checkpointing's "
        f"largest per-rank peak to plain's); warm-up steps: {warm}\n"
    )
    header = f"{'method':<21} | rank | peak MiB | x plain peak | step ms | x plain time | plan"
    print(header)
    print("-" * len(header))
    for rank in (0, 1):
        rows = results[rank][0]
        plain_peak, plain_ms, _, _ = rows[METHODS[0]]
        for name in METHODS:
            peak, ms, _, plan = rows[name]
            print(f"{name:<21} | {rank:>4} | {peak / 2**20:>8.2f} | {peak / plain_peak:>12.2f} | {ms:>7.1f} | {ms / plain_ms:>12.2f} | {plan}")
    ratios = ", ".join(f"rank {r} {results[r][0][METHODS[3]][1] / results[r][0][METHODS[2]][1]:.3f}x" for r in (0, 1))
    print(f"\nauto's step time over the lowest-memory plan's (medians, each rank's own): {ratios}")

if __name__ == "__main__":
    main()
