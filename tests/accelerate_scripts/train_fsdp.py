"""Run under ``accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2`` by
tests/adapters/test_accelerate_fsdp.py: train the test GPT with Accelerate's FSDP2 (each block its own
unit), plain and with the swap plugin (switched on by the launching environment, then by each
policy in turn, then ``auto``), then with its FSDP1 (plain and two policies), and save what each
run produced for the test to compare.

Usage: accelerate launch --use_fsdp [...] train_fsdp.py OUT_DIR

Note [Accelerate's FSDP on the CPU]: Accelerate 1.15 turns ``--use_fsdp`` into
``DistributedType.FSDP`` only on accelerators (MULTI_GPU and its kin); on the CPU it trains
plain data parallel (MULTI_CPU, a DDP wrapper) and ignores the plugin. This script sets the
distributed type back to FSDP after building each accelerator (the state Accelerate keeps in
two shared places, ``PartialState`` and ``AcceleratorState``), so that Accelerate's own FSDP2
preparation (``fully_shard`` per block, the optimizer re-pointed at the shards) runs on the
CPU with gloo, as it does on GPUs. For FSDP1 two more things: the plugin is built with
``sync_module_states=False`` (with it on, the plugin looks for an accelerator and raises "There
are currently no available devices found") and the device is ``cpu`` rather than Accelerate's
``cpu:0`` (FSDP1 refuses a ``device_id`` that differs from its compute device); then
Accelerate's FSDP1 wrapping runs on the CPU too.

Writes OUT_DIR/<run>.rank<r>.pt (the full state dict) and OUT_DIR/report.rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests`

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, set_seed  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from accelerate_swap import SwapAccelerator  # noqa: E402
from tests.models import MODELS, TinyGPT  # noqa: E402

STEPS = 4
BATCH = 4
POLICIES = ["keep", "offload", "recompute", "recompute_offload"]


def accelerator(cls: type, version: int = 2) -> Accelerator:
    """``cls`` with the FSDP plugin ``accelerate launch --use_fsdp`` configured (from the
    environment; ``version=1``: FSDP1, each block a unit), on the CPU (Note [Accelerate's FSDP
    on the CPU])."""
    if version == 2:
        plugin = FullyShardedDataParallelPlugin()
    else:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=1, sync_module_states=False, cpu_ram_efficient_loading=False,
            auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"],
        )
    acc = cls(cpu=True, fsdp_plugin=plugin)
    PartialState().distributed_type = acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    if version == 1:
        PartialState().device = acc.state.device = torch.device("cpu")
    return acc


def train(acc: Accelerator, out: Path, run: str) -> dict:
    set_seed(0)  # model init and dropout masks: the same in every run
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = MODELS["gpt"][1](BATCH * STEPS * acc.num_processes)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    peaks = []
    for xb, yb in loader:
        loss = MODELS["gpt"][2](model(xb), yb)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        stats = getattr(acc, "swap_step_stats", None)
        peaks.append(None if stats is None else stats.peak_device_bytes)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    torch.save({k: v.detach().clone() for k, v in state.items()}, out / f"{run}.rank{acc.process_index}.pt")
    plan = getattr(acc, "swap_plan", None)
    report = {
        "distributed_type": acc.distributed_type.value,
        "wrapper": type(model).__name__,
        "plan": None if plan is None else {k: a.value for k, a in plan.actions.items()},
        "peaks": peaks,
    }
    acc.free_memory()
    return report


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    launched = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_CPU_SWAP")}

    def set_env(values: dict) -> None:
        for key in [k for k in os.environ if k.startswith("ACCELERATE_CPU_SWAP")]:
            del os.environ[key]
        os.environ.update(values)

    reports = {"plain": train(accelerator(Accelerator), out, "plain")}
    reports["launched"] = {**train(accelerator(SwapAccelerator), out, "launched"), "env": launched}
    for policy in POLICIES:
        set_env({"ACCELERATE_CPU_SWAP": "true", "ACCELERATE_CPU_SWAP_POLICY": policy, "ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES": "0"})
        reports[policy] = train(accelerator(SwapAccelerator), out, policy)
    # auto halfway between the lowest-memory plan's peak and plain's, the largest over the ranks
    lowest, plain = (max(reports[p]["peaks"]) for p in ("recompute_offload", "keep"))
    largest = torch.tensor([lowest, plain], dtype=torch.int64)
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
    budget = int(largest.sum()) // 2
    set_env({"ACCELERATE_CPU_SWAP": "true", "ACCELERATE_CPU_SWAP_POLICY": "auto", "ACCELERATE_CPU_SWAP_BUDGET_BYTES": str(budget),
             "ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES": "0"})
    reports["auto"] = {**train(accelerator(SwapAccelerator), out, "auto"), "budget": budget}
    # FSDP1, each block a unit: plain and two policies (the swap flag as in the runs above)
    reports["fsdp1:plain"] = train(accelerator(Accelerator, 1), out, "fsdp1:plain")
    for policy in ("offload", "recompute_offload"):
        set_env({"ACCELERATE_CPU_SWAP": "true", "ACCELERATE_CPU_SWAP_POLICY": policy, "ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES": "0"})
        reports[f"fsdp1:{policy}"] = train(accelerator(SwapAccelerator, 1), out, f"fsdp1:{policy}")
    (out / f"report.rank{PartialState().process_index}.json").write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
