"""Profiling the training step that runs anyway.

Note [Observe, do not re-run]: ``policy="auto"`` needs a profile of the model's step, and the
first version made one by calling the user's step function again, several times (a real
step, two timing steps, two fake-mode steps, and as many again once the optimizer state
appeared). Side effects ran again — counters, metric updates, ``self.log``, lists the user
appends to — and a step that calls ``.item()`` broke fake mode. Here the adapters let the
first training step run as it would (every segment kept, inside the precision plugin's
context, the user's own loss and optimizer step included) and observe it
(:class:`~.trace.StepTracer`); the segments are then timed on their own under each action
(:mod:`.costs`, no user code), and the plan for the steps that follow is solved from that
profile, shifted to the steady state (Note [Steady-state shift] in ``profiler.py``). The user's
step runs exactly as often as in plain training.

Note [Observe every rank]: under FSDP every process runs every collective of the step (the
gathers of each unit's parameters, the gradients' reduce-scatters), so nothing that runs the
model may run on one process alone: the segments of a sharded model are not timed on their own
afterwards (``time_actions`` is off: recomputation is priced from the forward's time, and a
forward's working set without saved tensors is taken as the kept one's, which never
under-predicts: on CPU an offloading segment's forward is priced up to its saved bytes over,
measured 5% of the peak on the tests' GPT at batch 8), and every process observes the same step. What each measured is its own (its
shards, the units it gathered); the plan is made from the largest of every process's
measurements (:func:`~.model_profile.max_profile`), so it fits the fullest rank.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from .action_costs import measure_action_costs
from ..compiled import compile_context, is_compiled
from ..segments import split_call
from .model_profile import SELECTIVE_REFUSAL, ModelProfile
from ..tensors import infer_batch_size
from .profiler import assemble, selective_choice
from ..tensors import tensors_in
from ..engine.streams import StreamOps, default_ops
from .trace import StepTracer, boundary_keys, region_times
from ..sharded import is_sharded

__all__ = ["ObservedStep"]

log = logging.getLogger(__name__)


class ObservedStep:
    """One real training step, traced while it runs, and the profile it yields.

    ``begin()`` before the forward, ``backward_begins()`` before the loss's backward,
    ``backward_done()`` after it, ``finish()`` once the step (optimizer step included) is over;
    ``abort()`` on failure. ``track`` is what is alive before the step besides the model (the
    batch, the optimizer state), nested in containers.
    """

    def __init__(
        self,
        model: nn.Module,
        names: list[str],
        *,
        device: torch.device,
        batch: Any,
        track: Any,
        min_offload_bytes: int,
        modules: Optional[dict[str, nn.Module]] = None,
        ops: Optional[StreamOps] = None,
        time_actions: bool = True,
    ) -> None:
        self.model = model
        self.names = list(names)
        self.device = device
        self.min_offload_bytes = min_offload_bytes
        self.batch_size = infer_batch_size(batch)
        self.ops = ops if ops is not None else default_ops(device)
        self.modules = modules if modules is not None else dict(model.named_modules())
        self.time_actions = time_actions and not is_sharded(model)  # Note [Observe every rank]
        params = list(model.parameters())
        static = [*params, *model.buffers(), *(p.grad for p in params if p.grad is not None), *tensors_in([batch, track])]
        self.tracer = StepTracer(
            model, self.names, device=device, static=static, params=params, fake=False,
            min_offload_bytes=min_offload_bytes, ops=self.ops, capture_inputs=self.time_actions,
        )
        self.open = False
        self.backward_over = False

    @property
    def meter(self):
        return self.tracer.meter

    def begin(self) -> "ObservedStep":
        self.tracer.begin()
        self.open = True
        return self

    def backward_begins(self) -> None:
        self.tracer.backward_begins()

    def backward_done(self) -> None:
        self.tracer.backward_done()
        self.backward_over = True

    def abort(self) -> None:
        if self.open:
            self.open = False
            self.tracer.abort()

    def _modules_of(self, names: list[str]) -> dict[str, nn.Module]:
        return {name: self.modules.get(name) or self.modules[split_call(name)[0]] for name in names}

    def _compiled(self, name: str) -> str:
        """Note [Selective under compile]: a compiled segment's selective is refused for planning."""
        module_name = split_call(name)[0]
        module = self.modules.get(module_name)
        if compile_context(self.model, module_name) is not None or (module is not None and is_compiled(module)):
            return f"{SELECTIVE_REFUSAL} compiled, it would recompute everything (Note [Selective under compile])"
        return ""

    def finish(self) -> ModelProfile:
        """Close the trace, time each segment's actions, and build the profile."""
        self.open = False
        trace = self.tracer.finish()
        names = trace.names  # one per call of a module run several times (Note [A segment per call])
        marks = trace.marks
        n = len(names)
        end = marks.get("end", 0.0)
        fwd = {i: max(marks.get(("fe", i), 0.0) - marks.get(("fs", i), 0.0), 0.0) for i in range(n)}
        bwd = {i: max(marks.get(("be", i), end) - marks.get(("bs", i), end), 0.0) for i in range(n)}
        outside = max(end - sum(fwd.values()) - sum(bwd.values()), 0.0)
        order = [names.index(name) for name in trace.order]
        regions = region_times(marks, order, end)
        measured: dict[int, tuple[Optional[float], Optional[float], int, str]] = {}
        if self.time_actions and trace.inputs:
            calls = {names[i]: call for i, call in trace.inputs.items()}
            save_ops = {  # Note [Which ops selective recomputation saves]: timed as the plan will run it
                names[i]: selective_choice(trace.ops[i], set(boundary_keys(trace, order, i)), frozenset(trace.mutated))[0]
                for i in trace.inputs if trace.ops.get(i)
            }
            costs = measure_action_costs(self.model, self._modules_of(names), calls, self.ops, device=self.device, save_ops=save_ops)
            for i, name in enumerate(names):
                c = costs.get(name)
                if c is not None:
                    fwd[i], bwd[i] = c.forward_ms, c.backward_ms
                    measured[i] = (c.recompute_ms, c.selective_ms, c.released_working_bytes, c.refusal or self._compiled(name))
        heavy = {i: fwd[i] * trace.heavy_op_ms.get(i, 0.0) / max(trace.all_op_ms.get(i, 0.0), 1e-9) for i in range(n)}
        step_ms = outside + sum(fwd.values()) + sum(bwd.values())
        profile = assemble(
            trace, self.model, names, batch_size=self.batch_size, device=self.device, fake=False,
            min_offload_bytes=self.min_offload_bytes, fwd={**fwd, **{k: v[0] for k, v in regions.items()}},
            bwd={**bwd, **{k: v[1] for k, v in regions.items()}}, heavy=heavy, step_ms=step_ms, measured=measured,
        )
        log.debug("observed a step at batch %d: peak %d bytes, %.1f ms", self.batch_size, profile.peak_bytes, step_ms)
        return profile
