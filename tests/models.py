"""Small models shared by the tests: each exercises something the runtime must get right."""

from __future__ import annotations

import torch
import torchvision
from torch import nn
from torch.nn import functional as F

from examples.models import GPT


def mlp_block(width: int) -> nn.Module:
    """Linear(W, 4W) -> GELU -> Linear(4W, W): saves 9 x B x W floats, returns B x W."""
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def mlp_chain(width: int = 64, depth: int = 6, classes: int = 10) -> nn.Module:
    """A chain of MLP blocks in an ``nn.Sequential`` (segments: the blocks and the head)."""
    return nn.Sequential(*[mlp_block(width) for _ in range(depth)], nn.Linear(width, classes))


class ConvBlock(nn.Module):
    """Conv + BatchNorm + in-place ReLU + Dropout + an in-place residual add."""

    def __init__(self, channels: int, p: float = 0.2) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(p)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.drop(self.relu(self.bn1(self.conv1(x))))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class CNN(nn.Module):
    def __init__(self, channels: int = 16, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(*[ConvBlock(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def cnn_bn_dropout(**kwargs) -> nn.Module:
    return CNN(**kwargs)


class TinyGPT(GPT):
    """The example's GPT (``examples/models.py``, the repository's one definition), small, with
    dropout and GPT-2's scaled initialisation: token + position embeddings, blocks in an
    ``nn.ModuleList``, tied head."""

    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 4, seq: int = 32, p: float = 0.1) -> None:
        super().__init__(vocab=vocab, dim=dim, heads=heads, layers=layers, seq=seq, p=p, scaled_init=True)


def tiny_gpt(**kwargs) -> nn.Module:
    return TinyGPT(**kwargs)


class Stem(nn.Module):
    """A high-resolution stem (32x32, 16 channels) pooled 4x before four blocks at 8x8: the
    regions outside the segments save far more than the segments (Note [Regions outside the
    segments] in ``measure/model_profile.py``; ``tests/scale/test_auto_shapes.py``, and on 2 FSDP2
    ranks ``tests/adapters/test_fsdp.py``)."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(4),
        )
        self.blocks = nn.Sequential(*[StemBlock(c) for _ in range(4)])
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


class StemBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


def resnet18_small(classes: int = 10) -> nn.Module:
    return torchvision.models.resnet18(num_classes=classes)


# Each entry: builder, a function making (inputs, targets) for a batch, and the loss.
def _images(batch: int, size: int, classes: int = 10):
    g = torch.Generator().manual_seed(batch * 1000 + size)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g)


def _vectors(batch: int, width: int = 64, classes: int = 10):
    g = torch.Generator().manual_seed(batch)
    return torch.randn(batch, width, generator=g), torch.randint(0, classes, (batch,), generator=g)


def _tokens(batch: int, seq: int = 32, vocab: int = 128):
    g = torch.Generator().manual_seed(batch + seq)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


MODELS = {
    "mlp": (mlp_chain, lambda b: _vectors(b), F.cross_entropy),
    "cnn": (cnn_bn_dropout, lambda b: _images(b, 16), F.cross_entropy),
    "gpt": (tiny_gpt, lambda b: _tokens(b), lm_loss),
    "resnet18": (resnet18_small, lambda b: _images(b, 32), F.cross_entropy),
}
