"""A Fabric loop on 2 CPU processes (gloo): plain, then the swap strategy under each forced policy
and under ``policy="auto"`` at a budget between the lowest-memory forced plan's peak and plain's
(agreed by both ranks). ``--kind ddp``: the test CNN under ``"ddp"`` / ``DDPCPUSwapFabricStrategy``;
``--kind fsdp2``: the test GPT, each block and the whole model ``fully_shard``-ed, under
``ModelParallelStrategy`` / ``ModelParallelCPUSwapFabricStrategy``. Each rank saves its full
states, plans and its own meter's peaks to ``--out.rank<r>``. Asserts nothing:
``tests/adapters/test_fabric.py`` compares.

Run as a script: Fabric's launcher starts the second rank by re-running this file.
"""

import argparse
import os
import sys

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from lightning_swap.core import DeviceMemoryMeter, measure_bandwidth  # noqa: E402
from lightning_swap.fabric import DDPCPUSwapFabricStrategy, ModelParallelCPUSwapFabricStrategy  # noqa: E402
from tests.helpers import POLICIES  # noqa: E402
from tests.models import CNN, TinyGPT, _tokens, lm_loss  # noqa: E402


def images(step: int, rank: int):
    """Each rank its own images (data parallel)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)


def parallelize(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


#: kind -> (plain strategy, swap strategy for options, model, batch of (step, rank), loss, forced policies)
KINDS = {
    "ddp": (lambda: "ddp", lambda **o: DDPCPUSwapFabricStrategy(**o), CNN, images, F.cross_entropy, POLICIES),
    # a segment that holds FSDP units of its own is never selective (Note [Selective around FSDP hooks])
    "fsdp2": (
        lambda: ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1),
        lambda **o: ModelParallelCPUSwapFabricStrategy(parallelize, **o),
        TinyGPT, lambda step, rank: _tokens(4 + rank, seq=16), lm_loss, [p for p in POLICIES if p != "selective"],
    ),
}


def train(kind: str, strategy, steps: int):
    """SGD+momentum steps; the user's model, its full state, the strategy, and each whole step's
    peak as this rank's own meter saw it."""
    _, _, build, batch, loss_fn, _ = KINDS[kind]
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = build()
    wrapped = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    torch.manual_seed(1 + fabric.global_rank)  # dropout masks
    peaks = []
    for step in range(steps):
        x, y = batch(step, fabric.global_rank)
        with DeviceMemoryMeter("cpu") as meter:
            alive = [*model.parameters(), *model.buffers(), *(t for s in optimizer.state.values() for t in s.values())]
            meter.track([x, y, *(getattr(t, "_local_tensor", t) for t in alive)])  # a shard's own storage
            fabric.backward(loss_fn(wrapped(x), y))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peaks.append(meter.peak_bytes)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in model.state_dict().items()}
    return fabric, model, state, peaks


def close(strategy) -> None:
    if isinstance(strategy, ModelParallelStrategy):
        strategy.swap_session.close()  # Fabric's own teardown() raises in Lightning 2.6 (its checkpoint_io)
    else:
        strategy.teardown()


def trace(model) -> tuple:
    """What is installed on the model: forward hooks (FSDP2 has its own), patched forwards, saved-tensor hooks."""
    return (
        sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()),
        [name for name, m in model.named_modules() if "forward" in m.__dict__],
        torch._C._autograd._top_saved_tensors_default_hooks(False) is None,
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--kind", choices=sorted(KINDS), default="ddp")
    args = parser.parse_args()
    plain, swap, *_, policies = KINDS[args.kind]
    results, peaks = {}, {}
    for run in ["plain", *policies]:
        strategy = plain() if run == "plain" else swap(policy=run, min_offload_bytes=0, log_plan=False)
        fabric, model, results[run], peaks[run] = train(args.kind, strategy, steps=3)
        results[run + ":trace"] = trace(model)
        if run != "plain":
            results[run + ":plan"] = [a.value for a in strategy.plan.actions.values()]
            close(strategy)
    least = min(max(peaks[p]) for p in policies if p != "keep")
    budget = (least + max(peaks["plain"])) // 2
    budget = int(fabric.all_reduce(torch.tensor(budget, dtype=torch.float64), reduce_op="min").item())
    measure_bandwidth("cpu")  # the probe's 64 MiB, outside every step (issue 32, item 3)
    strategy = swap(budget_bytes=budget, min_offload_bytes=0, log_plan=False)
    fabric, model, results["auto"], results["auto:peaks"] = train(args.kind, strategy, steps=3)
    results["auto:plan"] = [a.value for a in strategy.plan.actions.values()]
    results["auto:budget"] = budget
    close(strategy)
    results["auto:trace"] = trace(model)
    results["world"] = fabric.world_size
    results["policies"] = policies
    torch.save(results, f"{args.out}.rank{fabric.global_rank}")


if __name__ == "__main__":
    main()
