"""A pytest plugin that makes an automatic device choice fail, so tests that silently rely on
"no GPU here" show up on a CPU machine.

    pytest -p tests.pretend_gpu            # opt-in; the suite must pass under it too

Note [Tests say which device they mean]: on a machine with a GPU, Lightning's
``Trainer(accelerator="auto")`` (the default) trains on CUDA and Accelerate's ``Accelerator()``
(without ``cpu=True``) prepares the model on CUDA, while the tests' batches, meters and
expectations stay on the CPU: such a test passes on CI and fails on the GPU machine. Faking
CUDA itself is not possible on a CPU-only torch run, but those two automatic choices can be
intercepted: under this plugin each of them raises instead of choosing, so a test that does not
name its device fails here as it would there, and a test that does (``accelerator="cpu"``,
``cpu=True``, ``accelerate launch --cpu`` / ``ACCELERATE_USE_CPU``) runs exactly as without the
plugin. It reaches only this process (not the scripts tests start with ``subprocess``);
tests/house/test_suite_hygiene.py checks those statically.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

#: Where Lightning (and the standalone pytorch_lightning) resolve ``accelerator="auto"``.
_LIGHTNING_CONNECTORS = (
    "lightning.pytorch.trainer.connectors.accelerator_connector",
    "pytorch_lightning.trainer.connectors.accelerator_connector",
)


class AutoDeviceChoiceError(RuntimeError):
    """A test left the device to Lightning's or Accelerate's automatic choice."""


def _lightning_auto(*args: Any, **kwargs: Any) -> str:
    raise AutoDeviceChoiceError(
        "Trainer(accelerator='auto') would train on the GPU on a machine that has one; "
        "a test meant for the CPU passes accelerator='cpu' (Note [Tests say which device they mean])."
    )


def _accelerate_default_device(self: Any) -> Any:
    raise AutoDeviceChoiceError(
        "Accelerator() without cpu=True would prepare the model on the GPU on a machine that has one; "
        "a test meant for the CPU passes cpu=True, or launches with `accelerate launch --cpu` / "
        "ACCELERATE_USE_CPU=true (Note [Tests say which device they mean])."
    )


def _patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for every choice present in this environment."""
    found = []
    for module_name in _LIGHTNING_CONNECTORS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found.append((module._AcceleratorConnector, "_choose_auto_accelerator", staticmethod(_lightning_auto)))
    try:
        from accelerate.state import PartialState
    except ImportError:
        pass
    else:
        found.append((PartialState, "default_device", property(_accelerate_default_device)))
    return found


def install() -> Callable[[], None]:
    """Install the interceptions; returns the function that restores the originals."""
    saved = []
    for owner, name, replacement in _patches():
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, replacement)

    def restore() -> None:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
        saved.clear()

    return restore


_restore: list[Callable[[], None]] = []


def pytest_configure(config: Any) -> None:
    _restore.append(install())


def pytest_unconfigure(config: Any) -> None:
    while _restore:
        _restore.pop()()


def pytest_report_header(config: Any) -> str:
    return "pretend_gpu: Lightning's accelerator='auto' and Accelerate's default device raise (tests/pretend_gpu.py)"
