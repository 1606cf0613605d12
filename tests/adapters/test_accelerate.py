"""``SwapAccelerator``: under ``accelerate launch`` on 1 and 2 CPU processes, the switch off
is a plain run, and every forced policy (switched on by the environment or in code) and
``policy="auto"`` under a simulated budget give exactly the plain run's weights and buffers; plus the single-process behaviour (what is left
behind, errors) in this process.

Note: ``accelerate launch --cpu --num_processes 2`` starts one process unless ``mpirun`` is
used (Accelerate's simple launcher), so two CPU processes are launched the way torchrun
does it: ``--multi_gpu`` with ``ACCELERATE_USE_CPU=true``, which Accelerate turns into
``MULTI_CPU`` with gloo. The script asserts nothing; it records, and these tests compare.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.nn import functional as F

from accelerate_swap import SwapAccelerator, SwapPlugin
from lightning_swap import Action

from ..helpers import POLICIES, free_port
from ..models import CNN, MODELS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "accelerate_scripts" / "train_cnn.py"
SEGMENTS = [f"blocks.{i}" for i in range(4)]
SWAP_RUNS = ["launched", *POLICIES, "code"]


def _launch(num_processes: int, out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    # One thread per process: 2 cores, and OpenMP spinning under contention is ruinous.
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        ACCELERATE_CPU_SWAP="true",
        ACCELERATE_CPU_SWAP_POLICY="offload",
        ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES="0",
    )
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--num_processes", str(num_processes)]
    cmd += ["--num_cpu_threads_per_process", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if num_processes == 1:
        cmd += ["--cpu"]
    else:
        cmd += ["--multi_gpu", "--main_process_port", str(free_port())]
        env["ACCELERATE_USE_CPU"] = "true"
    cmd += [str(SCRIPT), str(out)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"accelerate launch failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.fixture(scope="module", params=[1, 2], ids=["1proc", "2proc"])
def launched(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"launch{request.param}")
    _launch(request.param, out)
    reports = [json.loads((out / f"report.rank{r}.json").read_text()) for r in range(request.param)]

    def state(run: str, rank: int) -> dict:
        return torch.load(out / f"{run}.rank{rank}.pt")

    return request.param, reports, state


#: BatchNorm running statistics: DDP broadcasts rank 0's before each forward, so after the last
#: one every rank holds the statistics of its own last batch.
_LOCAL_STATS = [f"{m}.{s}" for m in ["stem.1", *(f"blocks.{i}.bn{j}" for i in range(4) for j in (1, 2))] for s in ("running_mean", "running_var")]


def _different(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
def test_launch_processes_and_flag_off_is_plain(launched):
    n, reports, state = launched
    for rank, report in enumerate(reports):
        assert report["plain"]["num_processes"] == n
        assert report["plain"]["distributed_type"] == ("NO" if n == 1 else "MULTI_CPU")
        assert report["plain"]["wrapper"] == ("CNN" if n == 1 else "DistributedDataParallel")
        off = report["off"]
        assert off["plugin"] == "None"  # ACCELERATE_CPU_SWAP=false wins over a policy variable
        assert off["plan"] is None and off["stats"] == [None] * 3 and off["logged"] == []
        assert off["during"] == report["plain"]["during"]
        assert _different(state("off", rank), state("plain", rank)) == []
    if n == 2:  # data parallel really ran: each rank saw other samples, yet the weights agree
        assert _different(state("plain", 0), state("plain", 1)) == _LOCAL_STATS


@pytest.mark.slow
@pytest.mark.parametrize("run", SWAP_RUNS)
def test_launch_each_policy_equals_plain(launched, run):
    n, reports, state = launched
    if run == "launched":  # from the launching environment
        expected = {s: Action.OFFLOAD for s in SEGMENTS}
    elif run == "code":
        expected = {"blocks.0": Action.OFFLOAD, "blocks.1": Action.KEEP, "blocks.2": Action.RECOMPUTE_OFFLOAD, "blocks.3": Action.KEEP}
    else:
        expected = {s: Action.parse(run) for s in SEGMENTS}
    for rank, report in enumerate(reports):
        r = report[run]
        assert r["distributed_type"] == report["plain"]["distributed_type"]
        assert list(r["plan"]) == SEGMENTS  # the user's names, not DDP's `module.` ones
        assert {k: Action(v) for k, v in r["plan"].items()} == expected
        assert _different(state(run, rank), state("plain", rank)) == []
        # installed while training: the step window's pre-hook, one per segment when something is
        # offloaded (where each element begins: Note [Default copy windows]), a forward on each non-KEEP segment
        offloading = any(a.offloads for a in expected.values())
        assert r["during"]["pre_hooks"] == 1 + (len(SEGMENTS) if offloading else 0)
        assert r["during"]["forward_attrs"] == [s for s, a in expected.items() if a is not Action.KEEP]
        assert r["during"]["keys"] == report["plain"]["during"]["keys"]
        # gone afterwards (free_memory, or swap_session.close() for "code")
        assert r["after"] == report["plain"]["after"]
        assert r["eval_opened_window"] is False
        assert len(r["stats"]) == 3 and all(s is not None and s["swap/peak_device_bytes"] > 0 for s in r["stats"])
        if any(a.offloads for a in expected.values()):
            assert all(s["swap/offloaded_bytes"] > 0 for s in r["stats"])
        else:
            assert all(s["swap/offloaded_bytes"] == 0 for s in r["stats"])
        if any(a.recomputes for a in expected.values()):
            assert all(s["swap/recompute_ms"] > 0 for s in r["stats"])
    if run == "code":
        assert reports[0]["code"]["swap_session_after_close"] is False
    if run in POLICIES:  # trackers exist on the main process only
        assert [step for step, _ in reports[0][run]["logged"]] == [1, 2, 3]
        assert "swap/peak_device_bytes" in reports[0][run]["logged"][0][1]
        assert all(report[run]["logged"] == [] for report in reports[1:])
    if n == 2:
        assert _different(state(run, 0), state(run, 1)) == _LOCAL_STATS


@pytest.mark.slow
def test_launch_auto_fits_the_budget_and_equals_plain(launched):
    """policy="auto": every step within the budget on every process, the first included (Note
    [Observe only what fits]); every process runs the main process's plan (Note [Auto policy
    in Accelerate])."""
    n, reports, state = launched
    plans = [report["auto"]["final_plan"] for report in reports]
    assert all(p == plans[0] for p in plans)  # the main process's plan, everywhere
    assert list(plans[0]) == SEGMENTS and set(plans[0].values()) != {"keep"}
    for rank, report in enumerate(reports):
        r = report["auto"]
        assert r["plan"] is None  # nothing planned in prepare
        assert r["budget"] == reports[0]["auto"]["budget"]
        # Note [Observe only what fits]: the first step runs under the lowest-memory plan on
        # every process, measured, within the budget like every later one
        assert r["stats"][0] is not None
        assert all(s["swap/peak_device_bytes"] <= r["budget"] for s in r["stats"] if s is not None)
        assert r["final_predicted_peak"] <= r["budget"]
        assert _different(state("auto", rank), state("plain", rank)) == []
        assert r["after"] == report["plain"]["after"]
    if n == 2:
        assert _different(state("auto", 0), state("auto", 1)) == _LOCAL_STATS


# -- one process, in this process ---------------------------------------------------------
@pytest.fixture
def fresh_state(monkeypatch):
    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _setup(accelerator, *, policy_model=None):
    torch.manual_seed(0)
    model = policy_model or CNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer


def _step(accelerator, model, optimizer, batch=4, use_accelerator=True):
    x, y = MODELS["cnn"][1](batch)
    loss = F.cross_entropy(model(x), y)
    if use_accelerator:
        accelerator.backward(loss)
    else:
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _clean(model) -> bool:
    return (
        not any("forward" in m.__dict__ for m in model.modules())
        and not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
        and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    )


def test_switched_off_is_accelerator(fresh_state):
    accelerator = SwapAccelerator(cpu=True)
    assert accelerator.swap_plugin is None and not accelerator.swap_enabled
    model, optimizer = _setup(accelerator)
    _step(accelerator, model, optimizer)
    assert accelerator.swap_plan is None and accelerator.swap_session is None
    assert accelerator.swap_step_stats is None and _clean(model)


def test_env_switch_in_process(fresh_state, monkeypatch):
    monkeypatch.setenv("ACCELERATE_CPU_SWAP", "1")
    monkeypatch.setenv("ACCELERATE_CPU_SWAP_POLICY", "blocks.1=recompute")
    accelerator = SwapAccelerator(cpu=True)
    model, optimizer = _setup(accelerator)
    assert dict(accelerator.swap_plan.actions) == {s: Action.RECOMPUTE if s == "blocks.1" else Action.KEEP for s in SEGMENTS}
    _step(accelerator, model, optimizer)
    assert accelerator.swap_step_stats.recompute_ms > 0 and accelerator.swap_steps == 1
    accelerator.end_training()
    assert accelerator.swap_session is None and _clean(model)


def test_a_plain_backward_is_seen_and_its_step_closes_at_the_next_forward(fresh_state):
    """Note [Hooked step window]: ``loss.backward()`` instead of the accelerator's is seen by a hook
    on the model's output; the step stays open until the next training forward closes it."""
    accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(policy="offload", min_offload_bytes=0))
    model, optimizer = _setup(accelerator)
    _step(accelerator, model, optimizer, use_accelerator=False)  # loss.backward(): the window stays open
    assert accelerator.swap_session.runtime.measuring and accelerator.swap_step_stats is None
    _step(accelerator, model, optimizer)
    assert not accelerator.swap_session.runtime.measuring
    assert accelerator.swap_step_stats.offloaded_bytes > 0 and accelerator.swap_steps == 2
    accelerator.clear()
    assert accelerator.swap_session is None and accelerator.swap_steps == 0 and _clean(model)


def test_one_model_with_a_plan(fresh_state):
    accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(policy="recompute"))
    model, _ = _setup(accelerator)
    assert accelerator.prepare(model) is model  # preparing it again changes nothing
    assert accelerator.swap_session.model is model
    teacher = accelerator.prepare_model(CNN(), evaluation_mode=True)  # left alone
    assert _clean(teacher)
    with pytest.raises(ValueError, match="free_memory"):
        accelerator.prepare(CNN())
    accelerator.free_memory()
    assert _clean(model)
    other, _ = _setup(accelerator, policy_model=CNN())
    assert accelerator.swap_session.model is other and not _clean(other)
    accelerator.free_memory()


def test_bad_policy_fails_at_prepare_and_leaves_nothing(fresh_state):
    accelerator = SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(policy={"blocks.9": "offload"}))
    model = CNN()
    with pytest.raises(ValueError, match="`policy`.*blocks.9"):
        accelerator.prepare(model)
    assert accelerator.swap_session is None and _clean(model)


def test_bad_arguments(fresh_state):
    with pytest.raises(ValueError, match="`swap_plugin`"):
        SwapAccelerator(cpu=True, swap_plugin={"policy": "offload"})
    with pytest.raises(ValueError, match="dynamo_backend"):
        SwapAccelerator(cpu=True, swap_plugin=SwapPlugin(), dynamo_backend="inductor")
    assert isinstance(SwapAccelerator(cpu=True, dynamo_backend="inductor"), Accelerator)  # off: Accelerate decides


def test_mixed_precision_recompute_equals_plain(fresh_state):
    """Accelerate's autocast wraps the model's forward; recomputation must replay it."""
    results = []
    for accelerator in (
        Accelerator(cpu=True, mixed_precision="bf16"),
        SwapAccelerator(cpu=True, mixed_precision="bf16", swap_plugin=SwapPlugin(policy="recompute_offload", min_offload_bytes=0)),
    ):
        model, optimizer = _setup(accelerator)
        torch.manual_seed(1)
        for batch in (4, 5):
            _step(accelerator, model, optimizer, batch=batch)
        results.append({k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()})
        if isinstance(accelerator, SwapAccelerator):
            assert accelerator.swap_step_stats.recompute_ms > 0 and accelerator.swap_step_stats.offloaded_bytes > 0
        accelerator.free_memory()
    assert _different(*results) == []
