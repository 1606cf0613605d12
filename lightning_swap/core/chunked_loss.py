"""Chunked head and loss: cross-entropy of ``hidden @ weight.T (+ bias)`` without the full logits.

For a language model the largest activations of a training step are not in the repeated blocks
but after them: the logits (tokens x vocabulary), their log-softmax and their gradient. For
GPT-2 (1024 tokens, 50257 words) each is ~200 MiB per sample in fp32, and no action on the
transformer blocks (keep, offload, recompute) touches them. This module computes the loss over
the tokens in chunks, so at most one chunk's logits exist at any time, in forward and backward.
The idea is the "fused linear cross entropy" of Liger-Kernel (Hsu et al. 2024,
``LigerFusedLinearCrossEntropyLoss``) and the chunked loss of Apple's "Cut Your Losses in
Large-Vocabulary Language Models" (Wijmans et al. 2024); here it is plain PyTorch, one matmul
per chunk, with no custom kernel.

Note [What the chunked loss saves]: forward saves ``hidden``, ``weight``, ``bias`` and
``target`` (the first three are alive anyway: the hidden states are the last block's output
and the others are parameters; an ``F.linear`` head saves ``hidden`` and ``weight`` too) and
one number per token: the log-sum-exp of its logits, ``lse_i`` (tokens x 4 bytes). Backward
recomputes each chunk's logits ``z = h W^T + b`` and forms their gradient in place:
``softmax(z)_ij = exp(z_ij - lse_i)``, and for cross-entropy with label smoothing ``e`` over
``V`` classes ``dL/dz_ij = g_i * (softmax_ij - (1 - e) [j == t_i] - e / V)``, where ``g_i`` is
the gradient reaching token ``i``'s loss (``grad / count`` for ``mean``, ``grad`` for ``sum``,
``grad_i`` for ``none``, 0 for ignored tokens). Then ``grad_hidden[chunk] = dz @ W`` and
``grad_weight += dz^T @ h[chunk]``, ``grad_bias += sum(dz)``. That is the chain rule of the
unchunked ``F.cross_entropy(F.linear(h, W, b), t)`` written out: the loss of token ``i`` depends
only on row ``i`` of the logits, so chunking over tokens splits no sum except the sums over
tokens of the weight and bias gradients (and of the loss), which are accumulated chunk by chunk.
The results therefore equal the unchunked ones up to floating-point rounding: the order of
those sums over tokens, and ``lse - z_t`` against torch's ``log_softmax`` (see the tests for
which results are bitwise equal).

Note [Chunked loss under autocast]: ``F.linear`` runs in the autocast dtype (bf16/fp16) and
``F.cross_entropy`` in fp32 under autocast, on CPU and CUDA alike. This module follows that with
explicit casts rather than ``torch.amp.custom_fwd`` (whose ``device_type`` is fixed when the
function is decorated): the wrapper reads whether autocast is on for the tensors' device, and
the autograd function turns autocast off inside and casts itself. Each chunk's matmuls (forward
and both in backward) run in the autocast dtype, the softmax and loss in fp32, the loss comes
back as fp32; the weight and bias gradients are accumulated over chunks in fp32 (the unchunked
form rounds its single bf16 matmul once, so the two agree to bf16 rounding). Without autocast,
``hidden`` and ``weight`` must share a dtype (as ``F.linear`` requires); the loss math runs in
that dtype promoted to at least fp32, and the loss comes back in the input dtype, as
``F.cross_entropy`` on bf16 logits does.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ChunkedCrossEntropy",
    "chunked_cross_entropy",
    "default_chunk_size",
    "hf_causal_lm_loss",
]

#: Bytes of one chunk's logits (in the loss dtype, fp32 normally) when ``chunk_size`` is None:
#: 64 MiB is 333 tokens of GPT-2's 50257-word vocabulary, big enough for efficient matmuls.
DEFAULT_CHUNK_BYTES = 64 * 2**20

_REDUCTIONS = ("mean", "sum", "none")


def default_chunk_size(vocab_size: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, itemsize: int = 4) -> int:
    """Tokens per chunk so that one chunk's logits take at most ``chunk_bytes`` (at least 1)."""
    for name, value in (("vocab_size", vocab_size), ("chunk_bytes", chunk_bytes), ("itemsize", itemsize)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"`{name}` must be an int > 0; got {value!r}.")
    return max(1, chunk_bytes // (vocab_size * itemsize))


# -- argument checks -------------------------------------------------------------------------
def _check_options(chunk_size: Any, ignore_index: Any, reduction: Any, label_smoothing: Any) -> float:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"`chunk_size` must be None (from {DEFAULT_CHUNK_BYTES} bytes of logits) or an int > 0 (tokens); got {chunk_size!r}.")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"`ignore_index` must be an int; got {ignore_index!r}.")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"`reduction` must be one of {list(_REDUCTIONS)}; got {reduction!r}.")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"`label_smoothing` must be a float in [0, 1]; got {label_smoothing!r}.")
    return float(label_smoothing)


def _check_tensors(hidden: Any, weight: Any, target: Any, bias: Any) -> None:
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise ValueError(f"`hidden` must be a floating-point tensor of shape (..., dim); got {_describe(hidden)}.")
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2:
        raise ValueError(f"`weight` must be a floating-point tensor of shape (vocab, dim); got {_describe(weight)}.")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"`weight` must have shape (vocab, {hidden.shape[-1]}) to match `hidden`'s last dimension; got {tuple(weight.shape)}.")
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"`target` must be an integer tensor of class indices (class probabilities are not supported); got {_describe(target)}.")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"`target` must have `hidden`'s shape without its last dimension, {tuple(hidden.shape[:-1])}; got {tuple(target.shape)}.")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != weight.shape[:1]):
        raise ValueError(f"`bias` must be None or a tensor of shape ({weight.shape[0]},); got {_describe(bias)}.")
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"`{name}` must be on `hidden`'s device {hidden.device}; got {t.device}.")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value) if value is None else type(value).__name__


def _dtypes(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(matmul dtype, loss-math dtype, returned loss dtype): Note [Chunked loss under autocast]."""
    device_type = hidden.device.type
    try:
        autocast = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know
        autocast = False
    # Autocast casts fp32/fp16/bf16 only; a float64 operand keeps the op out of it.
    eligible = all(t.dtype != torch.float64 for t in (hidden, weight, bias) if t is not None)
    if autocast and eligible:
        compute = torch.get_autocast_dtype(device_type)
        return compute, torch.float32, torch.float32
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != hidden.dtype:
            raise ValueError(f"`{name}` must have `hidden`'s dtype {hidden.dtype} outside autocast (as F.linear requires); got {t.dtype}.")
    return hidden.dtype, torch.promote_types(hidden.dtype, torch.float32), hidden.dtype


# -- the autograd function -----------------------------------------------------------------
class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Note [What the chunked loss saves]. Inputs are 2-D ``hidden`` (N, D), ``target`` (N,)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, chunk, ignore_index, reduction, smoothing, compute, math, out):
        n, vocab = hidden.shape[0], weight.shape[0]
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)  # an index gather can use; ignored rows are masked below
        lse = torch.empty(n, dtype=math, device=hidden.device)
        losses = torch.empty(n, dtype=math, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):  # Note [Chunked loss under autocast]
            w, b = weight.to(compute), None if bias is None else bias.to(compute)
            for start in range(0, n, chunk):
                stop = min(start + chunk, n)
                z = F.linear(hidden[start:stop].to(compute), w, b).to(math)  # a new buffer this loop owns
                picked = z.gather(1, safe[start:stop, None]).squeeze(1)
                smooth = z.sum(1) if smoothing else None
                # log-sum-exp in place (torch.logsumexp would allocate a second chunk): an
                # infinite max is replaced by 0 as torch.logsumexp does, so inf - inf is no nan.
                top = z.amax(1)
                top.masked_fill_(top.abs() == float("inf"), 0.0)
                z.sub_(top[:, None]).exp_()
                chunk_lse = torch.log(z.sum(1)).add_(top)
                del z
                lse[start:stop] = chunk_lse
                loss = chunk_lse - picked if not smoothing else chunk_lse - (1.0 - smoothing) * picked - (smoothing / vocab) * smooth
                losses[start:stop] = loss
        losses = torch.where(valid, losses, 0.0)
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.options = (chunk, ignore_index, reduction, smoothing, compute, math)
        if reduction == "none":
            return losses.to(out)
        total = losses.sum()
        if reduction == "mean":
            total = total / valid.sum()  # 0 / 0 = nan when every token is ignored, as torch
        return total.to(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        chunk, ignore_index, reduction, smoothing, compute, math = ctx.options
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, vocab = hidden.shape[0], weight.shape[0]
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)
        grad = grad.to(math)
        if reduction == "mean":
            grad = grad / valid.sum()
        scale = torch.where(valid, grad, 0.0)  # g_i, (N,): zero for ignored tokens (and for count 0)
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None  # contiguous
        grad_w = grad_b = None
        with torch.autocast(hidden.device.type, enabled=False):  # Note [Chunked loss under autocast]
            w, b = weight.to(compute), None if bias is None else bias.to(compute)
            for start in range(0, n, chunk):
                stop = min(start + chunk, n)
                h = hidden[start:stop].to(compute)
                g = scale[start:stop, None]
                dz = F.linear(h, w, b).to(math)
                dz.sub_(lse[start:stop, None]).exp_().mul_(g)  # softmax * g_i, in place
                dz.scatter_add_(1, safe[start:stop, None], g * -(1.0 - smoothing))
                if smoothing:
                    dz.sub_(g * (smoothing / vocab))
                if need_b:
                    part_b = dz.sum(0)
                    grad_b = part_b if grad_b is None else grad_b.add_(part_b)
                dz_c = dz.to(compute)
                del dz
                if need_h and grad_h.dtype == compute:
                    torch.mm(dz_c, w, out=grad_h[start:stop])  # rows of a contiguous tensor
                elif need_h:
                    grad_h[start:stop] = torch.mm(dz_c, w)
                if need_w and grad_w is None:
                    grad_w = torch.mm(dz_c.t(), h).to(math)
                elif need_w and compute == math:
                    grad_w.addmm_(dz_c.t(), h)  # no (vocab, dim) temporary
                elif need_w:  # fp32 += bf16 under autocast: summed over chunks in fp32
                    grad_w.add_(torch.mm(dz_c.t(), h))
        if need_w and grad_w is None:  # no tokens
            grad_w = torch.zeros_like(weight)
        if need_b and grad_b is None:
            grad_b = torch.zeros_like(bias)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


# -- public API -------------------------------------------------------------------------------
def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, -2), target.flatten(), ...)``
    computed ``chunk_size`` tokens at a time, the full logits never in memory.

    ``hidden`` is (..., dim), ``weight`` (vocab, dim) (an ``nn.Linear`` head's weight, or a tied
    embedding matrix: its gradient accumulates into that one parameter), ``target`` (...)
    class indices; tokens whose target is ``ignore_index`` count for nothing. ``reduction`` is
    ``"mean"`` (over the tokens not ignored; nan when all are), ``"sum"`` or ``"none"`` (a loss
    per token, of ``target``'s shape). ``chunk_size`` is tokens per chunk; None picks it from
    :data:`DEFAULT_CHUNK_BYTES` of logits (:func:`default_chunk_size`). Works under autocast
    (Note [Chunked loss under autocast]); what it saves: Note [What the chunked loss saves].
    """
    smoothing = _check_options(chunk_size, ignore_index, reduction, label_smoothing)
    _check_tensors(hidden, weight, target, bias)
    compute, math, out = _dtypes(hidden, weight, bias)
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0], itemsize=math.itemsize)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_target = target.reshape(-1).long()
    loss = _ChunkedLinearCrossEntropy.apply(
        flat_hidden, weight, bias, flat_target, chunk_size, ignore_index, reduction, smoothing, compute, math, out
    )
    return loss.view(target.shape) if reduction == "none" else loss


class ChunkedCrossEntropy(nn.Module):
    """The head and the loss in one: ``loss = self.loss_fn(hidden, self.lm_head, labels)``.

    ``forward(hidden, weight_or_linear, target)`` takes the head as an ``nn.Linear`` (its
    weight and bias are used) or as a weight tensor (vocab, dim), e.g. a tied embedding matrix,
    and returns :func:`chunked_cross_entropy` of it. Options as there, checked here.
    """

    def __init__(
        self, *, chunk_size: Optional[int] = None, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0
    ) -> None:
        super().__init__()
        self.label_smoothing = _check_options(chunk_size, ignore_index, reduction, label_smoothing)
        self.chunk_size, self.ignore_index, self.reduction = chunk_size, ignore_index, reduction

    def forward(self, hidden: torch.Tensor, weight_or_linear: nn.Linear | torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        weight, bias = _head(weight_or_linear, "weight_or_linear")
        return chunked_cross_entropy(
            hidden, weight, target, bias=bias, chunk_size=self.chunk_size, ignore_index=self.ignore_index,
            reduction=self.reduction, label_smoothing=self.label_smoothing,
        )

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}, ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}"


def _head(head: Any, field: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    if isinstance(head, nn.Linear):
        return head.weight, head.bias
    if isinstance(head, torch.Tensor):
        return head, None
    raise ValueError(f"`{field}` must be an nn.Linear or a weight tensor of shape (vocab, dim); got {type(head).__name__}.")


#: Config attributes of Hugging Face models whose causal-LM forward transforms the logits after
#: the head (Gemma 2/3 soft-capping, Cohere's scale, Granite's divisor): the chunked loss of
#: ``lm_head`` alone would silently differ from the model's own loss, so those are refused.
_LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


def hf_causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: Optional[torch.Tensor] = None,
    *,
    attention_mask: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    ignore_index: int = -100,
    num_items_in_batch: Optional[int | torch.Tensor] = None,
    **model_kwargs: Any,
) -> torch.Tensor:
    """The causal-LM loss of a Hugging Face ``...ForCausalLM`` model, chunked.

    Runs ``model.base_model`` (the decoder without its head) and takes ``last_hidden_state``,
    then :func:`chunked_cross_entropy` with ``model.get_output_embeddings()`` (the ``lm_head``)
    against the labels shifted by one, as ``transformers``' ``ForCausalLMLoss`` does: the label
    of position ``i`` is ``labels[i + 1]``, the last position gets ``ignore_index``, and labels
    equal to ``ignore_index`` count for nothing; the mean is over the tokens counted, or the sum
    divided by ``num_items_in_batch`` when given (gradient accumulation, as there). ``labels``
    defaults to ``input_ids`` with the positions ``attention_mask`` marks as padding ignored (as
    Hugging Face's language-modelling collator does). ``model_kwargs`` go to the base model;
    ``use_cache`` defaults to False (a training step needs no key-value cache). Written against
    the documented ``transformers`` API (``base_model``, ``get_output_embeddings``,
    ``last_hidden_state``); this package does not depend on ``transformers``.
    """
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        raise ValueError("`model` must be a Hugging Face causal LM with a `base_model` (the decoder without its head) other than itself.")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        raise ValueError("`model.get_output_embeddings()` must return the output head (an nn.Linear); it is missing or returned None.")
    config = getattr(model, "config", None)
    for attr, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, attr, None)
        if value is not None and value != neutral:
            raise ValueError(
                f"`model.config.{attr}` is {value!r}: this model transforms its logits after the head, which the chunked loss does not; "
                "use the model's own loss."
            )
    if isinstance(num_items_in_batch, bool) or (num_items_in_batch is not None and not isinstance(num_items_in_batch, (int, torch.Tensor))):
        raise ValueError(f"`num_items_in_batch` must be None, an int or a tensor; got {num_items_in_batch!r}.")
    if labels is None:
        labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, ignore_index)
    model_kwargs.setdefault("use_cache", False)
    out = base(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    weight, bias = _head(head, "model.get_output_embeddings()")
    if num_items_in_batch is None:
        return chunked_cross_entropy(hidden, weight, shifted, bias=bias, chunk_size=chunk_size, ignore_index=ignore_index)
    total = chunked_cross_entropy(hidden, weight, shifted, bias=bias, chunk_size=chunk_size, ignore_index=ignore_index, reduction="sum")
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
