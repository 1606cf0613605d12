"""The test suite names the device it means (Note [Tests say which device they mean] in
tests/pretend_gpu.py), read from the source with ``ast``: every test module, helper and script
under tests/.

- ``Trainer(...)`` (``L.Trainer``, ``pl.Trainer``, ...) passes ``accelerator=``, or ``**name``
  where ``name`` is a ``dict(...)`` / ``{...}`` built in the same function that sets it (the way
  tests/lit.py's ``fit`` and tests/scale/test_scale.py's ``_trainer`` default to ``"cpu"``);
- ``Accelerator(...)`` / ``SwapAccelerator(...)`` passes ``cpu=`` (the same ``**name`` rule);
- ``SwapRuntime(...)``, ``profile(...)`` and ``DeviceMemoryMeter(...)`` from lightning_swap get
  their device explicitly (``device=``; the meter's first argument);
- a function that starts ``accelerate launch`` in a subprocess says ``--cpu`` or
  ``ACCELERATE_USE_CPU``;

except inside a test marked ``cuda`` (or a module whose ``pytestmark`` is), which means the GPU.
The checker itself is tested on small sources first, so it can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

#: constructor name -> the keyword that names the device
_DEVICE_KEYWORD = {"Trainer": "accelerator", "Accelerator": "cpu", "SwapAccelerator": "cpu"}
#: lightning_swap names that take ``device=``; resolved through imports (``profile as run_profile``)
_DEVICE_ARGUMENT = {"SwapRuntime", "profile", "DeviceMemoryMeter"}
_SUBPROCESS = {"run", "Popen", "call", "check_call", "check_output"}


def _marked_cuda(decorators: list[ast.expr]) -> bool:
    """``@pytest.mark.cuda`` (called or not) among the decorators."""
    for d in decorators:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "cuda":
            return True
    return False


def _module_marked_cuda(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            if _marked_cuda(values):
                return True
    return False


def _callee(call: ast.Call) -> Optional[str]:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _lightning_swap_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> lightning_swap name, for the functions in ``_DEVICE_ARGUMENT``."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightning_swap":
            for alias in node.names:
                if alias.name in _DEVICE_ARGUMENT:
                    names[alias.asname or alias.name] = alias.name
    return names


def _dict_keys(node: ast.expr) -> Optional[set[str]]:
    """The string keys of ``dict(a=...)`` / ``{"a": ...}``; None if ``node`` is neither."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return {k.arg for k in node.keywords if k.arg is not None}
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return None


def _sets_keyword(call: ast.Call, keyword: str, scope: ast.AST) -> bool:
    """``keyword=`` given, or ``**name`` where ``name`` is assigned, in ``scope``, a dict literal
    holding it (a ``**kwargs`` parameter does not count: its source is the caller)."""
    if any(k.arg == keyword for k in call.keywords):
        return True
    for k in call.keywords:
        if k.arg is not None:
            continue
        if _dict_keys(k.value) is not None and keyword in _dict_keys(k.value):
            return True
        if isinstance(k.value, ast.Name):
            for node in ast.walk(scope):
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == k.value.id for t in node.targets):
                    keys = _dict_keys(node.value)
                    if keys is not None and keyword in keys:
                        return True
    return False


def _strings(node: ast.AST) -> Iterator[str]:
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            yield n.value


def _launches_accelerate(function: ast.AST) -> bool:
    calls_subprocess = any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _SUBPROCESS
        and isinstance(n.func.value, ast.Name) and n.func.value.id == "subprocess"
        for n in ast.walk(function)
    )
    return calls_subprocess and any("accelerate.commands.launch" in s or s.startswith("accelerate launch") for s in _strings(function))


def problems(source: str, filename: str = "<test>", *, kinds: tuple[str, ...] = ("auto", "inferred")) -> list[str]:
    """Every place in ``source`` that does not name its device: ``"auto"``, a Trainer,
    Accelerator or ``accelerate launch`` left to choose (on a GPU machine: the GPU);
    ``"inferred"``, a runtime, profile or meter whose device comes from the model."""
    tree = ast.parse(source, filename)
    if _module_marked_cuda(tree):
        return []
    swap_names = _lightning_swap_names(tree)
    found: list[str] = []

    def report(kind: str, message: str) -> None:
        if kind in kinds:
            found.append(message)

    def visit(node: ast.AST, scope: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if _marked_cuda(node.decorator_list):
                return
            if not isinstance(node, ast.ClassDef):
                scope = node
                if _launches_accelerate(node) and not any(s == "--cpu" or s == "ACCELERATE_USE_CPU" for s in _strings(node)):
                    report("auto", f"{filename}:{node.lineno}: {node.name} starts `accelerate launch` without --cpu or ACCELERATE_USE_CPU")
        if isinstance(node, ast.Call):
            name = _callee(node)
            if name in _DEVICE_KEYWORD and not _sets_keyword(node, _DEVICE_KEYWORD[name], scope):
                report("auto", f"{filename}:{node.lineno}: {name}(...) without {_DEVICE_KEYWORD[name]}=")
            elif isinstance(node.func, ast.Name) and node.func.id in swap_names:
                real = swap_names[node.func.id]
                given = _sets_keyword(node, "device", scope) or (real == "DeviceMemoryMeter" and node.args)
                if not given:
                    report("inferred", f"{filename}:{node.lineno}: {node.func.id}(...) without device=")
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, tree)
    return found


# -- the checker, on small sources ------------------------------------------------------------
_CHECKER_CASES = [
    # source, how many problems
    ("import lightning as L\nL.Trainer(max_steps=1)", 1),
    ("from lightning import Trainer\nTrainer(accelerator='cpu')", 0),
    ("import pytorch_lightning as pl\npl.Trainer(accelerator='gpu', devices=1)", 0),
    ("def fit(**kw):\n    kwargs = dict(accelerator='cpu')\n    kwargs.update(kw)\n    return L.Trainer(**kwargs)", 0),
    ("def fit(**kw):\n    kwargs = dict(devices=1)\n    kwargs.update(kw)\n    return L.Trainer(**kwargs)", 1),
    ("def fit(**kwargs):\n    return L.Trainer(max_steps=1, **kwargs)", 1),
    ("def t():\n    opts = {'accelerator': 'cpu'}\n    L.Trainer(**opts)", 0),
    ("SwapAccelerator()", 1),
    ("SwapAccelerator(cpu=True, swap_plugin=p)", 0),
    ("from accelerate import Accelerator\nAccelerator(mixed_precision='bf16')", 1),
    ("@pytest.mark.cuda\ndef test_gpu():\n    SwapAccelerator()\n    L.Trainer()", 0),
    ("@pytest.mark.parametrize('a', [1])\n@pytest.mark.cuda\ndef test_gpu(a):\n    Accelerator()", 0),
    ("import pytest\npytestmark = pytest.mark.cuda\nAccelerator()", 0),
    ("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.cuda]\nL.Trainer()", 0),
    ("from lightning_swap import SwapRuntime\nSwapRuntime(model, plan)", 1),
    ("from lightning_swap import SwapRuntime\nSwapRuntime(model, plan, device='cpu')", 0),
    ("from lightning_swap.core import profile as run_profile\nrun_profile(model, batch)", 1),
    ("from lightning_swap.core import profile\nprofile(model, batch, device=device)", 0),
    ("from lightning_swap.core import profile\nloop.profile(8)", 0),  # a method, not the profiler
    ("from lightning_swap.core import DeviceMemoryMeter\nDeviceMemoryMeter('cpu')", 0),
    ("from lightning_swap.core import DeviceMemoryMeter\nDeviceMemoryMeter()", 1),
    ("from elsewhere import SwapRuntime\nSwapRuntime(m, p)", 0),  # not ours
    ("import subprocess\ndef go():\n    subprocess.run([sys.executable, '-m', 'accelerate.commands.launch', 's.py'])", 1),
    ("import subprocess\ndef go():\n    subprocess.run([sys.executable, '-m', 'accelerate.commands.launch', '--cpu', 's.py'])", 0),
    ("import subprocess\ndef go(env):\n    env['ACCELERATE_USE_CPU'] = 'true'\n    subprocess.run(['accelerate launch s.py'], env=env)", 0),
    ("def expected():\n    return 'accelerate launch your_script.py'", 0),  # text, not a launch
]


@pytest.mark.parametrize(("source", "count"), _CHECKER_CASES)
def test_checker_finds_every_automatic_device_choice(source, count):
    assert len(problems(source)) == count, problems(source)


# -- the suite ----------------------------------------------------------------------------------
def _suite_files() -> list[Path]:
    # Not this file: its plugin test below makes the automatic choices on purpose.
    return sorted(p for p in TESTS.rglob("*.py") if p.name != Path(__file__).name)


def test_the_suite_is_checked_everywhere():
    names = {str(p.relative_to(TESTS)) for p in _suite_files()}
    assert {"lit.py", "helpers.py", "scripts/train_ddp.py", "accelerate_scripts/train_cnn.py", "engine/test_cuda.py"} <= names


def _suite_problems(kind: str) -> list[str]:
    return [f for p in _suite_files() for f in problems(p.read_text(), str(p.relative_to(ROOT)), kinds=(kind,))]


def test_no_trainer_or_accelerator_chooses_the_device():
    """What fails on a GPU machine: the model goes to CUDA, the test's data and meter stay on CPU."""
    found = _suite_problems("auto")
    assert not found, "tests leaving the device to an automatic choice (Note [Tests say which device they mean]):\n" + "\n".join(found)


def test_every_runtime_profile_and_meter_names_its_device():
    """A CPU model makes these CPU either way; naming it keeps the test's meaning in the test."""
    found = _suite_problems("inferred")
    assert not found, "device inferred from the model (Note [Tests say which device they mean]):\n" + "\n".join(found)


def test_pretend_gpu_plugin_refuses_the_automatic_choices_only():
    """tests/pretend_gpu.py, the run-time side: the automatic choices raise while it is
    installed, the explicit ones do not, and everything is back afterwards."""
    import lightning as L
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from .. import pretend_gpu
    from ..helpers import QUIET_TRAINER

    quiet = QUIET_TRAINER
    before = (_AcceleratorConnector.__dict__["_choose_auto_accelerator"], PartialState.__dict__["default_device"])
    restore = pretend_gpu.install()
    try:
        with pytest.raises(pretend_gpu.AutoDeviceChoiceError, match="accelerator='cpu'"):
            L.Trainer(**quiet)
        assert L.Trainer(accelerator="cpu", **quiet).strategy.root_device.type == "cpu"
        for cpu, fails in ((False, True), (True, False)):
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            if fails:
                with pytest.raises(pretend_gpu.AutoDeviceChoiceError, match="cpu=True"):
                    Accelerator(cpu=cpu)
            else:
                assert Accelerator(cpu=cpu).device.type == "cpu"
    finally:
        restore()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert (_AcceleratorConnector.__dict__["_choose_auto_accelerator"], PartialState.__dict__["default_device"]) == before
