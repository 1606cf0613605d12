"""A model to try ``accelerate-swap estimate`` on, from the repository root::

    accelerate-swap estimate --model examples.models:build --input-shape 1024 --input-dtype int64 --budget 24GiB

``build()`` returns a GPT-2-small-sized decoder (12 layers, width 768, 12 heads, 1024
positions, a 50257-token vocabulary: about 124M parameters) whose input is a batch of token ids
``(batch, sequence)``. Its twelve blocks are identical modules in an ``nn.ModuleList``, which is
what the planner's automatic segment finder looks for; each is planned on its own.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT", "build"]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP, each residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.fc_out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and a head tied to the embedding."""

    def __init__(self, *, vocab: int, dim: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(*, vocab: int = 50257, dim: int = 768, heads: int = 12, layers: int = 12, seq: int = 1024) -> GPT:
    """A GPT-2-small-sized model (the defaults); ``accelerate-swap estimate --model
    examples.models:build`` calls it with no arguments."""
    return GPT(vocab=vocab, dim=dim, heads=heads, layers=layers, seq=seq)
