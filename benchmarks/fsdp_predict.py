"""On paper: what the library's cost model predicts for FSDP2 on 8 x H100 80 GB, for a 1B and a
7B decoder at sequence 4096 in bf16 — the largest micro-batch per GPU with plain FSDP2, with
full activation checkpointing (every block ``recompute``) and with ``auto``, and the step times.

    python benchmarks/fsdp_predict.py            # the table (seconds, no GPU)
    python benchmarks/fsdp_predict.py --budget-fraction 0.85

Nothing here is measured. A :class:`ModelProfile` of one rank is written down from the
assumptions below (what a profile of that rank would measure), and the library's own planner
does the rest: :func:`predict_batch_size` (the batch-size search's bisection over predictions)
restricted to ``keep`` (plain), to ``recompute`` (full checkpointing) or free (``auto``), and
:func:`simulate` for step times, with its copy-engine queues (Note [Time model]).

Assumptions (every one a number in ``ASSUMED`` below, printed with the table):

- Models: Llama-style decoders (RMSNorm, rotary attention with FlashAttention — no s^2
  memory —, SwiGLU MLP as three linears, untied head), vocabulary 32000: "1B" is TinyLlama-1.1B
  (width 2048, 22 blocks, 32 heads, 4 key-value heads, MLP 5632), "7B" is Llama-2-7B (4096,
  32, 32, 32, 11008). One segment per block.
- Saved per block per token (bf16): the block's input, both norms' outputs, q, k, v, the
  attention output, the residual between, and the MLP's gate, up, SiLU(gate) and product:
  2 * (6h + 2h_kv + 4f) bytes. Selective checkpointing keeps the matmul and attention outputs.
  The tail (final norm, head, loss): 4h + 4V bytes saved per token (fp32 log-softmax), 10V
  transient.
- FSDP2, full sharding over 8 ranks, bf16 compute, fp32 master weights, fp32 gradient
  reduction, AdamW: per rank 4+8 bytes per parameter / 8 alive between steps, plus the fp32
  gradient shards (4 / 8) from the backward on; the root unit (embedding, head) gathered from
  the first forward to the last backward; per block window two units gathered in bf16 (the one
  computing and the one prefetched) plus one unit's all-gather staging in the forward, and in
  the backward two gathered units plus the unit's fp32 unsharded gradients and its fp32
  reduce-scatter input. Recomputation gathers nothing more (Note [Recompute under FSDP gathers
  nothing more], counted on CPU).
- Compute: 400 TFLOP/s sustained bf16 per GPU (about 40% of the H100 SXM's 989 dense peak);
  a block's forward is 2 * params * tokens + 2 * s^2 * h * batch FLOPs (causal FlashAttention),
  its backward twice that, a recomputation one more forward, selective's 5% of it.
- Communication: all-gathers and reduce-scatters hidden behind compute (FSDP2's prefetch);
  the table prints each block's all-gather time at 300 GB/s against its forward time.
- Host link: 40 GB/s each way per GPU (PCIe Gen5 x16 with 8 GPUs sharing the host), overlapped
  with compute by the copy engines; host RAM is assumed to hold what is offloaded (the table
  prints it per GPU).
- Budget: 90% of 79.6 GiB (an H100's ``total_memory``), the library's default margin on CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: lightning_swap

from lightning_swap.core import (  # noqa: E402
    Action, InfeasibleBudgetError, ModelProfile, ScaleConfig, SegmentProfile, predict_batch_size, simulate, solve,
)

GiB = 2**30

ASSUMED = dict(
    world=8,
    seq=4096,
    vocab=32000,
    tflops=400.0,  # sustained bf16 per GPU
    host_gb_per_s=40.0,  # each way per GPU
    gather_gb_per_s=300.0,  # NCCL all-gather bus bandwidth (NVLink), for the hidden-communication check
    device_gib=79.6,  # H100 80 GB total_memory
    budget_fraction=0.9,
    max_batch=256,
)


@dataclass(frozen=True)
class Decoder:
    name: str
    width: int  # h
    blocks: int
    heads: int
    kv_heads: int
    mlp: int  # f

    @property
    def kv_width(self) -> int:
        return self.width // self.heads * self.kv_heads

    @property
    def block_params(self) -> int:
        h, kv, f = self.width, self.kv_width, self.mlp
        return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # wq, wo, wk, wv, three MLP matrices, two norms

    def root_params(self, vocab: int) -> int:
        return 2 * vocab * self.width + self.width  # embedding, untied head, final norm

    def params(self, vocab: int) -> int:
        return self.blocks * self.block_params + self.root_params(vocab)


MODELS = (
    Decoder("1B (TinyLlama-1.1B)", width=2048, blocks=22, heads=32, kv_heads=4, mlp=5632),
    Decoder("7B (Llama-2-7B)", width=4096, blocks=32, heads=32, kv_heads=32, mlp=11008),
)


def _block(m: Decoder, b: int, i: int, kept_before: int, fsdp: dict, a: dict) -> SegmentProfile:
    """One block's segment at micro-batch ``b``: the bytes and times a profile of one rank would
    measure under plain training (Note [Memory model] in ``decide/costmodel.py`` says how they
    are read), from the assumptions in the module docstring."""
    s, h, kv, f = a["seq"] * b, m.width, m.kv_width, m.mlp  # s: tokens in the micro-batch
    boundary = 2 * s * h
    saved = 2 * s * (6 * h + 2 * kv + 4 * f)
    internal = saved - boundary
    transient_fwd = 2 * boundary  # the output projections' results, not saved
    fwd_working = internal + transient_fwd
    bwd_working = 2 * 2 * s * f + fsdp["unit_grads"]  # activation gradients of the MLP; unsharded grads, reduce-scatter input
    forward_ms = (2 * m.block_params * s + 2 * a["seq"] ** 2 * h * b) / (a["tflops"] * 1e9)
    start_fwd = fsdp["static"] + fsdp["root"] + fsdp["fwd_units"] + kept_before + boundary
    start_bwd = fsdp["static"] + fsdp["grads"] + fsdp["root"] + fsdp["bwd_units"] + kept_before + saved + boundary
    return SegmentProfile(
        name=f"blocks.{i}", forward_ms=forward_ms, backward_ms=2 * forward_ms, heavy_forward_ms=0.95 * forward_ms,
        input_bytes=boundary, output_bytes=boundary, saved_bytes=saved, internal_saved_bytes=internal, internal_small_bytes=0,
        heavy_bytes=2 * s * (4 * h + 2 * kv + 2 * f), heavy_unsaved_bytes=2 * s * (3 * h + kv), offload_bytes=saved,
        gradient_bytes=4 * m.block_params, forward_working_bytes=fwd_working, backward_working_bytes=bwd_working,
        forward_peak_bytes=start_fwd + fwd_working, backward_peak_bytes=start_bwd + bwd_working,
        offload_backward_peak_bytes=start_bwd + bwd_working, released_forward_working_bytes=2 * 2 * s * f + boundary,
        input_saved=True, input_small=False, input_from_previous=i > 0, input_held_elsewhere=False,
        output_saved=False, output_small=False, output_heavy=False, output_held_elsewhere=i == m.blocks - 1,
        recompute_ms=forward_ms, selective_ms=0.05 * forward_ms, gathered_parameter_bytes=2 * m.block_params,
    )


def _fsdp_bytes(m: Decoder, a: dict) -> dict:
    """Per rank, what FSDP2 holds (module docstring)."""
    p, w = m.params(a["vocab"]), a["world"]
    unit = 2 * m.block_params  # one block's parameters gathered in bf16
    return dict(
        static=(4 + 8) * p // w, grads=4 * p // w, root=2 * m.root_params(a["vocab"]),
        fwd_units=3 * unit, bwd_units=2 * unit, unit_grads=2 * 4 * m.block_params,
    )


def rank_profile(m: Decoder, b: int, a: dict, *, reference: bool = True) -> ModelProfile:
    """What a profile of one rank at micro-batch ``b`` would hold, with a second one at ``2b``
    for :meth:`ModelProfile.at_batch` (bytes are lines in the batch size, as measured ones are)."""
    fsdp, s, h, v = _fsdp_bytes(m, a), a["seq"] * b, m.width, a["vocab"]
    segments, kept = [], 0
    for i in range(m.blocks):
        seg = _block(m, b, i, kept, fsdp, a)
        segments.append(seg)
        kept += seg.internal_saved_bytes + seg.input_bytes
    tail_saved, tail_working = s * (4 * h + 4 * v), 10 * s * v
    head_ms = 3 * 2 * h * v * s / (a["tflops"] * 1e9)
    base = fsdp["static"] + fsdp["root"]
    windows = dict(
        static_bytes=fsdp["static"], prefix_forward_peak_bytes=base + 2 * s * h,
        prefix_backward_peak_bytes=base + fsdp["grads"] + 4 * v * h, tail_peak_bytes=base + kept + tail_saved + tail_working,
        optimizer_peak_bytes=fsdp["static"] + fsdp["grads"] + 4 * m.params(v) // a["world"],
    )
    seg_ms = sum(x.forward_ms + x.backward_ms for x in segments)
    peak = max(*windows.values(), *(x.forward_peak_bytes for x in segments), *(x.backward_peak_bytes for x in segments))
    bandwidth = a["host_gb_per_s"] * 1e6  # bytes per ms
    profile = ModelProfile(
        segments=tuple(segments), batch_size=b, device_type="cuda", fake=False, min_offload_bytes=1 << 20,
        parameter_bytes=4 * m.params(v) // a["world"], gradient_bytes=4 * m.params(v) // a["world"], peak_bytes=peak,
        prefix_ms=0.0, tail_ms=head_ms, step_ms=seg_ms + head_ms, d2h_bytes_per_ms=bandwidth, h2d_bytes_per_ms=bandwidth,
        world_size=a["world"], **windows,
    )
    return dataclasses.replace(profile, reference=rank_profile(m, 2 * b, a, reference=False)) if reference else profile


@dataclass(frozen=True)
class Row:
    method: str
    batch: int
    step_ms: float
    peak_bytes: int
    offloaded_bytes: int
    summary: str


def _largest(m: Decoder, a: dict, budget: int, actions) -> Row | None:
    profile = rank_profile(m, 1, a)
    config = ScaleConfig(min_batch_size=1, max_batch_size=a["max_batch"], margin=0.0)
    plan = predict_batch_size(profile, budget, config, actions=actions)
    if plan is None:
        return None
    at = profile.at_batch(plan.batch_size)
    pred = simulate(at, plan.actions)
    offloaded = sum(r.offloaded_bytes for r in pred.rows)
    return Row("", plan.batch_size, pred.step_ms, pred.peak_bytes, offloaded, plan.summary())


def _fastest(m: Decoder, a: dict, budget: int, lo: int, hi: int) -> Row | None:
    """``auto`` for throughput: the planner's fastest plan at each batch in ``lo..hi``, the one
    with the most samples per second."""
    profile, best = rank_profile(m, 1, a), None
    for batch in range(lo, hi + 1):
        at = profile.at_batch(batch)
        try:
            plan = solve(at, budget_bytes=budget)
        except InfeasibleBudgetError:
            break
        pred = simulate(at, plan.actions)
        if best is None or batch / pred.step_ms > best.batch / best.step_ms:
            best = Row("", batch, pred.step_ms, pred.peak_bytes, sum(r.offloaded_bytes for r in pred.rows), plan.summary())
    return best


def _at(m: Decoder, a: dict, batch: int, action: Action) -> float:
    at = rank_profile(m, 1, a).at_batch(batch)
    return simulate(at, {s.name: action for s in at.segments}).step_ms


def report(m: Decoder, a: dict) -> list[str]:
    budget = int(a["budget_fraction"] * a["device_gib"] * GiB)
    rows = {
        "plain FSDP2": _largest(m, a, budget, (Action.KEEP,)),
        "FSDP2 + full checkpointing": _largest(m, a, budget, (Action.RECOMPUTE,)),
        "FSDP2 + auto": _largest(m, a, budget, None),
    }
    plain = rows["plain FSDP2"]
    if plain is not None and rows["FSDP2 + auto"] is not None:
        rows["FSDP2 + auto (throughput)"] = _fastest(m, a, budget, plain.batch, rows["FSDP2 + auto"].batch)
    unit_ms = 2 * m.block_params / (a["gather_gb_per_s"] * 1e6)
    fwd_ms = rank_profile(m, 1, a).segments[0].forward_ms
    out = [
        f"== {m.name}: {m.params(a['vocab']) / 1e9:.2f}B parameters, {m.blocks} blocks; per rank {budget / GiB:.1f} GiB budget, "
        f"{_fsdp_bytes(m, a)['static'] / GiB:.1f} GiB of shards between steps",
        f"   (a block's all-gather {unit_ms:.2f} ms at {a['gather_gb_per_s']:.0f} GB/s vs its forward {fwd_ms:.2f} ms per sample: hidden)",
        f"{'method':<28} | {'batch/GPU':>9} | {'step ms':>8} | {'samples/s/GPU':>13} | {'x plain samples/s':>17} | {'peak GiB':>8} | {'host GiB':>8} | plan",
    ]
    for name, row in rows.items():
        if row is None:
            out.append(f"{name:<28} | {'none fits':>9} |")
            continue
        rate = row.batch / row.step_ms * 1e3
        vs = rate / (plain.batch / plain.step_ms * 1e3) if plain is not None else float("nan")
        out.append(
            f"{name:<28} | {row.batch:>9} | {row.step_ms:>8.0f} | {rate:>13.2f} | {vs:>17.2f} | {row.peak_bytes / GiB:>8.1f} | "
            f"{row.offloaded_bytes / GiB:>8.1f} | {row.summary}"
        )
    if plain is not None:
        ac = _at(m, a, plain.batch, Action.RECOMPUTE)
        out.append(f"   at plain's batch ({plain.batch}): full checkpointing's step {ac / plain.step_ms:.2f}x plain's; auto keeps every block (1.00x)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-fraction", type=float, default=ASSUMED["budget_fraction"])
    parser.add_argument("--tflops", type=float, default=ASSUMED["tflops"])
    parser.add_argument("--host-gb-per-s", type=float, default=ASSUMED["host_gb_per_s"])
    args = parser.parse_args()
    a = dict(ASSUMED, budget_fraction=args.budget_fraction, tflops=args.tflops, host_gb_per_s=args.host_gb_per_s)
    print("PREDICTED by the library's cost model (nothing measured); assumptions: " + ", ".join(f"{k}={v}" for k, v in a.items()))
    for m in MODELS:
        print()
        print("\n".join(report(m, a)))


if __name__ == "__main__":
    main()
