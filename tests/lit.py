"""A LightningModule around the shared test models."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from .helpers import QUIET_TRAINER
from .models import MODELS


class LitModel(L.LightningModule):
    def __init__(self, name: str, batch_size: int = 4, samples: int = 32) -> None:
        super().__init__()
        build, data, loss_fn = MODELS[name]
        torch.manual_seed(0)
        self.model = build()
        self.loss_fn = loss_fn
        self.batch_size = batch_size
        self._data = data(samples)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*self._data), batch_size=self.batch_size, shuffle=False)


def fit(name: str, strategy="auto", *, steps: int = 3, batch_size: int = 4, samples: int | None = None, **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    module = LitModel(name, batch_size=batch_size, samples=samples if samples is not None else max(32, batch_size * steps))
    kwargs = dict(accelerator="cpu", devices=1, max_steps=steps, num_sanity_val_steps=0, **QUIET_TRAINER)
    kwargs.update(trainer_kwargs)
    trainer = L.Trainer(strategy=strategy, **kwargs)
    trainer.fit(module)
    return module, trainer
