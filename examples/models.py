"""A model to try ``accelerate-swap estimate`` on, from the repository root::

    accelerate-swap estimate --model examples.models:build --input-shape 1024 --input-dtype int64 --budget 24GiB

``build()`` returns a GPT-2-small-sized decoder (12 layers, width 768, 12 heads, 1024
positions, a 50257-token vocabulary: about 124M parameters) whose input is a batch of token ids
``(batch, sequence)``. Its twelve blocks are identical modules in an ``nn.ModuleList``, which is
what the planner's automatic segment finder looks for; each is planned on its own.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Block", "GPT", "build"]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP, each residual, with
    dropout ``p`` on both branches (none at 0)."""

    def __init__(self, dim: int, heads: int, p: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.fc_out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p) if p else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and a head tied to the
    embedding; GPT-2 small by default. ``p``: dropout after the embeddings and in every block;
    ``scaled_init``: every linear weight drawn from N(0, 0.02 / sqrt(2 * layers)), the tied head
    (hence the embedding) included, after the default initialisation.

    The one GPT of the repository: the tests' tiny one (``tests/models.py``) and the benchmarks'
    (``benchmarks/plan_quality.py``) are this model at other sizes."""

    def __init__(
        self, *, vocab: int = 50257, dim: int = 768, heads: int = 12, layers: int = 12, seq: int = 1024, p: float = 0.0,
        scaled_init: bool = False,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.drop = nn.Dropout(p) if p else nn.Identity()
        self.blocks = nn.ModuleList([Block(dim, heads, p) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        if scaled_init:
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(idx))

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """The final hidden states, before the head (what a chunked loss takes)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def build(*, vocab: int = 50257, dim: int = 768, heads: int = 12, layers: int = 12, seq: int = 1024) -> GPT:
    """A GPT-2-small-sized model (the defaults); ``accelerate-swap estimate --model
    examples.models:build`` calls it with no arguments."""
    return GPT(vocab=vocab, dim=dim, heads=heads, layers=layers, seq=seq)
