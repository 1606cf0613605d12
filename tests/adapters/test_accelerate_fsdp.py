"""``SwapAccelerator`` under Accelerate's FSDP plugin, launched with ``accelerate launch
--use_fsdp --fsdp_version 2 --num_processes 2`` on the CPU (issue 21 item 2): under FSDP2 the
swap flag from the launching environment and every forced policy give plain FSDP's weights bit
for bit, and ``auto`` at a per-rank budget keeps every step of both ranks within it and trains
as plain; under FSDP1 (the same job) two policies equal plain FSDP1. (How Accelerate is made to
shard on the CPU: Note [Accelerate's FSDP on the CPU] in the script.) Plus, in this process,
the refusal of the plugin's own activation checkpointing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from accelerate_swap import SwapAccelerator

from ..helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "accelerate_scripts" / "train_fsdp.py"
SEGMENTS = [f"blocks.{i}" for i in range(4)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate_fsdp")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(
        OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), ACCELERATE_CPU_SWAP="true", ACCELERATE_CPU_SWAP_POLICY="recompute_offload",
        ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES="0",
    )
    env["ACCELERATE_USE_CPU"] = "true"  # the processes are CPU ones; FSDP is set by the script (its Note)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--num_processes", "2"]
    cmd += ["--num_cpu_threads_per_process", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    cmd += ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"]
    cmd += ["--fsdp_transformer_layer_cls_to_wrap", "Block", "--fsdp_reshard_after_forward", "true", str(SCRIPT), str(out)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"accelerate launch failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    reports = [json.loads((out / f"report.rank{r}.json").read_text()) for r in (0, 1)]
    return reports, lambda run, rank: torch.load(out / f"{run}.rank{rank}.pt")


def _different(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
@pytest.mark.parametrize("run", ["launched", "keep", "offload", "recompute", "recompute_offload"])
def test_the_swap_flag_under_fsdp2_equals_plain_fsdp2(launched, run):
    reports, state = launched
    expected = "recompute_offload" if run == "launched" else run
    for rank, report in enumerate(reports):
        assert report["plain"]["distributed_type"] == report[run]["distributed_type"] == "FSDP"
        assert report[run]["wrapper"] == report["plain"]["wrapper"] == "FSDPTinyGPT"  # sharded in place
        assert report[run]["plan"] == {s: expected for s in SEGMENTS}
        assert _different(state("plain", rank), state(run, rank)) == []
    assert reports[0]["launched"]["env"]["ACCELERATE_CPU_SWAP_POLICY"] == "recompute_offload"


@pytest.mark.slow
def test_auto_under_fsdp2_stays_within_the_per_rank_budget_and_equals_plain(launched):
    reports, state = launched
    budget = reports[0]["auto"]["budget"]
    assert reports[1]["auto"]["budget"] == budget
    assert reports[0]["auto"]["plan"] == reports[1]["auto"]["plan"]
    for rank, report in enumerate(reports):
        peaks = [p for p in report["auto"]["peaks"] if p is not None]
        assert len(peaks) >= 3 and max(peaks) <= budget, peaks
        assert _different(state("plain", rank), state("auto", rank)) == []


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["offload", "recompute_offload"])
def test_the_swap_flag_under_fsdp1_equals_plain_fsdp1(launched, policy):
    reports, state = launched
    for rank, report in enumerate(reports):
        assert report["fsdp1:plain"]["wrapper"] == report[f"fsdp1:{policy}"]["wrapper"] == "FullyShardedDataParallel"
        assert report[f"fsdp1:{policy}"]["plan"] == {s: policy for s in SEGMENTS}  # named through FSDP1's wrappers
        assert _different(state("fsdp1:plain", rank), state(f"fsdp1:{policy}", rank)) == []


def _accelerator_under(fsdp_plugin) -> SwapAccelerator:
    """A SwapAccelerator as it would be under Accelerate's FSDP plugin (its state stubbed)."""
    acc = SwapAccelerator.__new__(SwapAccelerator)
    acc.__dict__["state"] = SimpleNamespace(distributed_type=DistributedType.FSDP, fsdp_plugin=fsdp_plugin)
    return acc


@pytest.mark.parametrize("version", [1, 2])
def test_the_fsdp_plugins_activation_checkpointing_is_refused(version, monkeypatch):
    monkeypatch.setattr(SwapAccelerator, "distributed_type", property(lambda self: self.state.distributed_type))
    with pytest.raises(ValueError, match="activation_checkpointing and the swap plugin's policy"):
        _accelerator_under(SimpleNamespace(fsdp_version=version, activation_checkpointing=True))._check_fsdp()
    _accelerator_under(SimpleNamespace(fsdp_version=version, activation_checkpointing=False))._check_fsdp()
