"""Train under Lightning's sharded strategies on 2 CPU processes (gloo), plain and with cpu_swap,
and save what each run produced for ``tests/adapters/test_fsdp.py`` to compare. One job per model runs
every case, so the suite starts two processes per model, not one pair per case:

- ``--model gpt``: a GPT whose blocks are each ``fully_shard``-ed in ``configure_model``, under
  ``ModelParallelStrategy`` (FSDP2) and ``ModelParallelCPUSwapStrategy``;
- ``--model cnn``: the test CNN under ``FSDPStrategy(auto_wrap_policy={ConvBlock})`` (FSDP1; on
  the CPU through a subclass that tells FSDP1 its device, as ``FSDPCPUSwapStrategy`` does) and
  ``FSDPCPUSwapStrategy``.

Cases: plain and each forced policy (the final full state dict, the plan, every step's peak);
``auto`` at a budget halfway between the lowest-memory plan's peak and plain's (both measured
here, the largest over the ranks); ``stem`` (with ``--model gpt``: under FSDP2): the stem CNN of
``tests/models.py`` under ``auto`` at 0.99, 0.9 and 0.8 x plain's per-rank peak; the batch-size finder; save after 2 steps, resume and train
2 more, against 4 steps uninterrupted; ``core``: the core on these 2 ranks without Lightning
(predictions per rank, all-gathers counted). Each rank writes ``OUT.rank<r>.pt``; the script
asserts nothing.

Run as a script: Lightning's launcher starts the second rank by re-running this file.
"""

import argparse
import os
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import lightning_swap  # noqa: E402,F401  registers the strategies
from lightning_swap import FSDPCPUSwapStrategy, ModelParallelCPUSwapStrategy, SwapBatchSizeFinder  # noqa: E402
from tests.helpers import QUIET_TRAINER  # noqa: E402
from tests.lit import LitModel  # noqa: E402
from tests.models import MODELS, ConvBlock, Stem  # noqa: E402

FORCED = ["keep", "offload", "recompute", "recompute_offload"]
BATCH = 4


class Reseeded(LitModel):
    """``reseed``: dropout masks that depend on the step only, and one batch per rank that every
    step trains on (its own slice, no sampler): a resumed run sees what an uninterrupted one
    does, however Lightning resumes an epoch."""

    def __init__(self, *args, reseed: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reseed = reseed

    def training_step(self, batch, batch_idx):
        if self.reseed:
            torch.manual_seed(self.global_step)
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        if not self.reseed:
            return super().train_dataloader()
        x, y = self._data
        rank = slice(self.global_rank * self.batch_size, (self.global_rank + 1) * self.batch_size)
        return DataLoader(TensorDataset(x[rank], y[rank]), batch_size=self.batch_size, shuffle=False)


class ShardedGPT(Reseeded):
    """The test GPT with every block, then the whole model, ``fully_shard``-ed (FSDP2);
    ``keep_gathered``: the blocks' parameters stay gathered from forward to backward
    (``reshard_after_forward=False``, ZeRO-2's memory)."""

    keep_gathered = False

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=not self.keep_gathered)
        fully_shard(self.model, mesh=mesh)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ShardedStem(ShardedGPT):
    """The stem CNN (``tests/models.py``: its stem saves more than its four blocks) on 32x32
    images, batch 8, each block then the whole model ``fully_shard``-ed (FSDP2)."""

    def __init__(self, samples: int = 32, **kwargs) -> None:
        super().__init__("cnn", batch_size=8, samples=samples, **kwargs)
        torch.manual_seed(0)
        self.model = Stem()
        self._data = MODELS["resnet18"][1](samples)  # 32x32 images, 10 classes


class CPUFSDPStrategy(FSDPStrategy):
    """Plain FSDP1 on the CPU: Lightning's own, told its device (it refuses the CPU otherwise),
    wrapping with the same arguments Lightning's ``_setup_model`` passes (its mixed-precision
    config wraps each BatchNorm as a unit of its own)."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            module=model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy, device_id=self.root_device, **self.kwargs,
        )
        self.kwargs.pop("auto_wrap_policy", None)
        return super()._setup_model(model)


def module_for(model: str, variant: bool = False, **kwargs):
    if model == "stem":
        return ShardedStem(**kwargs)
    module = (ShardedGPT if model == "gpt" else Reseeded)(model, batch_size=BATCH, **kwargs)
    module.keep_gathered = variant
    return module


def strategy_for(model: str, policy, variant: bool = False, **swap):
    """``variant``: the other sharding setting (FSDP2: blocks kept gathered; FSDP1: SHARD_GRAD_OP)."""
    if model != "cnn":  # FSDP2
        if policy is None:
            return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        return ModelParallelCPUSwapStrategy(policy=policy, min_offload_bytes=0, **swap)
    fsdp = dict(auto_wrap_policy={ConvBlock}, sharding_strategy="SHARD_GRAD_OP" if variant else "FULL_SHARD")
    if policy is None:
        return CPUFSDPStrategy(**fsdp)
    return FSDPCPUSwapStrategy(policy=policy, min_offload_bytes=0, **fsdp, **swap)


def fit(model: str, policy, *, steps: int, root: str, samples: int = 32, callbacks=(), ckpt_path=None, reseed=False, variant=False, **swap):
    L.seed_everything(0, verbose=False)
    module = module_for(model, variant, samples=samples, reseed=reseed)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy_for(model, policy, variant, **swap), max_steps=steps, num_sanity_val_steps=0,
        default_root_dir=root, callbacks=list(callbacks), use_distributed_sampler=not reseed, **QUIET_TRAINER,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


def full_state(trainer) -> dict:
    """The whole model's weights and buffers, gathered on every rank (a collective)."""
    state = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().clone() for k, v in state.items()}


def leftovers(module) -> dict:
    """What must be the same after a fit with the library as after one without: instance
    ``forward`` attributes, module hooks, a saved-tensors hook left on."""
    return {
        "forward_attrs": sorted(n for n, m in module.named_modules() if "forward" in m.__dict__),
        "pre_hooks": sum(len(m._forward_pre_hooks) for m in module.modules()),
        "hooks": sum(len(m._forward_hooks) for m in module.modules()),
        "saved_tensors_hooks": torch._C._autograd._top_saved_tensors_default_hooks(False) is not None,
    }


def record(trainer) -> dict:
    strategy = trainer.strategy
    plan = getattr(strategy, "plan", None)
    return {
        "leftovers": leftovers(trainer.lightning_module),
        "state": full_state(trainer),
        "plan": None if plan is None else {k: a.value for k, a in plan.actions.items()},
        "peaks": [s.peak_device_bytes for s in getattr(strategy, "stats_history", [])],
        "world": trainer.world_size,
    }


def largest(value: int) -> int:
    """The largest ``value`` over the ranks (the process group outlives each ``fit``)."""
    t = torch.tensor([value], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def policies(args, out: dict) -> None:
    for policy in [None, *FORCED]:
        _, trainer = fit(args.model, policy, steps=3, root=args.root)
        out[policy or "plain"] = record(trainer)


def variants(args, out: dict) -> None:
    """The long run (``LSWAP_LONG=1``): the other sharding setting, plain and under
    the policies the suite's run does not repeat there."""
    # selective only where a segment is one unit (Note [Selective around FSDP hooks])
    for policy in (None, "offload", "recompute", *(["selective"] if args.model == "gpt" else [])):
        _, trainer = fit(args.model, policy, steps=3, root=args.root, variant=True)
        out[f"variant:{policy or 'plain'}"] = record(trainer)


def auto(args, out: dict) -> None:
    """``auto`` halfway between the lowest-memory plan's peak and plain's (per rank, the largest
    over the ranks): every step of every rank must stay within it, and its 6 steps train as
    plain training's 6 do."""
    lowest = largest(max(out["recompute_offload"]["peaks"]))
    plain = largest(max(out["keep"]["peaks"]))
    budget = (lowest + plain) // 2
    _, trainer = fit(args.model, "auto", steps=6, root=args.root, budget_bytes=budget)
    out["auto"] = {**record(trainer), "budget": budget, "lowest": lowest, "plain_peak": plain}
    _, trainer = fit(args.model, None, steps=6, root=args.root)  # what auto's 6 steps must equal
    out["auto"]["plain_state"] = full_state(trainer)


STEM_FRACTIONS = (0.99, 0.9, 0.8)


def stem(args, out: dict) -> None:
    """The stem CNN under FSDP2 and ``auto`` at each of ``STEM_FRACTIONS`` x plain's per-rank peak
    (the largest over the ranks): every step of both ranks must stay within it (issue 33: the
    bound counts the regions outside the segments), and train as plain FSDP does."""
    plain_peak = largest(max(record(fit("stem", "keep", steps=4, root=args.root)[1])["peaks"]))
    plain = full_state(fit("stem", None, steps=4, root=args.root)[1])
    out["stem"] = {"plain_peak": plain_peak}
    for fraction in STEM_FRACTIONS:
        budget = int(fraction * plain_peak)
        _, trainer = fit("stem", "auto", steps=4, root=args.root, budget_bytes=budget)
        out["stem"][fraction] = {**record(trainer), "budget": budget, "plain_state": plain}


def finder(args, out: dict) -> None:
    """The finder under a budget of plain training's per-rank peak at batch 4: both ranks must
    agree on one batch, and train at it within the budget."""
    keep_peak = largest(max(out["keep"]["peaks"]))
    callback = SwapBatchSizeFinder(mode="max", max_batch_size=16, steps_per_trial=1)
    module, trainer = fit(args.model, "auto", steps=1, root=args.root, samples=64, callbacks=[callback], budget_bytes=keep_peak)
    out["finder"] = {
        "batch": callback.optimal_batch_size, "module_batch": module.batch_size,
        "peaks": [s.peak_device_bytes for s in trainer.strategy.stats_history], "budget": keep_peak,
    }


def resume(args, out: dict) -> None:
    """4 steps of plain training uninterrupted (then saved, for its checkpoint's keys); under
    ``recompute_offload``, saved after 2 steps and resumed for 2 more."""
    samples = 2 * BATCH
    _, trainer = fit(args.model, None, steps=4, root=args.root, samples=samples, reseed=True)
    out["resume:plain4"] = full_state(trainer)
    path = os.path.join(args.root, "plain.ckpt")
    trainer.save_checkpoint(path)
    out["resume:plain:keys"] = checkpoint_keys(path)
    policy = "recompute_offload"
    _, trainer = fit(args.model, policy, steps=2, root=args.root, samples=samples, reseed=True)
    path = os.path.join(args.root, f"{policy}.ckpt")
    trainer.save_checkpoint(path)
    out[f"resume:{policy}:keys"] = checkpoint_keys(path)
    _, trainer = fit(args.model, policy, steps=4, root=args.root, samples=samples, reseed=True, ckpt_path=path)
    out[f"resume:{policy}"] = full_state(trainer)


def core(args, out: dict) -> None:
    """The core on the 2 ranks this job already has (no Lightning; rank 1 with twice rank 0's
    batch): each uniform plan's peak predicted from a profile of a steady step against the one
    measured, the profiles of both ranks merged, and FSDP2's all-gathers counted under ``keep`` and ``recompute`` (per-block
    units, and two units inside each segment: Note [Recompute under FSDP gathers nothing more])."""
    from lightning_swap import Action, Plan, SwapRuntime, find_segments, profile, simulate
    from lightning_swap.core.measure.model_profile import max_profile
    from tests.models import MODELS, TinyGPT
    from tests.runtime.test_fsdp_core import sharded_gpt

    rank = torch.distributed.get_rank()
    model = sharded_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = MODELS["gpt"][1](3 * BATCH)
    # Rank 1 trains on a larger batch (FSDP does not mind): the ranks measure different peaks.
    rows = slice(0, BATCH) if rank == 0 else slice(BATCH, 3 * BATCH)
    batch = (x[rows], y[rows])
    step = lambda m, b: MODELS["gpt"][2](m(b[0]), b[1])  # noqa: E731
    step(model, batch).backward()  # a steady state: gradients and optimizer state exist
    optimizer.step()
    prof = profile(model, batch, step_fn=step, track=[optimizer.state], min_offload_bytes=0, scale=False, device="cpu")
    result = {"profile": prof, "predicted": {}, "measured": {}}
    for policy in CORE_POLICIES:
        actions = {n: Action.parse(policy) for n in find_segments(model)}
        result["predicted"][policy] = simulate(prof, actions).peak_bytes
        # SELECTIVE saves the ops the profile chose and priced (Note [Which ops selective
        # recomputation saves]), as a plan the planner makes carries them.
        chosen = {s.name: s.selective_ops for s in prof.segments if s.selective_ops is not None and actions[s.name] is Action.SELECTIVE}
        # The least of two steps: the peak the program's order gives. Under load, about 1 run in 6
        # measured one step higher by timing alone (keep +3,072 B, offload +199,936 B, about one
        # block's gradients), likely buffers gloo's worker thread still held (the steps of one
        # run otherwise agree: 16 runs of 4 steps each, all equal).
        peaks = []
        for _ in range(2):
            with SwapRuntime(model, Plan(actions=actions, selective_ops=chosen), min_offload_bytes=0, device="cpu") as runtime:
                runtime.begin_step([batch, optimizer.state])
                step(model, batch).backward()
                peaks.append(runtime.end_step().peak_device_bytes)
        result["measured"][policy] = min(peaks)
    profiles: list = [None, None]
    torch.distributed.all_gather_object(profiles, prof)
    result["merged"] = max_profile(profiles)
    result["local_parameter_bytes"] = sum(p.to_local().numel() * 4 for p in model.parameters())
    result["parameter_bytes"] = sum(p.numel() * 4 for p in TinyGPT().parameters())
    result["block_bytes"] = sum(p.numel() * 4 for p in TinyGPT().blocks[0].parameters())
    nested, z = nested_units(), torch.randn(BATCH, 32)
    result["gathers"] = {
        (kind, policy): gathers_per_step(m, policy, inp)
        for kind, m, inp in (("blocks", model, batch[0]), ("nested", nested, z)) for policy in ("keep", "recompute")
    }
    out["core"] = result


CORE_POLICIES = ["keep", "offload", "recompute", "recompute_offload", "selective"]


def nested_units() -> torch.nn.Module:
    """Segments that each hold two FSDP2 units (a recomputation calls the first as a module)."""
    from torch.distributed.fsdp import fully_shard

    from tests.models import mlp_block

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(mlp_block(32), mlp_block(32)) for _ in range(3)], torch.nn.Linear(32, 4))
    for pair in model[:3]:
        for block in pair:
            fully_shard(block)
    fully_shard(model)
    return model


def gathers_per_step(model: torch.nn.Module, policy: str, x: torch.Tensor) -> int:
    """FSDP2's all-gathers in one forward and backward under ``policy`` (its unshard of a unit
    not gathered yet, counted by a patch removed afterwards)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    from lightning_swap import Action, SwapRuntime, find_segments

    calls: list[str] = []
    original = group.FSDPParamGroup.unshard

    def unshard(self, *args, **kwargs):
        if not self.is_unsharded:
            calls.append(self._module_fqn)
        return original(self, *args, **kwargs)

    group.FSDPParamGroup.unshard = unshard
    try:
        with SwapRuntime(model, {n: Action.parse(policy) for n in find_segments(model)}, device="cpu"):
            model(x).sum().backward()
    finally:
        group.FSDPParamGroup.unshard = original
    return len(calls)


def checkpoint_keys(path: str) -> list[str]:
    """Every key the checkpoint holds (a distributed checkpoint's metadata, or a file's)."""
    if os.path.isdir(path):
        from torch.distributed.checkpoint import FileSystemReader

        return sorted(FileSystemReader(path).read_metadata().state_dict_metadata)
    checkpoint = torch.load(path, weights_only=False, map_location="cpu")
    return sorted(f"state_dict.{k}" for k in checkpoint["state_dict"]) + sorted(k for k in checkpoint if k != "state_dict")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", choices=["gpt", "cnn"], required=True)
    parser.add_argument("--cases", nargs="+", default=["policies", "auto", "finder", "resume"])
    args = parser.parse_args()
    args.root = os.path.dirname(os.path.abspath(args.out))
    out: dict = {}
    for case in args.cases:
        cases = {
            "policies": policies, "auto": auto, "stem": stem, "finder": finder, "resume": resume, "core": core, "variants": variants,
        }
        cases[case](args, out)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.save(out, f"{args.out}.rank{rank}")


if __name__ == "__main__":
    main()
