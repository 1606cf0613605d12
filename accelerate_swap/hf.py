"""``SwapTrainer``: Hugging Face ``transformers.Trainer`` trained through a
:class:`~accelerate_swap.SwapAccelerator`.

::

    from accelerate_swap.hf import SwapTrainer
    trainer = SwapTrainer(model=model, args=args, train_dataset=data)   # was: Trainer(...)

switched on as ``SwapAccelerator`` is: ``swap_plugin=SwapPlugin(...)``, else ``ACCELERATE_CPU_SWAP``
or the file in ``ACCELERATE_CPU_SWAP_CONFIG``. Another ``Trainer`` subclass (TRL's ``SFTTrainer``)
takes the mixin: ``class SwapSFTTrainer(SwapTrainerMixin, SFTTrainer): pass``.

Note [The Trainer builds its own Accelerator]: ``Trainer.__init__`` calls
``create_accelerator_and_postprocess``, which gathers its arguments (gradient accumulation, data
loader configuration, DDP and dynamo plugins, FSDP/DeepSpeed) and builds
``Accelerator(**args)`` from the name ``Accelerator`` in ``transformers.trainer``'s namespace,
then sets the Trainer's flags from it. The one-line switch a Hugging Face user expects is a
``Trainer`` subclass (as ``Seq2SeqTrainer`` and TRL's trainers are), and the least it can
override is that method: it runs the Trainer's own, with the module's ``Accelerator`` name
pointing at ``SwapAccelerator`` for the length of the call (try/finally), so every argument the
Trainer passes, in any version that builds its accelerator this way, reaches it unchanged;
copying the method would freeze one version of it. A callback comes too late (the accelerator
exists before the first callback event) and a function replacing the name for good would switch
every Trainer in the process. Three things are checked rather than assumed: the name exists
before, the Trainer holds a ``SwapAccelerator`` after, and each training step's model was
prepared by it (:meth:`SwapTrainerMixin.training_step`), so a transformers that builds its
accelerator another way, or a model the Trainer wraps itself, raises instead of training
plain. (The name is module-global: a plain
``Trainer`` built in another thread during the call would get a ``SwapAccelerator``; switched off,
that is ``Accelerator`` itself.)

Note [One activation policy in the Trainer]: ``TrainingArguments(gradient_checkpointing=True)``
(``activation_checkpointing`` in transformers 5) makes ``train()`` checkpoint every block, and the
swap plugin's plan decides the same blocks' activations: two owners. The runtime never applies
both, nor composes them (``policy="recompute"`` already is checkpointing of every block, and what a
user meant by both is not clear): the pair is refused when the Trainer builds its accelerator,
with an error naming both, and so is a model handed to the Trainer with its own checkpointing on
(``model.gradient_checkpointing_enable()``: Note [A model that checkpoints itself] in
``lightning_swap/core/segments.py``, the check every front end's session makes).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import transformers
import transformers.trainer as trainer_module
from transformers import Trainer, TrainingArguments
from typing_extensions import override

from lightning_swap.core import refuse_own_checkpointing

from .accelerator import SwapAccelerator
from .plugin import ENV_CONFIG, ENV_FLAG, SwapPlugin

__all__ = ["SwapTrainer", "SwapTrainerMixin"]

log = logging.getLogger(__name__)


_SWITCH_OFF = f"switch the swap plugin off (no swap_plugin, {ENV_FLAG} unset or false, no {ENV_CONFIG})"


def check_one_activation_policy(args: TrainingArguments, model: Any) -> None:
    """Note [One activation policy in the Trainer]: refuse the Trainer's, or the model's, own
    activation checkpointing beside a swap plugin."""
    names = [n for n in ("gradient_checkpointing", "activation_checkpointing") if getattr(args, n, None)]
    if names:
        given = " / ".join(f"{n}=True" for n in names)  # transformers 5 sets both when one is given
        raise ValueError(
            f"TrainingArguments({given}) and the swap plugin's policy would both decide each block's "
            f"activations (the plan's action would do nothing in a checkpointed block); pass one of them: {names[0]}=False with the swap plugin "
            f"(SwapPlugin(policy='recompute') checkpoints every block, policy='auto' chooses per block), or {_SWITCH_OFF}."
        )
    if model is not None:  # what every front end's session refuses, here before the Trainer builds anything
        refuse_own_checkpointing(model, library_off=_SWITCH_OFF)


class SwapTrainerMixin:
    """Makes a ``transformers.Trainer`` (sub)class train through
    :class:`~accelerate_swap.SwapAccelerator` (Note [The Trainer builds its own Accelerator]).

    ``swap_plugin``: the options; ``None`` reads ``ACCELERATE_CPU_SWAP*`` and the config file as
    ``SwapAccelerator`` does (switched off there, the Trainer is plain). The plan, statistics and
    session are the accelerator's: ``trainer.accelerator.swap_plan``, ``.swap_step_stats``.
    """

    def __init__(self, *args: Any, swap_plugin: Optional[SwapPlugin] = None, **kwargs: Any) -> None:
        if swap_plugin is not None and not isinstance(swap_plugin, SwapPlugin):
            raise ValueError(f"`swap_plugin` must be a SwapPlugin or None; got {swap_plugin!r}.")
        self._swap_plugin_given = swap_plugin
        super().__init__(*args, **kwargs)

    @override
    def create_accelerator_and_postprocess(self) -> None:
        plugin = self._swap_plugin_given if self._swap_plugin_given is not None else SwapPlugin.from_env()
        if plugin is None:
            log.info("SwapTrainer: the swap plugin is off (no swap_plugin, %s not on): training plain.", ENV_FLAG)
        else:
            check_one_activation_policy(self.args, self.model)
        if not hasattr(trainer_module, "Accelerator"):
            raise RuntimeError(_unsupported("has no name `Accelerator` to build it from"))
        original = trainer_module.Accelerator
        trainer_module.Accelerator = functools.partial(SwapAccelerator, swap_plugin=plugin)
        try:
            super().create_accelerator_and_postprocess()  # type: ignore[misc]
        finally:
            trainer_module.Accelerator = original
        if not isinstance(self.accelerator, SwapAccelerator):
            raise RuntimeError(_unsupported(f"built a {type(self.accelerator).__name__}"))

    @override
    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """Note [The Trainer builds its own Accelerator]: the plan reaches the model only through
        ``accelerator.prepare``; a Trainer that trains a model it did not prepare (``DataParallel``
        when one process sees several GPUs, a model sharded at load time) would train it plain."""
        accelerator = self.accelerator
        if accelerator.swap_enabled and accelerator.swap_session is None:
            raise RuntimeError(
                "SwapTrainer: the swap plugin is on, but the Trainer trains a model it did not prepare through its "
                f"accelerator (n_gpu={self.args.n_gpu}: torch.nn.DataParallel when one process sees several GPUs; or a "
                "model sharded when loaded), so it would train without a plan. Launch one process per device "
                "(accelerate launch, torchrun), or switch the swap plugin off."
            )
        return super().training_step(model, inputs, *args, **kwargs)  # type: ignore[misc]


def _unsupported(what: str) -> str:
    return (
        f"SwapTrainer: transformers {transformers.__version__}'s Trainer {what}, not the SwapAccelerator it was "
        "given (Note [The Trainer builds its own Accelerator] in accelerate_swap/hf.py); the swap plugin cannot "
        "reach it. Use SwapAccelerator in your own loop."
    )


class SwapTrainer(SwapTrainerMixin, Trainer):
    """``transformers.Trainer`` training through :class:`~accelerate_swap.SwapAccelerator`:
    ``SwapTrainer(model=..., args=..., swap_plugin=SwapPlugin(...))``, or with ``swap_plugin``
    left out, switched by ``ACCELERATE_CPU_SWAP`` / ``ACCELERATE_CPU_SWAP_CONFIG``."""
