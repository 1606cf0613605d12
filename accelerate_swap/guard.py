"""The Accelerate switch is never silently ignored: a plain ``Accelerator`` built while it is on
says so, once.

Note [A switch never silently ignored]: ``ACCELERATE_CPU_SWAP`` and ``ACCELERATE_CPU_SWAP_CONFIG``
are read by :class:`~accelerate_swap.SwapAccelerator`, and by nothing else: a loop that builds a
plain ``accelerate.Accelerator`` (``transformers.Trainer`` does, and so does any script not yet
switched to ``SwapAccelerator``) trains plain under them, with no sign that the switch did
nothing. Accelerate has no hook for third-party plugins, so on ``import accelerate_swap`` this
module wraps ``accelerate.Accelerator.__init__``: after an accelerator is built, if it is not a
``SwapAccelerator`` and the environment asks for the plugin (:meth:`SwapPlugin.from_env` returns
one, or raises: a broken setting is a request all the same), a WARNING says so and what to do.
Once (:attr:`PlainAcceleratorGuard.warned`), on the main process: the Trainer builds an
accelerator per hyperparameter trial, ``accelerate launch`` one per process, and one line says it.

The limit: the wrap exists only once ``accelerate_swap`` (or any of its modules) was imported. A
script that never imports it cannot be warned: nothing of the library runs in that process
(``import lightning_swap`` alone does not install it either: the Lightning package does not
import Accelerate). The environment is read when the accelerator is built, as
``SwapAccelerator`` reads it, so the two agree. :meth:`PlainAcceleratorGuard.remove` puts
Accelerate's own ``__init__`` back.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Optional

from accelerate import Accelerator

from .accelerator import SwapAccelerator
from .plugin import ENV_CONFIG, ENV_FLAG, SwapPlugin

__all__ = ["GUARD", "PlainAcceleratorGuard"]

log = logging.getLogger(__name__)


def _requested() -> Optional[str]:
    """What in the environment asks for the swap plugin (for the message), or ``None``."""
    try:
        if SwapPlugin.from_env() is None:
            return None
    except ValueError as err:  # a broken setting is still a request (SwapAccelerator would raise it)
        return f"{ENV_FLAG}/{ENV_CONFIG} (invalid: {err})"
    flag = os.environ.get(ENV_FLAG)
    return f"{ENV_FLAG}={flag}" if flag is not None else f"{ENV_CONFIG}={os.environ.get(ENV_CONFIG)}"


class PlainAcceleratorGuard:
    """Owns the wrap of ``accelerate.Accelerator.__init__`` (Note [A switch never silently
    ignored]); :meth:`install` and :meth:`remove`, or use it as a context manager."""

    def __init__(self) -> None:
        self._original: Optional[Callable[..., None]] = None
        #: The warning was given in this process (it is given once).
        self.warned = False

    @property
    def installed(self) -> bool:
        return self._original is not None

    def install(self) -> "PlainAcceleratorGuard":
        if self._original is not None:
            return self
        original = Accelerator.__init__
        guard = self

        @functools.wraps(original)  # keeps inspect.signature(Accelerator.__init__) Accelerate's
        def __init__(accelerator: Accelerator, *args: Any, **kwargs: Any) -> None:
            original(accelerator, *args, **kwargs)
            guard.check(accelerator)

        self._original = original
        Accelerator.__init__ = __init__
        return self

    def remove(self) -> None:
        """Put Accelerate's ``__init__`` back (a wrap installed over ours afterwards is left in
        place, and ours goes quiet: :meth:`check` runs only while installed)."""
        original, self._original = self._original, None
        if original is not None and getattr(Accelerator.__init__, "__wrapped__", None) is original:
            Accelerator.__init__ = original

    def check(self, accelerator: Accelerator) -> None:
        if self.warned or self._original is None or isinstance(accelerator, SwapAccelerator):
            return
        source = _requested()
        if source is None:
            return
        self.warned = True
        if not accelerator.is_main_process:
            return  # one line per job: every process of a launch builds its accelerator alike
        log.warning(
            "lightning-swap: %s asks for the swap plugin, but a plain %s was built: it trains without a plan. "
            "Build accelerate_swap.SwapAccelerator instead of accelerate.Accelerator; with transformers.Trainer, use "
            "accelerate_swap.hf.SwapTrainer (the Trainer builds its own Accelerator); or unset %s and %s. "
            "(Said once.)",
            source, type(accelerator).__name__, ENV_FLAG, ENV_CONFIG,
        )

    def __enter__(self) -> "PlainAcceleratorGuard":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()


#: The guard ``import accelerate_swap`` installs.
GUARD = PlainAcceleratorGuard()
