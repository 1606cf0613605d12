"""The chunked head-and-loss against ``F.cross_entropy(F.linear(h, W, b), t)``.

Which results are bitwise equal (``torch.equal``) and which only close: the chunked form
computes ``lse - z_t`` where torch computes ``-log_softmax(z)[t]`` and sums the weight
gradient chunk by chunk, and the CPU BLAS does not give a row of ``h @ W.T`` the same bits
for every number of rows, so against torch (and across chunk sizes below the token count)
fp32 results agree to a few ulps (rtol 1e-6), fp64 ones to 1e-12. Exact by construction, and
tested so: results for any ``chunk_size >= tokens`` (the same ops run); ``sum`` against
``none``'s sum and ``mean`` against ``sum / count``; zero gradient rows for ignored tokens; the
all-ignored cases (nan / 0, zero gradients, as torch); the tied gradient being the sum of the
untied embedding and head gradients; and, under bf16 autocast, the loss and the hidden
gradient (the same bf16 matmul, the same fp32 softmax) equal to the unchunked autocast ones
(Note [Chunked loss under autocast]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import lightning_swap
from lightning_swap.core import Action, ChunkedCrossEntropy, DeviceMemoryMeter, SwapRuntime, chunked_cross_entropy, hf_causal_lm_loss
from lightning_swap.core import profile as profile_step
from lightning_swap.core import simulate
from lightning_swap.core.chunked_loss import DEFAULT_CHUNK_BYTES, default_chunk_size

from ..models import _tokens, lm_loss, tiny_gpt


def _case(batch=3, seq=8, dim=16, vocab=50, *, bias=True, dtype=torch.float32, seed=0, ignore_every=5):
    """(hidden (B, T, D), weight, bias, target (B, T)) with every ``ignore_every``-th target ignored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, dim, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=g, dtype=dtype) / math.sqrt(dim)).requires_grad_()
    b = torch.randn(vocab, generator=g, dtype=dtype).requires_grad_() if bias else None
    target = torch.randint(0, vocab, (batch, seq), generator=g)
    if ignore_every:
        target.view(-1)[::ignore_every] = -100
    return hidden, weight, b, target


def _inputs(hidden, weight, bias):
    return [t for t in (hidden, weight, bias) if t is not None]


def _reference(hidden, weight, bias, target, **kwargs):
    logits = F.linear(hidden, weight, bias)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), **kwargs)
    return loss.view(target.shape) if kwargs.get("reduction") == "none" else loss


def _loss_and_grads(fn, hidden, weight, bias, target, **kwargs):
    loss = fn(hidden, weight, bias, target, **kwargs)
    grads = torch.autograd.grad(loss.sum(), _inputs(hidden, weight, bias))
    return loss.detach(), grads


def _close(got, want, rtol):
    """``assert_close`` at ``rtol``, elements near zero held to ``rtol`` of the largest one
    (a rounding error is relative to the terms summed, not to a small result)."""
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())


def _chunked(hidden, weight, bias, target, **kwargs):
    return chunked_cross_entropy(hidden, weight, target, bias=bias, **kwargs)


# -- equal to the unchunked loss ---------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 5, 7, 24, 100])  # 24 tokens: 5 and 7 do not divide them
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_loss_and_gradients_match_unchunked_fp32(reduction, bias, chunk_size, label_smoothing):
    case = _case(bias=bias)
    options = dict(reduction=reduction, label_smoothing=label_smoothing)
    expected, expected_grads = _loss_and_grads(_reference, *case, **options)
    loss, grads = _loss_and_grads(_chunked, *case, chunk_size=chunk_size, **options)
    assert loss.dtype == torch.float32 and loss.shape == expected.shape
    _close(loss, expected, 1e-6)
    for got, want in zip(grads, expected_grads):
        assert got.dtype == want.dtype and got.shape == want.shape
        _close(got, want, 1e-6)


@pytest.mark.parametrize("chunk_size", [1, 7, 24])
def test_float64_matches_unchunked_to_1e12(chunk_size):
    """In fp64 the rounding differences shrink to ~1e-16: the arithmetic itself is the same."""
    case = _case(batch=2, seq=12, dim=8, vocab=37, dtype=torch.float64)
    expected, expected_grads = _loss_and_grads(_reference, *case, label_smoothing=0.2)
    loss, grads = _loss_and_grads(_chunked, *case, chunk_size=chunk_size, label_smoothing=0.2)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected_grads):
        _close(got, want, 1e-12)


def test_any_chunk_size_at_least_the_tokens_gives_the_same_bits():
    """24 tokens: chunks of 24, 25, 1000 and the default (8192 tokens at vocab 2048) all run
    one chunk of the same ops, so every result is bitwise equal."""
    case = _case(vocab=2048)
    assert default_chunk_size(2048) == 8192
    loss, grads = _loss_and_grads(_chunked, *case, chunk_size=24)
    for chunk_size in (25, 1000, None):
        other, other_grads = _loss_and_grads(_chunked, *case, chunk_size=chunk_size)
        assert torch.equal(other, loss)
        assert all(torch.equal(a, b) for a, b in zip(other_grads, grads))


@pytest.mark.parametrize("chunk_size", [4, 7])
def test_reductions_are_consistent_exactly(chunk_size):
    case = _case()
    per_token = _chunked(*case, chunk_size=chunk_size, reduction="none")
    total = _chunked(*case, chunk_size=chunk_size, reduction="sum")
    mean = _chunked(*case, chunk_size=chunk_size, reduction="mean")
    count = (case[3] != -100).sum()
    assert per_token.shape == case[3].shape
    assert torch.equal(total, per_token.sum())
    assert torch.equal(mean, total / count)


def test_ignored_tokens_count_for_nothing():
    """Ignored tokens' loss and hidden gradient rows are exactly zero; the mean is over the
    others and equals the loss of the others alone."""
    hidden, weight, bias, target = _case(ignore_every=3)
    ignored = target == -100
    per_token = chunked_cross_entropy(hidden, weight, target, bias=bias, chunk_size=5, reduction="none")
    assert torch.equal(per_token[ignored], torch.zeros(int(ignored.sum())))
    loss = chunked_cross_entropy(hidden, weight, target, bias=bias, chunk_size=5)
    (grad_hidden,) = torch.autograd.grad(loss, hidden)
    assert torch.equal(grad_hidden[ignored], torch.zeros(int(ignored.sum()), hidden.shape[-1]))
    assert grad_hidden[~ignored].abs().sum(-1).min() > 0
    kept = hidden.detach()[~ignored][None]
    alone = chunked_cross_entropy(kept, weight.detach(), target[~ignored][None], bias=bias.detach(), chunk_size=5)
    torch.testing.assert_close(loss.detach(), alone, rtol=1e-6, atol=0)
    # Another ignore_index: -100 is then an ordinary (invalid) class, so use a real one.
    other = target.masked_fill(ignored, 7)
    expected = _reference(hidden, weight, bias, other, ignore_index=7)
    torch.testing.assert_close(chunked_cross_entropy(hidden, weight, other, bias=bias, chunk_size=5, ignore_index=7), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_tokens_ignored_behaves_as_torch(reduction):
    """torch: the mean over zero tokens is nan (0 / 0), the sum 0; gradients are zero."""
    hidden, weight, bias, target = _case()
    target = torch.full_like(target, -100)
    expected, expected_grads = _loss_and_grads(_reference, hidden, weight, bias, target, reduction=reduction)
    loss, grads = _loss_and_grads(_chunked, hidden, weight, bias, target, reduction=reduction, chunk_size=5)
    if reduction == "mean":
        assert torch.isnan(expected) and torch.isnan(loss)
    else:
        assert torch.equal(loss, expected) and not loss.any()
    for got, want in zip(grads, expected_grads):
        assert torch.equal(got, want) and not got.any()


def test_tied_weights_accumulate_into_the_embedding():
    """The head sharing the embedding matrix: its gradient is the embedding's plus the head's,
    the same parameter, close to the unchunked step and exactly the untied parts' sum."""
    vocab, dim = 40, 12
    torch.manual_seed(0)
    emb = nn.Embedding(vocab, dim)
    idx, target = _tokens(3, seq=10, vocab=vocab)

    def step(weight_for_head, emb_module, chunked):
        hidden = torch.tanh(emb_module(idx))
        if chunked:
            return chunked_cross_entropy(hidden, weight_for_head, target, chunk_size=7)
        return lm_loss(F.linear(hidden, weight_for_head), target)

    step(emb.weight, emb, chunked=False).backward()
    expected = emb.weight.grad.clone()
    emb.weight.grad = None
    step(emb.weight, emb, chunked=True).backward()
    tied = emb.weight.grad.clone()
    _close(tied, expected, 1e-6)
    # Untied copies: the same gradient in two parts, whose sum (two terms: exact in any order) it is.
    emb_only = nn.Embedding(vocab, dim)
    emb_only.weight.data.copy_(emb.weight.data)
    head = emb.weight.detach().clone().requires_grad_()
    step(head, emb_only, chunked=True).backward()
    assert torch.equal(tied, emb_only.weight.grad + head.grad)
    assert head.grad.abs().sum() > 0 and emb_only.weight.grad.abs().sum() > 0


def test_bf16_autocast_on_cpu_follows_linear_then_cross_entropy():
    """Under ``torch.autocast("cpu", bfloat16)``: fp32 loss and gradients of the parameters'
    dtypes; loss and hidden gradient equal to the unchunked ones under the same autocast (the
    bf16 matmul and the fp32 softmax are the same ops on the same rows: one chunk), weight and
    bias gradients to bf16 rounding (the chunked form sums them in fp32); and autocast was
    really applied: the fp32 result is ~1e-3 away."""
    case = _case(batch=4, seq=24, dim=32, vocab=300, ignore_every=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_grads = _loss_and_grads(_reference, *case)
        loss, grads = _loss_and_grads(_chunked, *case, chunk_size=96)
        chunked_loss, chunked_grads = _loss_and_grads(_chunked, *case, chunk_size=10)
    fp32, _ = _loss_and_grads(_reference, *case)
    assert loss.dtype == expected.dtype == torch.float32
    assert [g.dtype for g in grads] == [torch.float32] * 3
    assert torch.equal(loss, expected) and torch.equal(grads[0], expected_grads[0])
    assert abs(fp32 - expected) > 1e-4
    for got in (grads, chunked_grads):
        for g, want in zip(got, expected_grads):
            _close(g, want, 2e-2)
    torch.testing.assert_close(chunked_loss, expected, rtol=1e-5, atol=0)


def test_bf16_tensors_without_autocast_give_a_bf16_loss():
    hidden, weight, _, target = _case(dim=32, vocab=300, bias=False, dtype=torch.bfloat16)
    expected, expected_grads = _loss_and_grads(_reference, hidden, weight, None, target)
    loss, grads = _loss_and_grads(_chunked, hidden, weight, None, target, chunk_size=5)
    assert loss.dtype == torch.bfloat16 and [g.dtype for g in grads] == [torch.bfloat16] * 2
    torch.testing.assert_close(loss, expected, rtol=1e-2, atol=0)
    for g, want in zip(grads, expected_grads):
        _close(g, want, 2e-2)


def test_non_contiguous_hidden():
    """A transposed (N, D) hidden: the chunks are strided rows, the gradient still right."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(16, 30, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    target = torch.randint(0, 50, (30,), generator=g)
    expected, expected_grads = _loss_and_grads(lambda h, w, b, t: _reference(h.t(), w, b, t), base, weight, None, target)
    loss, grads = _loss_and_grads(lambda h, w, b, t: chunked_cross_entropy(h.t(), w, t, chunk_size=7), base, weight, None, target)
    _close(loss, expected, 1e-6)
    for got, want in zip(grads, expected_grads):
        _close(got, want, 1e-6)


def test_frozen_head_gets_no_gradient():
    hidden, weight, bias, target = _case()
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    chunked_cross_entropy(hidden, weight, target, bias=bias, chunk_size=4).backward()
    expected = torch.autograd.grad(_reference(hidden, weight, bias, target), hidden)[0]
    _close(hidden.grad, expected, 1e-6)
    assert weight.grad is None and bias.grad is None


def test_module_takes_a_linear_or_a_weight():
    hidden, _, _, target = _case()
    head = nn.Linear(16, 50)
    loss_fn = ChunkedCrossEntropy(chunk_size=5, reduction="sum")
    expected = _reference(hidden, head.weight, head.bias, target, reduction="sum")
    torch.testing.assert_close(loss_fn(hidden, head, target), expected, rtol=1e-6, atol=0)
    without_bias = _reference(hidden, head.weight, None, target, reduction="sum")
    torch.testing.assert_close(loss_fn(hidden, head.weight, target), without_bias, rtol=1e-6, atol=0)
    assert "chunk_size=5" in repr(loss_fn) and "'sum'" in repr(loss_fn)
    assert lightning_swap.ChunkedCrossEntropy is ChunkedCrossEntropy
    assert {"ChunkedCrossEntropy", "chunked_cross_entropy", "hf_causal_lm_loss"} <= set(lightning_swap.__all__)


def test_default_chunk_size_is_chosen_by_bytes():
    """64 MiB of fp32 logits: 67108864 // (50257 * 4) = 333 tokens of GPT-2's vocabulary."""
    assert DEFAULT_CHUNK_BYTES == 64 * 2**20
    assert [default_chunk_size(v) for v in (50257, 2048, 10**9)] == [333, 8192, 1]
    assert default_chunk_size(50257, itemsize=8) == 166
    assert default_chunk_size(1000, chunk_bytes=4000) == 1


# -- bad arguments ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(chunk_size=0), "chunk_size"),
        (dict(chunk_size=-3), "chunk_size"),
        (dict(chunk_size=2.5), "chunk_size"),
        (dict(chunk_size=True), "chunk_size"),
        (dict(reduction="avg"), "reduction"),
        (dict(ignore_index=1.5), "ignore_index"),
        (dict(label_smoothing=1.5), "label_smoothing"),
        (dict(label_smoothing=-0.1), "label_smoothing"),
    ],
)
def test_bad_options_raise_naming_the_field(kwargs, field):
    hidden, weight, bias, target = _case()
    with pytest.raises(ValueError, match=f"`{field}`"):
        chunked_cross_entropy(hidden, weight, target, bias=bias, **kwargs)
    with pytest.raises(ValueError, match=f"`{field}`"):
        ChunkedCrossEntropy(**kwargs)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda h, w, b, t: (h.detach().long(), w, b, t), "hidden"),
        (lambda h, w, b, t: (h, w[:, :3], b, t), "weight"),
        (lambda h, w, b, t: (h, w[0], b, t), "weight"),
        (lambda h, w, b, t: (h, w, b, t.float()), "target"),
        (lambda h, w, b, t: (h, w, b, t[:, :3]), "target"),
        (lambda h, w, b, t: (h, w, b[:3], t), "bias"),
        (lambda h, w, b, t: (h, w.double(), b, t), "weight"),
        (lambda h, w, b, t: (h, w, b.double(), t), "bias"),
    ],
)
def test_bad_tensors_raise_naming_the_field(change, field):
    hidden, weight, bias, target = change(*_case())
    with pytest.raises(ValueError, match=f"`{field}`"):
        chunked_cross_entropy(hidden, weight, target, bias=bias)


def test_module_rejects_a_head_that_is_neither_linear_nor_tensor():
    hidden, _, _, target = _case()
    with pytest.raises(ValueError, match="`weight_or_linear`"):
        ChunkedCrossEntropy()(hidden, nn.Conv1d(16, 50, 1), target)


# -- memory --------------------------------------------------------------------------------------
def _peak_of_step(loss_of, emb, body, idx, target) -> int:
    with DeviceMemoryMeter("cpu") as meter:
        meter.track([*emb.parameters(), *body.parameters(), idx, target])
        loss_of(body(emb(idx))).backward()
    emb.zero_grad(set_to_none=True)
    body.zero_grad(set_to_none=True)
    return meter.peak_bytes


def test_chunked_step_peak_is_lower_by_the_logits():
    """Batch 4 x 64 tokens x vocabulary 1024: the logits are L = 4 * 64 * 1024 * 4 bytes = 1 MiB.
    The plain step holds the logits and their log-softmax (2 L) in forward, then the saved
    log-softmax, its gradient and the logits' gradient (3 L) in backward; the chunked step
    (32 tokens a chunk: 32 * 1024 * 4 = 128 KiB = L / 8) holds a few chunks at most. So the
    chunked peak must be lower by at least 2 L, and smaller chunks must lower it further."""
    batch, seq, vocab, dim = 4, 64, 1024, 32
    logits_bytes = batch * seq * vocab * 4
    assert logits_bytes == 2**20
    torch.manual_seed(0)
    emb, body = nn.Embedding(vocab, dim), nn.Linear(dim, dim)  # tied head: emb.weight
    idx, target = _tokens(batch, seq=seq, vocab=vocab)
    plain = _peak_of_step(lambda h: lm_loss(F.linear(h, emb.weight), target), emb, body, idx, target)
    chunked = _peak_of_step(lambda h: chunked_cross_entropy(h, emb.weight, target, chunk_size=32), emb, body, idx, target)
    one_chunk = _peak_of_step(lambda h: chunked_cross_entropy(h, emb.weight, target, chunk_size=batch * seq), emb, body, idx, target)
    assert plain - chunked >= 2 * logits_bytes, (plain, chunked)
    assert one_chunk - chunked >= logits_bytes // 2, (one_chunk, chunked)


def _gpt_hidden(model, idx):
    """``TinyGPT.forward`` without its head: the final hidden states (tests/models.py)."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = model.drop(model.wte(idx) + model.wpe(pos))
    for block in model.blocks:
        x = block(x)
    return model.ln_f(x)


@pytest.mark.slow
def test_profiler_predicts_the_lower_peak_of_the_chunked_loss():
    """The planner knows the chunked loss's memory because the profiled step includes it. A
    tiny GPT with a 2048-word vocabulary at batch 8 x 32 tokens: logits L = 8 * 32 * 2048 * 4
    bytes = 2 MiB, against ~0.1 MiB of activations per block. With chunks of 32 tokens (L / 8)
    the predicted plain-step peak must fall by at least 2 L (Note in test above), at batch 16
    (the profile's batch scaling, from fake-mode steps) by at least 4 L; and the chunked step's
    peak is predicted exactly, as the plain loss's is (tests/measure/test_profile.py)."""
    batch = 8
    torch.manual_seed(0)
    model = tiny_gpt(vocab=2048, dim=32, heads=2, layers=3, seq=32)
    x, y = _tokens(batch, seq=32, vocab=2048)
    logits_bytes = batch * 32 * 2048 * 4
    loss_fn = ChunkedCrossEntropy(chunk_size=32)
    steps = {
        "plain": lambda m, b: lm_loss(m(b[0]), b[1]),
        "chunked": lambda m, b: loss_fn(_gpt_hidden(m, b[0]), m.lm_head, b[1]),
    }
    profiles = {name: profile_step(model, (x, y), step_fn=step, device="cpu") for name, step in steps.items()}
    keep = [Action.KEEP] * len(profiles["plain"].segments)
    predicted = {name: simulate(p, keep).peak_bytes for name, p in profiles.items()}
    doubled = {name: simulate(p.at_batch(2 * batch), keep).peak_bytes for name, p in profiles.items()}
    assert predicted["plain"] - predicted["chunked"] >= 2 * logits_bytes, predicted
    assert doubled["plain"] - doubled["chunked"] >= 4 * logits_bytes, doubled
    runtime = SwapRuntime(model, dict(zip(profiles["chunked"].names, keep)), device="cpu").install()
    try:
        runtime.begin_step([x, y])
        steps["chunked"](model, (x, y)).backward()
        measured = runtime.end_step().peak_device_bytes
    finally:
        runtime.remove()
        model.zero_grad(set_to_none=True)
    assert measured == predicted["chunked"] == profiles["chunked"].peak_bytes


# -- Hugging Face causal LMs (a fake with the documented API; transformers is not installed) -----
@dataclass
class _Output:
    last_hidden_state: torch.Tensor


class _FakeDecoder(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.calls: list[dict] = []

    def forward(self, input_ids=None, attention_mask=None, use_cache=None, **kwargs):
        self.calls.append(dict(attention_mask=attention_mask, use_cache=use_cache, **kwargs))
        x = torch.tanh(self.mix(self.wte(input_ids)))
        if attention_mask is not None:
            x = x * attention_mask[..., None]
        return _Output(last_hidden_state=x)


class _FakeCausalLM(nn.Module):
    """What ``hf_causal_lm_loss`` relies on: ``base_model`` (the ``base_model_prefix``
    attribute), ``get_output_embeddings()``, ``config``; ``forward`` computes the loss the way
    transformers' ``ForCausalLMLoss`` does, from the full logits, as the reference."""

    base_model_prefix = "transformer"

    def __init__(self, vocab: int = 60, dim: int = 16, *, tie: bool = True, bias: bool = False, **config) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, **config)
        self.transformer = _FakeDecoder(vocab, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=bias)
        if tie:
            self.lm_head.weight = self.transformer.wte.weight

    @property
    def base_model(self) -> nn.Module:
        return getattr(self, self.base_model_prefix)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids, labels, attention_mask=None, num_items_in_batch=None):
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden).float()
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), shift_labels.view(-1), ignore_index=-100, reduction=reduction)
        return loss if num_items_in_batch is None else loss / num_items_in_batch


def _hf_batch(vocab=60):
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, vocab, (3, 11), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0  # right padding
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, :4] = -100  # a prompt not trained on
    return input_ids, attention_mask, labels


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("tie", "bias"), [(True, False), (False, True)])
@pytest.mark.parametrize("num_items_in_batch", [None, 17])
def test_hf_helper_matches_the_hf_causal_lm_loss(tie, bias, num_items_in_batch):
    torch.manual_seed(0)
    model = _FakeCausalLM(tie=tie, bias=bias)
    input_ids, attention_mask, labels = _hf_batch()
    expected = model(input_ids, labels, attention_mask, num_items_in_batch)
    expected.backward()
    expected_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    loss = hf_causal_lm_loss(model, input_ids, labels, attention_mask=attention_mask, chunk_size=4, num_items_in_batch=num_items_in_batch)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for name, grad in _grads(model).items():
        _close(grad, expected_grads[name], 1e-6)
    call = model.transformer.calls[-1]
    assert call["use_cache"] is False and call["attention_mask"] is attention_mask


def test_hf_helper_defaults_labels_to_the_inputs_without_padding():
    model = _FakeCausalLM()
    input_ids, attention_mask, _ = _hf_batch()
    expected = model(input_ids, input_ids.masked_fill(attention_mask == 0, -100), attention_mask)
    torch.testing.assert_close(hf_causal_lm_loss(model, input_ids, attention_mask=attention_mask), expected, rtol=1e-6, atol=0)
    unmasked = model(input_ids, input_ids)
    torch.testing.assert_close(hf_causal_lm_loss(model, input_ids, chunk_size=5, output_hidden_states=False), unmasked, rtol=1e-6, atol=0)
    assert model.transformer.calls[-1]["output_hidden_states"] is False


@pytest.mark.parametrize(("config", "attr"), [(dict(final_logit_softcapping=30.0), "final_logit_softcapping"), (dict(logit_scale=0.5), "logit_scale")])
def test_hf_helper_refuses_models_that_transform_their_logits(config, attr):
    model = _FakeCausalLM(**config)
    with pytest.raises(ValueError, match=f"`model.config.{attr}`"):
        hf_causal_lm_loss(model, _hf_batch()[0])
    # The neutral values are accepted.
    hf_causal_lm_loss(_FakeCausalLM(final_logit_softcapping=None, logit_scale=1.0), _hf_batch()[0])


def test_hf_helper_refuses_a_model_without_the_api():
    class NoBase(nn.Module):
        base_model = property(lambda self: self)

    with pytest.raises(ValueError, match="`model`"):
        hf_causal_lm_loss(NoBase(), _hf_batch()[0])
    model = _FakeCausalLM()
    model.get_output_embeddings = lambda: None
    with pytest.raises(ValueError, match="get_output_embeddings"):
        hf_causal_lm_loss(model, _hf_batch()[0])
