"""Lightning loops beyond one forward and one backward (Note [Lightning's step] in
``strategy_base.py``, Note [The budget held online] in ``core/runtime/online.py``): a SAM-style closure
optimizer (the closure called twice per step), LBFGS, manual optimization with two optimizers.
Every forced policy trains equal to plain; ``auto`` runs without a crash and keeps every whole
step (measured by a meter of the test's own, around all of the step's ``training_step`` calls
and optimizer steps) within its budget; the statistics of a fit survive ``predict``."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_swap import Action, CPUSwapStrategy
from lightning_swap.core import DeviceMemoryMeter, tensors_in

from ..helpers import POLICIES, QUIET_TRAINER
from ..lit import LitModel
from ..models import CNN, _images

STEPS = 3


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization in its usual two-pass form: the closure's gradients move the
    weights up the slope, the closure runs again there, the step is taken from the first point."""

    def __init__(self, params, lr: float = 0.05, rho: float = 0.05) -> None:
        super().__init__(params, dict(lr=lr, rho=rho))

    @torch.no_grad()
    def step(self, closure):
        with torch.enable_grad():
            loss = closure()
        for group in self.param_groups:
            norm = torch.sqrt(sum((p.grad**2).sum() for p in group["params"] if p.grad is not None)) + 1e-12
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["e"] = e = p.grad * (group["rho"] / norm)
                    p.add_(e)
        with torch.enable_grad():
            closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(self.state[p]["e"])
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


class ClosureModule(LitModel):
    def __init__(self, optimizer: str) -> None:
        super().__init__("cnn", batch_size=4, samples=4 * STEPS)
        self.optimizer_name = optimizer

    def configure_optimizers(self):
        if self.optimizer_name == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3, history_size=2)
        return SAM(self.parameters())


class GAN(L.LightningModule):
    """Two optimizers stepped inside one manual ``training_step`` (generator, then critic)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.gen = CNN()
        self.critic = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self._data = _images(4 * STEPS, 32)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_c = self.optimizers()
        fake = self.gen(x)
        loss_g = -self.critic(fake).mean()
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        loss_c = self.critic(self.gen(x).detach()).mean() - self.critic(torch.randn(4, 10)).mean()
        opt_c.zero_grad()
        self.manual_backward(loss_c)
        opt_c.step()

    def configure_optimizers(self):
        return torch.optim.Adam(self.gen.parameters(), lr=1e-3), torch.optim.Adam(self.critic.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*self._data), batch_size=4, shuffle=False)


class WholeStep(L.Callback):
    """A meter of the test's own from each batch's start to its end (every pass, every
    optimizer step), tracking what is alive before it as the strategy does."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.meter = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.meter = DeviceMemoryMeter("cpu").__enter__()
        params = list(module.parameters())
        states = [o.optimizer.state for o in trainer.optimizers] if hasattr(trainer.optimizers[0], "optimizer") else [o.state for o in trainer.optimizers]
        self.meter.track([*params, *(p.grad for p in params if p.grad is not None), *tensors_in(states), *tensors_in([batch])])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.meter.__exit__(None, None, None)
        self.peaks.append(self.meter.peak_bytes)


def _fit(module: L.LightningModule, strategy="auto"):
    L.seed_everything(0, verbose=False)
    whole = WholeStep()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS * (2 if isinstance(module, GAN) else 1), num_sanity_val_steps=0, callbacks=[whole], **QUIET_TRAINER
    )
    trainer.fit(module)
    return module, trainer, whole.peaks


BUILDERS = {"sam": lambda: ClosureModule("sam"), "lbfgs": lambda: ClosureModule("lbfgs"), "gan": GAN}


def _same(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    sa, sb = a.state_dict(), b.state_dict()
    return [k for k in sa if not torch.equal(sa[k], sb[k])]


@pytest.mark.slow
@pytest.mark.parametrize("loop", sorted(BUILDERS))
def test_every_policy_trains_these_loops_as_plain(loop):
    plain, _, _ = _fit(BUILDERS[loop]())
    for policy in POLICIES:
        swapped, trainer, peaks = _fit(BUILDERS[loop](), CPUSwapStrategy(policy=policy, log_plan=False))
        assert _same(plain, swapped) == [], policy
        # the strategy's window is the whole step: what the test's meter saw around it (which
        # also holds Lightning's own few bytes between the batch's start and training_step)
        measured = [s.peak_device_bytes for s in trainer.strategy.stats_history]
        assert len(measured) == len(peaks) == STEPS, policy
        assert all(abs(p - m) <= 4096 for m, p in zip(measured, peaks)), (policy, measured, peaks)


@pytest.mark.slow
@pytest.mark.parametrize("loop", sorted(BUILDERS))
def test_auto_keeps_every_whole_step_within_its_budget(loop, caplog):
    plain, _, plain_peaks = _fit(BUILDERS[loop]())
    _, _, least = _fit(BUILDERS[loop](), CPUSwapStrategy(policy="offload", log_plan=False))
    budget = (max(least) + max(plain_peaks)) // 2
    with caplog.at_level(logging.WARNING, logger="lightning_swap"):
        swapped, trainer, peaks = _fit(BUILDERS[loop](), CPUSwapStrategy(policy="auto", budget_bytes=budget, log_plan=False))
    assert _same(plain, swapped) == []
    assert len(peaks) == STEPS and max(peaks) <= budget, (peaks, budget)
    # several backward passes a step: each forward held within the budget, a plan that is not the
    # lowest-memory one where the budget has room (it had: halfway between offload's and plain's)
    assert set(trainer.strategy.plan.actions.values()) != {Action.OFFLOAD}, trainer.strategy.plan.summary()


def test_statistics_survive_predict():
    module, trainer, _ = _fit(LitModel("cnn", batch_size=4, samples=4 * STEPS), CPUSwapStrategy(policy="offload", log_plan=False))
    fitted = trainer.strategy.stats_history
    assert len(fitted) == STEPS
    x, _ = module._data
    trainer.predict(module, DataLoader(x[:8], batch_size=4))
    assert trainer.strategy.stats_history == fitted
    assert trainer.strategy.plan is not None
