"""``accelerate-swap estimate``: a plan and the largest batch for a model, without training.

In the manner of ``accelerate estimate-memory``: nothing is trained and no weights are
downloaded (torchvision models are built with ``weights=None``). One training step is profiled
in fake mode (``FakeTensorMode``: shapes and storages, no arithmetic; Note [Fake-mode times are
estimates] in ``lightning_swap/core/measure/profiler.py``) at the given batch and at twice it, which
fixes how every byte count grows with the batch (Note [Batch scaling]). Then, by predictions
only, ``solve`` gives the plan at that batch, and the bisection of the batch-size search
(:func:`lightning_swap.core.scale.batch_search.predict_batch_size`) the largest batch with a plan under the
budget.

Note [What the estimate profiles]: a training step as a loop runs it, as far as a command line
can say: the model's forward on a batch of the given shape under ``--precision`` (autocast for
the mixed precisions), the loss (``--loss``: cross-entropy of the output's last dimension
against class 0, the classifier's and the language model's loss, in float32 as autocast does;
or the output summed), the backward, with the optimizer's state alive throughout (``--optimizer``:
none for plain SGD, one copy of the parameters for SGD with momentum, two for Adam and AdamW;
added as Note [Steady-state shift] adds state). Not profiled, and said so in the first line of
the output: the optimizer step's own temporaries (foreach AdamW: about one parameter-sized
buffer), and whatever the user's loop adds beside the step (metrics, EMA weights).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_swap.core import Action
from lightning_swap.core import InfeasibleBudgetError
from lightning_swap.core import Plan, format_bytes
from lightning_swap.core import ModelProfile
from lightning_swap.core import profile
from lightning_swap.core import DEFAULT_MIN_OFFLOAD_BYTES
from lightning_swap.core import ScaleConfig, predict_batch_size
from lightning_swap.core import SegmentSpec
from lightning_swap.core import min_budget_bytes, solve
from lightning_swap.core import ByteSize, import_object, parse_bytes

__all__ = ["Estimate", "build_model", "estimate"]

#: Input dtypes ``--input_dtype`` accepts; integers are token ids (all zero: fake mode never reads them).
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
#: ``--precision`` -> the autocast dtype of the forward (``None``: none), as Lightning names them.
PRECISIONS = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
#: ``--optimizer`` -> (its name in the output, copies of the parameters its state holds).
OPTIMIZERS = {"none": ("no optimizer state", 0), "sgd": ("SGD (no state)", 0), "momentum": ("SGD with momentum state (1 x parameters)", 1),
              "adam": ("Adam state (2 x parameters)", 2), "adamw": ("AdamW state (2 x parameters)", 2)}
LOSSES = ("cross_entropy", "sum")


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What ``estimate`` predicts; :meth:`render` is the text the command prints."""

    model_name: str
    input_shape: tuple[int, ...]  # one sample's
    input_dtype: str
    batch_size: int
    budget_bytes: Optional[int]
    margin: float
    #: What the profiled step ran besides the forward and backward (Note [What the estimate profiles]).
    precision: str
    loss: str
    optimizer: str
    profile: ModelProfile
    #: The least budget any plan meets at ``batch_size``.
    min_budget_bytes: int
    #: The plan at ``batch_size`` (``None`` without a budget, or when none fits it).
    plan: Optional[Plan]
    #: The plan at the largest batch that fits (its ``batch_size``); ``None`` as above.
    largest: Optional[Plan]
    max_batch_size: int
    profile_s: float

    def render(self) -> str:
        p = self.profile
        shape = ", ".join(str(d) for d in (self.batch_size, *self.input_shape))
        loss = "cross-entropy loss" if self.loss == "cross_entropy" else "the output summed as the loss"
        lines = [
            f"Training-step memory for `{self.model_name}`, input ({shape}) {self.input_dtype}, {self.precision}, {loss}, "
            f"{OPTIMIZERS[self.optimizer][0]}; not counted: the optimizer step's temporaries "
            f"(profiled in fake mode in {self.profile_s:.1f} s: no arithmetic, no weights)",
            f"  parameters {format_bytes(p.parameter_bytes)}, {len(p.segments)} segments",
            f"  plain step at batch {self.batch_size} (every segment kept): peak {format_bytes(p.peak_bytes)}",
            f"  least budget of any plan at batch {self.batch_size}: {format_bytes(self.min_budget_bytes)}",
        ]
        if self.budget_bytes is None:
            lines.append("Give --budget (e.g. 8GiB) for a plan and the largest batch.")
            return "\n".join(lines)
        budget = format_bytes(self.budget_bytes)
        lines.append("")
        if self.plan is not None:
            lines += [f"Plan at batch {self.batch_size} for a budget of {budget} (margin {self.margin:.0%}):", self.plan.render()]
        else:
            lines.append(
                f"Batch {self.batch_size} does not fit {budget} with any plan: it needs at least "
                f"{format_bytes(self.min_budget_bytes)}."
            )
        lines.append("")
        if self.largest is not None:
            lines.append(
                f"Largest batch for {budget} (margin {self.margin:.0%}): {self.largest.batch_size}, "
                f"plan {self.largest.summary()}, predicted peak {format_bytes(self.largest.predicted_peak_bytes)}"
            )
        else:
            lines.append(f"No batch in [1, {self.max_batch_size}] fits {budget} (margin {self.margin:.0%}) with any plan.")
        lines.append(
            "Bytes are those of the profiled step (forward, loss, backward, with the optimizer state alive); "
            "times are CPU roofline estimates, for ranking plans only."
        )
        return "\n".join(lines)


def _check_choices(**choices: tuple[str, Any]) -> None:
    """Each ``field=(value, allowed)``: ``ValueError`` naming the field and what is allowed."""
    for field, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"`{field}` got {value!r}; allowed: {', '.join(allowed)}.")


def _profile_step(model: nn.Module, batch: torch.Tensor, precision: str, loss: str, optimizer: str, **kwargs: Any) -> ModelProfile:
    """Note [What the estimate profiles]: one training step in fake mode, the optimizer state alive."""
    model.train()
    prof = profile(model, batch, step_fn=_training_step(PRECISIONS[precision], loss), fake=True, scale=True, device="cpu", **kwargs)
    state = OPTIMIZERS[optimizer][1] * sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    return prof.with_state(forward_bytes=state, backward_bytes=state)  # alive throughout (Note [Steady-state shift])


def _training_step(autocast_dtype: Optional[torch.dtype], loss: str) -> Callable[[nn.Module, Any], torch.Tensor]:
    """Note [What the estimate profiles]: the forward under autocast, then the loss."""

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            out = model(batch)
        out = getattr(out, "logits", out)  # a transformers ModelOutput
        tensors = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
        first = tensors[0]
        if loss == "sum" or first.dim() < 2 or not first.is_floating_point():
            return sum(t.float().sum() for t in tensors if t.is_floating_point())
        logits = first.reshape(-1, first.shape[-1]).float()
        return torch.nn.functional.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))

    return step


def build_model(spec: str, *, source: str = "model") -> nn.Module:
    """A torchvision model by name (``weights=None``), or a factory called with no arguments:
    ``package.module:factory`` or ``path/to/file.py:factory``; ``ValueError`` naming ``source``
    otherwise."""
    if ":" in spec:
        target, _, name = spec.rpartition(":")
        factory = _from_file(target, name, spec, source) if target.strip().endswith(".py") else import_object(spec, source)
        if not callable(factory):
            raise ValueError(f"`{source}` names {spec!r}, which is not callable.")
        try:
            model = factory()
        except TypeError as err:  # it wants arguments
            raise ValueError(f"`{source}`: {spec!r} cannot be called with no arguments ({err}).") from err
        if not isinstance(model, nn.Module):
            raise ValueError(f"`{source}`: {spec!r}() returned {type(model).__name__}; allowed: a factory returning an nn.Module.")
        return model
    import torchvision

    names = torchvision.models.list_models()
    if spec not in names:
        raise ValueError(
            f"`{source}` got {spec!r}; allowed: a torchvision model name (e.g. resnet50, vit_b_16; see "
            "torchvision.models.list_models()), 'package.module:factory' or 'path/to/file.py:factory'."
        )
    return torchvision.models.get_model(spec, weights=None)


def _from_file(path: str, name: str, spec: str, source: str) -> Any:
    """``name`` in the Python file at ``path``, run as a module of its own (as ``python path``
    would run it: its directory importable while it loads)."""
    file = Path(path.strip()).expanduser()
    if not file.is_file():
        raise ValueError(f"`{source}` names {spec!r}, but there is no file {str(file)!r}.")
    module_name = f"_accelerate_swap_model_{file.stem}"
    loader_spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    directory = str(file.resolve().parent)
    added = directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise ValueError(f"`{source}` names {spec!r}, which cannot be loaded ({type(err).__name__}: {err}).") from err
    finally:
        if added:
            sys.path.remove(directory)
    obj: Any = module
    try:
        for part in name.strip().split("."):
            obj = getattr(obj, part)
    except AttributeError as err:
        raise ValueError(f"`{source}` names {spec!r}, which cannot be imported ({err}).") from err
    return obj


def estimate(
    model: nn.Module,
    *,
    batch_size: int,
    input_shape: tuple[int, ...],
    input_dtype: str = "float32",
    budget_bytes: Optional[ByteSize] = None,
    policy: str = "auto",
    segments: SegmentSpec = None,
    margin: float = 0.05,
    max_batch_size: int = 8192,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    model_name: str = "model",
    precision: str = "32-true",
    loss: str = "cross_entropy",
    optimizer: str = "adamw",
    clock: Callable[[], float] = time.perf_counter,
) -> Estimate:
    """Profile ``model`` in fake mode at ``batch_size`` and predict (module docstring; Note
    [What the estimate profiles] for ``precision``, ``loss`` and ``optimizer``).

    ``budget_bytes``: bytes as an ``int`` or a size string (``"24GiB"``); ``None`` for the
    profile alone."""
    budget_bytes = parse_bytes(budget_bytes, field="budget_bytes", allow_none=True)
    _check_choices(
        input_dtype=(input_dtype, DTYPES), precision=(precision, PRECISIONS), loss=(loss, LOSSES), optimizer=(optimizer, OPTIMIZERS),
    )
    actions = None if policy == "auto" else (Action.parse(policy, field="policy"),)
    config = ScaleConfig(margin=margin, min_batch_size=1, max_batch_size=max_batch_size)
    batch = torch.zeros((batch_size, *input_shape), dtype=DTYPES[input_dtype])
    start = clock()
    prof = _profile_step(model, batch, precision, loss, optimizer, segments=segments, min_offload_bytes=min_offload_bytes)
    profile_s = clock() - start
    plan = largest = None
    if budget_bytes is not None:
        try:
            plan = solve(prof, budget_bytes=int(budget_bytes * (1 - margin)), actions=actions)
        except InfeasibleBudgetError:
            plan = None
        largest = predict_batch_size(prof, budget_bytes, config, actions=actions)
    return Estimate(
        model_name=model_name,
        input_shape=tuple(input_shape),
        input_dtype=input_dtype,
        batch_size=batch_size,
        budget_bytes=budget_bytes,
        margin=margin,
        precision=precision,
        loss=loss,
        optimizer=optimizer,
        profile=prof,
        min_budget_bytes=min_budget_bytes(prof, actions=actions),
        plan=plan,
        largest=largest,
        max_batch_size=max_batch_size,
        profile_s=profile_s,
    )
