"""cpu_swap under Lightning's sharded strategies, 2 gloo processes on the CPU (issue 21's
Done-when): a GPT with per-block ``fully_shard`` through ``ModelParallelStrategy`` and the test
CNN under ``FSDPStrategy``. One job per model (``tests/scripts/train_fsdp.py``) runs every case;
the tests compare what it saved. Plus, in this process, what needs no second rank: the refused
combinations and ``with_cpu_swap``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, StrategyRegistry

from lightning_swap import DDPCPUSwapStrategy, FSDPCPUSwapStrategy, ModelParallelCPUSwapStrategy, with_cpu_swap

SCRIPT = Path(__file__).parents[1] / "scripts" / "train_fsdp.py"
FORCED = ["keep", "offload", "recompute", "recompute_offload"]
CASES = {"gpt": ["policies", "auto", "stem", "finder", "resume", "core"], "cnn": ["policies", "auto", "finder", "resume"]}
#: The long run: ``LSWAP_LONG=1`` adds the other sharding setting of each model (FSDP2
#: with blocks kept gathered, FSDP1 SHARD_GRAD_OP) under three more policies, about 15 s a model.
#: Read here, beside the ``long`` marker on the test that checks it: the case runs inside the one
#: job per model that every test of this file shares.
LONG = os.environ.get("LSWAP_LONG") == "1"
if LONG:
    CASES = {model: [*cases, "variants"] for model, cases in CASES.items()}


def _job(model: str, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp(f"fsdp_{model}") / f"{model}.pt"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--model", model, "--cases", *CASES[model]],
        cwd=out.parent, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module", params=["gpt", "cnn"])
def job(request, tmp_path_factory):
    return request.param, _job(request.param, tmp_path_factory)


def _different(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.slow
def test_every_policy_equals_plain_fsdp(job):
    """keep / offload / recompute / recompute_offload: the final full state dict of plain FSDP
    training, bit for bit, on both ranks; the plan the same on both."""
    _, ranks = job
    for r in ranks:
        plain = r["plain"]
        assert plain["world"] == 2
        for policy in FORCED:
            assert _different(plain["state"], r[policy]["state"]) == [], policy
            assert set(r[policy]["plan"].values()) == {policy}
            assert r[policy]["plan"] == ranks[0][policy]["plan"]
            assert r[policy]["leftovers"] == plain["leftovers"], policy  # nothing of the library stays on the model
    assert max(ranks[0]["offload"]["peaks"]) < max(ranks[0]["keep"]["peaks"])


@pytest.mark.slow
@pytest.mark.long("the other sharding setting of each model, ~15 s a model")
def test_the_other_sharding_setting_equals_plain_too(job):
    _, ranks = job
    for r in ranks:
        for policy in ("offload", "recompute", "selective"):
            if f"variant:{policy}" in r:  # selective on the GPT only: Note [Selective around FSDP hooks]
                assert _different(r["variant:plain"]["state"], r[f"variant:{policy}"]["state"]) == [], policy


@pytest.mark.slow
def test_auto_keeps_every_step_of_every_rank_within_a_per_rank_budget(job):
    """``auto`` at a per-rank budget between its minimum and plain's per-rank peak: every step of
    both ranks measured within it; both ranks ran the same plan; the weights are plain FSDP's.
    Under FSDP2 (the GPT) the plan is a mix, some blocks kept, made from the first step, traced on
    both ranks (Note [Sharded steps are traced on every rank] in ``core/sharded.py``; that it runs
    faster than the lowest-memory plan is ``benchmarks/fsdp.py``'s to measure)."""
    model, ranks = job
    auto = ranks[0]["auto"]
    assert auto["lowest"] < auto["budget"] < auto["plain_peak"]
    for r in ranks:
        assert r["auto"]["budget"] == auto["budget"]
        assert r["auto"]["plan"] == auto["plan"]
        assert len(r["auto"]["peaks"]) >= 5
        assert max(r["auto"]["peaks"]) <= auto["budget"], r["auto"]["peaks"]
        assert _different(r["auto"]["plain_state"], r["auto"]["state"]) == []  # bit for bit, as plain FSDP
    if model == "gpt":
        actions = set(auto["plan"].values())
        assert "keep" in actions and actions != {"keep"}, auto["plan"]  # a mix


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.99, 0.9, 0.8])
def test_auto_on_a_large_stem_keeps_every_step_of_every_rank_within_the_budget(job, fraction):
    """The stem CNN (``tests/models.py``: its stem saves more than its blocks) under FSDP2 at
    ``fraction`` x plain's per-rank peak: no step of either rank over the budget, one plan on both
    ranks, plain FSDP's weights (single process: ``tests/scale/test_auto_shapes.py``)."""
    model, ranks = job
    if model != "gpt":
        pytest.skip("FSDP2: run in the GPT's job")
    stem = ranks[0]["stem"][fraction]
    assert stem["budget"] == int(fraction * ranks[0]["stem"]["plain_peak"])
    for r in ranks:
        run = r["stem"][fraction]
        assert run["budget"] == stem["budget"] and run["plan"] == stem["plan"]
        assert len(run["peaks"]) == 4 and max(run["peaks"]) <= stem["budget"], (stem["budget"], run["peaks"], run["plan"])
        assert _different(run["plain_state"], run["state"]) == []


@pytest.mark.slow
def test_the_finder_agrees_on_one_batch(job):
    _, ranks = job
    if "finder" not in ranks[0]:
        pytest.skip("the finder under FSDP profiles on every rank: not yet")
    found = [r["finder"] for r in ranks]
    assert found[0]["batch"] == found[1]["batch"] == found[0]["module_batch"] == found[1]["module_batch"]
    assert found[0]["batch"] >= 4  # plain at batch 4 fits the budget
    for f in found:
        assert max(p for p in f["peaks"] if p is not None) <= f["budget"]


@pytest.mark.slow
def test_save_resume_and_two_steps_equal_an_uninterrupted_run(job):
    """Item 5: saved after 2 steps and resumed for 2 more under ``recompute_offload``, the weights
    are plain's after 4 steps uninterrupted; the checkpoint holds the same keys as plain's (no
    hook, stream or buffer of the library)."""
    _, ranks = job
    for r in ranks:
        uninterrupted = r["resume:plain4"]
        assert _different(uninterrupted, r["resume:recompute_offload"]) == []
        assert r["resume:recompute_offload:keys"] == r["resume:plain:keys"]


@pytest.mark.slow
def test_core_predictions_hold_on_every_rank(job):
    """The per-rank memory model (item 3): each uniform plan's peak predicted from a profile of
    a steady step within 5% of the one measured, never under it, on both ranks (plans that
    offload within 10%: their forward's working set without saved tensors is not measured
    under FSDP and is priced as kept, Note [Observe every rank]); each rank holds half the
    parameters; each segment's gathered bytes are one block's parameters."""
    model, ranks = job
    if model != "gpt":
        pytest.skip("the core is checked on the GPT's job")
    for r in ranks:
        core = r["core"]
        assert core["profile"].world_size == 2
        assert core["local_parameter_bytes"] * 2 >= core["parameter_bytes"] > core["local_parameter_bytes"]
        assert [s.gathered_parameter_bytes for s in core["profile"].segments] == [core["block_bytes"]] * 4
        for policy, predicted in core["predicted"].items():
            measured = core["measured"][policy]
            within = 1.10 if "offload" in policy else 1.05
            # never under, but for a few hundred bytes the profile's held trace leaves out (0.005%);
            # measured: the least of two steps (timing alone raises one now and then, train_fsdp.py)
            assert 0.9999 * measured <= predicted <= within * measured, (policy, predicted, measured)


@pytest.mark.slow
def test_recompute_gathers_no_more_than_keep(job):
    """Note [Recompute under FSDP gathers nothing more], counted: per-block units, and two units
    inside each segment."""
    model, ranks = job
    if model != "gpt":
        pytest.skip("counted on the GPT's job")
    for r in ranks:
        gathers = r["core"]["gathers"]
        assert gathers[("blocks", "recompute")] == gathers[("blocks", "keep")] > 0
        assert gathers[("nested", "recompute")] == gathers[("nested", "keep")] > 0


@pytest.mark.slow
def test_ranks_merge_to_their_largest_profile(job):
    model, ranks = job
    if model != "gpt":
        pytest.skip("merged on the GPT's job")
    """Rank 1 trained on twice rank 0's batch: the merged profile is rank 1's where it measured
    more, the same on both ranks."""
    merged = ranks[0]["core"]["merged"]
    assert merged == ranks[1]["core"]["merged"]
    small, large = (r["core"]["profile"] for r in ranks)
    assert large.peak_bytes > small.peak_bytes
    for field in ("static_bytes", "peak_bytes", "step_ms", "batch_size"):
        assert getattr(merged, field) == max(getattr(small, field), getattr(large, field))
    assert [s.saved_bytes for s in merged.segments] == [s.saved_bytes for s in large.segments]


# -- in this process ---------------------------------------------------------------------------
def test_the_strategies_are_registered():
    import lightning_swap  # noqa: F401

    assert {"fsdp_cpu_swap", "model_parallel_cpu_swap"} <= set(StrategyRegistry)
    assert StrategyRegistry["fsdp_cpu_swap"]["strategy"] is FSDPCPUSwapStrategy


@pytest.mark.parametrize("argument", ["activation_checkpointing_policy", "activation_checkpointing"])
def test_lightning_activation_checkpointing_is_refused_beside_a_policy(argument):
    """Note [One activation policy]: refused when built, naming both options."""
    from ..models import ConvBlock

    with pytest.raises(ValueError, match=f"`{argument}` and cpu_swap's `policy`"):
        FSDPCPUSwapStrategy(policy="offload", **{argument: {ConvBlock}})
    with pytest.raises(ValueError, match="`activation_checkpointing_policy` and cpu_swap's `policy`"):
        with_cpu_swap(FSDPStrategy(activation_checkpointing_policy={ConvBlock}), policy="offload")


def test_with_cpu_swap_keeps_the_strategy_settings():
    original = FSDPStrategy(sharding_strategy="SHARD_GRAD_OP", state_dict_type="sharded")
    swapped = with_cpu_swap(original, policy="recompute", budget_bytes="1MiB", log_stats=False)
    assert type(swapped) is FSDPCPUSwapStrategy and type(original) is FSDPStrategy
    assert swapped.sharding_strategy == original.sharding_strategy and swapped._state_dict_type == "sharded"
    assert swapped.swap_config.policy.value == "recompute" and swapped.swap_config.budget_bytes == 1 << 20
    assert swapped.log_stats is False and swapped.plan is None
    mp = with_cpu_swap(ModelParallelStrategy(data_parallel_size=2, save_distributed_checkpoint=False))
    assert type(mp) is ModelParallelCPUSwapStrategy and mp._tensor_parallel_size == 1 and not mp._save_distributed_checkpoint
    assert type(with_cpu_swap(DDPStrategy(), policy="offload")) is DDPCPUSwapStrategy


def test_with_cpu_swap_refuses_what_it_cannot_carry():
    with pytest.raises(ValueError, match="unknown cpu_swap options \\['polcy'\\]"):
        with_cpu_swap(FSDPStrategy(), polcy="offload")
    with pytest.raises(ValueError, match="`strategy` must be one of"):
        with_cpu_swap(type("Mine", (FSDPStrategy,), {})())


def test_an_empty_optimizer_state_loads_as_empty(tmp_path):
    """Note [An optimizer state saved before the first step]: a full checkpoint whose optimizer
    states are empty empties the optimizers (Lightning's loader raised IndexError on it); others
    load untouched; Lightning's loader is its own again afterwards."""
    import lightning.pytorch.strategies.fsdp as lightning_fsdp

    from lightning_swap.fsdp import _empty_optimizer_states_loaded

    original = lightning_fsdp._lazy_load
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(2)
    optimizer.step()
    assert optimizer.state
    empty, full = tmp_path / "empty.ckpt", tmp_path / "full.ckpt"
    torch.save({"state_dict": {}, "optimizer_states": [{"state": {}, "param_groups": []}]}, empty)
    torch.save({"state_dict": {}, "optimizer_states": [optimizer.state_dict()]}, full)
    with _empty_optimizer_states_loaded([optimizer], lightning_fsdp):
        assert "optimizer_states" in lightning_fsdp._lazy_load(full) and optimizer.state
        assert "optimizer_states" not in lightning_fsdp._lazy_load(empty)
    assert not optimizer.state
    assert lightning_fsdp._lazy_load is original


def test_model_parallel_swap_shards_over_every_process_and_refuses_tensor_parallelism(monkeypatch):
    """By default FSDP2 over every process (Lightning's own default would make them a
    tensor-parallel group); a tensor-parallel dimension is refused once the mesh exists."""
    from types import SimpleNamespace

    from lightning_swap.strategy_base import _SwapStrategyMixin

    def mesh_from_sizes(self):  # Lightning's setup_environment, reduced to the mesh it builds
        self._device_mesh = {"tensor_parallel": SimpleNamespace(size=lambda: self._tensor_parallel_size)}

    monkeypatch.setattr(_SwapStrategyMixin, "setup_environment", mesh_from_sizes)
    strategy = ModelParallelCPUSwapStrategy(policy="keep")
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.setup_environment()
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (2, 1)
    strategy = ModelParallelCPUSwapStrategy(policy="keep", data_parallel_size=1, tensor_parallel_size=2)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*allowed tensor_parallel_size=1"):
        strategy.setup_environment()
