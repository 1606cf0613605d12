"""README.md and the ``docs/`` pages run: every ``bash`` and ``python`` block of each is executed here
(issue 22, item 5; issue 32 moved the depth of the README into ``docs/``).

Each block, whichever page holds it, is matched by a line it contains to a runner in
:data:`RUNNERS`; a block no runner matches, and a runner no block uses, fail
:func:`test_every_block_has_a_runner`, so a new block (or page) cannot be added untested.
Python blocks run as written, in a namespace that holds what the text around them assumes (a
``model``, a ``batch``, an optimizer); ``L.Trainer`` gets short-training defaults (two steps, no
logger, no checkpoints, no progress bar) for arguments a block does not give, and ``torch.compile``
the ``aot_eager`` backend when it names none (no C++ build). Shell commands run in the
environment the suite runs in (this venv's ``python``, ``accelerate``, ``accelerate-swap``), with
CPU variants where a command names a GPU or a long run, each saying what it changed:

- the two-command block: installing (a venv, ``pip install``) needs the network; what follows it
  runs: the demo at a small size; the suite is what is running (``LIGHTNING_SWAP_README=full``
  collects it all once more);
- ``accelerate launch``: ``--cpu`` and a few small steps of the example;
- the unified-memory block needs CUDA (``um=`` is refused on CPU: ``tests/engine/test_unified.py``): skipped;
- the ``estimate`` command on ``examples.models:build`` is run by ``tests/adapters/test_cli.py`` (checked to be
  ``docs/accelerate.md``'s text here).

A launched process pays for its imports (10-50 s each on a loaded 2-core machine), so by default
the commands run in this process: the demo's and the example's ``main()`` with the command's
arguments and environment variables, ``accelerate-swap``'s ``main()`` (``accelerate launch`` itself
is run by ``tests/adapters/test_accelerate.py``). ``LIGHTNING_SWAP_README=full`` runs every command as a
shell would, launcher included. By default 54 s on 2 shared cores (2026-11-24), 20 s of it the
demo. When issue 32 moved blocks into ``docs/`` (one block more: the Lightning options beside the
README's short switch), 16 passed and 1 skipped in 115-118 s on 2 cores shared with a running
benchmark, 44-48 s of CPU, where the README before the move took 102 s, 51 s of CPU, beside the
same benchmark (2026-11-27).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ..lit import LitModel
from ..models import mlp_chain
from ..adapters.test_accelerate import fresh_state  # noqa: F401 - a fixture

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
FULL = os.environ.get("LIGHTNING_SWAP_README", "").strip().lower() == "full"


#: The pages whose blocks run: the README, then every page of ``docs/``.
PAGES = ("README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")))


def _blocks(page: str) -> list[tuple[str, str, int]]:
    """(language, text, first line) of every fenced block of ``page``."""
    text = (REPO / page).read_text()
    return [
        (m.group(1), m.group(2), text[: m.start()].count("\n") + 1)
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    ]


def _shell(command: str, *, cwd: Path = REPO, env: dict | None = None, timeout: int = 300) -> str:
    """``command`` in bash with this venv's executables first on the PATH and this checkout importable."""
    full_env = {
        **os.environ, **(env or {}), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _command(command: str, request, *, cwd: Path = REPO) -> str:
    """``command`` as a shell runs it (``LIGHTNING_SWAP_README=full``), else in this process: a
    ``python script`` / ``accelerate launch [--cpu] script`` line runs the script's ``main()`` with
    its arguments, an ``accelerate-swap`` line the CLI's ``main()``; ``NAME=value`` prefixes become
    environment variables for the call."""
    if FULL:
        return _shell(command, cwd=cwd)
    words = shlex.split(command.replace("$PWD", str(cwd)))
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    monkeypatch = request.getfixturevalue("monkeypatch")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(cwd)
    capsys = request.getfixturevalue("capsys")
    capsys.readouterr()
    if words[0] == "accelerate-swap":
        from accelerate_swap.cli import main

        assert main(words[1:]) == 0
        return capsys.readouterr().out
    if words[:2] == ["accelerate", "launch"]:
        words = [w for w in words[2:] if w != "--cpu"]
    elif words[0] in ("python", "python3"):
        words = words[1:]
    script = (cwd / words[0]) if not Path(words[0]).is_absolute() else Path(words[0])
    monkeypatch.setattr(sys, "argv", [str(script), *words[1:]])
    import runpy

    levels = {name: logging.getLogger(name).level for name in ("lightning", "lightning.pytorch", "lightning_swap")}
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        for name, level in levels.items():  # the demo quiets loggers for its own output
            logging.getLogger(name).setLevel(level)
    return capsys.readouterr().out


@pytest.fixture
def quick_trainer(monkeypatch, tmp_path):
    """``L.Trainer`` with short-training defaults for what a block leaves out, and the default
    ``torch.compile`` backend ``aot_eager``."""
    original = L.Trainer.__init__
    defaults = dict(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path),
    )

    def init(self, *args, **kwargs):
        original(self, *args, **{**defaults, **kwargs})

    monkeypatch.setattr(L.Trainer, "__init__", init)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model=None, **kw: compile_(model, **{"backend": "aot_eager", **kw}))
    yield
    torch._dynamo.reset()


def _exec(body: str, where: str, namespace: dict) -> dict:
    exec(compile(body, f"{where} (a block)", "exec"), namespace)
    return namespace


# -- the runners, by a line of the block they run ----------------------------------------------------
def _two_commands(body, where, tmp_path, request):
    assert ".venv/bin/python examples/demo.py" in body and ".venv/bin/python -m pytest -q" in body
    out = _command(f"python examples/demo.py --image-size 64 --batch-size 16 --steps 4 --budget-fraction 0.95 --report-dir {tmp_path}", request)
    assert "weights = plain" in out and "NO" not in out.split("weights = plain")[1].split("The auto plan")[0]
    assert "noise" in out  # the table says what is noise (issue 22, item 6)
    if FULL:
        _shell("python -m pytest -q --collect-only -p no:cacheprovider")


def _lightning(body, where, tmp_path, request):
    request.getfixturevalue("quick_trainer")
    ns = _exec(body, where, {"model": LitModel("cnn")})
    assert ns["trainer"].strategy.plan is not None and ns["trainer"].strategy.step_stats is not None


def _fabric(body, where, tmp_path, request):
    model = mlp_chain(width=16, depth=3)
    ns = _exec(body, where, {
        "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "loader": DataLoader(_data(), batch_size=8),
        "loss_fn": F.cross_entropy,
    })
    assert ns["fabric"].strategy.plan is not None and len(ns["fabric"].strategy.stats_history) == 8


def _finder(body, where, tmp_path, request):
    request.getfixturevalue("quick_trainer")
    import lightning_swap

    ns = _exec(body, where, {"L": L, "lightning_swap": lightning_swap, "model": LitModel("mlp", samples=16384)})
    assert ns["finder"].optimal_batch_size >= 4


def _chunked_loss(body, where, tmp_path, request):
    transformers = pytest.importorskip("transformers", reason="hf_causal_lm_loss needs transformers (the `test` extra)")
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=None, eos_token_id=None)
    )
    ns = _exec(body, where, {
        "self": SimpleNamespace(lm_head=nn.Linear(16, 50)), "hidden": torch.randn(2, 8, 16), "labels": torch.randint(0, 50, (2, 8)),
        "hf_model": hf, "input_ids": torch.randint(0, 64, (2, 8)),
    })
    assert torch.isfinite(ns["loss"])


def _core(body, where, tmp_path, request):
    torch.manual_seed(0)
    model = mlp_chain(width=16, depth=3)
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    ns = _exec(body, where, {
        "model": model, "batch": (x, y), "x": x, "y": y, "loss_fn": F.cross_entropy,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
    })
    assert ns["stats"].peak_device_bytes > 0


def _compile(body, where, tmp_path, request):
    request.getfixturevalue("quick_trainer")
    from lightning_swap import CPUSwapStrategy

    from ..runtime.test_compile import Net

    lit = LitModel("gpt")
    ns = _exec(body, where, {
        "torch": torch, "L": L, "CPUSwapStrategy": CPUSwapStrategy, "model": Net(), "lit_module": lit, "LitModule": LitModel,
        "trainer": L.Trainer(strategy=CPUSwapStrategy(budget_bytes="12GiB"), accelerator="cpu"),
    })
    assert isinstance(ns["trainer"].strategy, CPUSwapStrategy)


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 10, (64,), generator=g))


def _accelerate(body, where, tmp_path, request):
    """Switched on as the text beside the block says, by the environment (CPU variant: a budget,
    since the CPU reports no free memory)."""
    request.getfixturevalue("fresh_state")
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setenv("ACCELERATE_CPU_SWAP", "true")
    monkeypatch.setenv("ACCELERATE_CPU_SWAP_BUDGET_BYTES", "64MiB")
    model = mlp_chain(width=16, depth=3)
    ns = _exec(body, where, {
        "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "loader": DataLoader(_data(), batch_size=8),
        "loss_fn": F.cross_entropy,
    })
    assert ns["accelerator"].swap_plan is not None and ns["accelerator"].swap_step_stats is not None


def _find_batch_size(body, where, tmp_path, request):
    request.getfixturevalue("fresh_state")
    # CPU variant: CPU reports no free memory, so the plugin is given a budget.
    assert "SwapPlugin()" in body
    body = body.replace("SwapPlugin()", 'SwapPlugin(budget_bytes="64MiB")')
    model = mlp_chain(width=16, depth=3)
    ns = _exec(body, where, {
        "model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "dataset": _data(), "F": F, "DataLoader": DataLoader,
    })
    assert ns["train"].result is not None


def _hf_trainer(body, where, tmp_path, request):
    """The tiny GPT-2 of tests/adapters/test_hf_trainer.py, two steps on the CPU."""
    pytest.importorskip("transformers", reason="SwapTrainer needs transformers (the `test` extra)")
    request.getfixturevalue("fresh_state")
    from ..adapters.test_hf_trainer import _Tokens, _args, _gpt2

    ns = _exec(body, where, {"model": _gpt2(), "args": _args(tmp_path, max_steps=2), "dataset": _Tokens()})
    assert ns["trainer"].accelerator.swap_plan is not None


def _launch(body, where, tmp_path, request):
    """Both lines, the second from its comment; CPU variant: ``--cpu`` and three small steps."""
    commands = [ln.split("# without a GPU:", 1)[-1].strip() for ln in body.strip().splitlines()]
    assert len(commands) == 2 and all("accelerate launch" in c for c in commands)
    for command in commands:
        request.getfixturevalue("fresh_state")
        if "--cpu" not in command:
            command = command.replace("accelerate launch", "accelerate launch --cpu")
        out = _command(f"{command} --steps 3 --image-size 32 --batch-size 4", request)
        assert "swap plugin on" in out and "step 2:" in out, out
        assert "swap plan (" in out, out  # the plan, with its numbers, once it has them


def _config_file(body, where, tmp_path, request):
    request.getfixturevalue("fresh_state")
    lines = [ln.split("#")[0].strip() for ln in body.strip().splitlines()]
    _command(lines[0], request, cwd=tmp_path)
    assert (tmp_path / "accelerate_swap.yaml").exists()
    launch = lines[1].replace("accelerate launch examples/", f"accelerate launch --cpu {REPO}/examples/")
    out = _command(f"{launch} --steps 2 --image-size 32 --batch-size 4", request, cwd=tmp_path)
    assert "swap plugin on: policy 'auto', budget 12.0 GiB" in out, out


def _estimate(body, where, tmp_path, request):
    from ..adapters.test_cli import DOCS_ESTIMATE

    commands = [ln.split("   #")[0].strip() for ln in body.strip().splitlines()]
    assert commands[1] == DOCS_ESTIMATE  # run by tests/adapters/test_cli.py::test_docs_estimate_command_prints_a_plan
    out = _command(commands[0], request)
    first = out.splitlines()[0]
    assert "cross-entropy loss" in first and "AdamW state" in first and "not counted" in first, first
    assert "Plan at batch 64 for a budget of 8.0 GiB" in out


def _fsdp(body, where, tmp_path, request):
    """The three constructions, CPU variant: 2 CPU processes for 8 GPUs (``devices``,
    ``data_parallel_size``); ``Block`` the repository GPT's block. The Trainer is built, not fit:
    training under both strategies on 2 gloo ranks is ``tests/adapters/test_fsdp.py``'s (a launched job per
    model, every policy equal to plain FSDP)."""
    request.getfixturevalue("quick_trainer")
    from examples.models import Block

    from lightning_swap import ModelParallelCPUSwapStrategy

    assert 'accelerator="cuda", devices=8' in body and "data_parallel_size=8" in body
    body = body.replace('accelerator="cuda", devices=8', 'accelerator="cpu", devices=2').replace("data_parallel_size=8", "data_parallel_size=2")
    ns = _exec(body, where, {"Block": Block})
    assert isinstance(ns["trainer"].strategy, ModelParallelCPUSwapStrategy)
    assert isinstance(ns["strategy"], ModelParallelCPUSwapStrategy)  # with_cpu_swap's, the last assigned
    assert ns["strategy"]._data_parallel_size == 2 and ns["strategy"].swap_config.budget_bytes == 60 * 2**30
    assert ns["trainer"].strategy.swap_config.is_auto
    assert hasattr(ns["LitGPT"], "configure_model")


def _skip_unified(body, where, tmp_path, request):
    pytest.skip("unified memory (`um=`) needs CUDA: on CPU it is refused with a message (tests/engine/test_unified.py checks it)")


#: A line the block contains -> its runner.
RUNNERS = {
    "python3 -m venv .venv": _two_commands,
    'trainer = L.Trainer(strategy="cpu_swap")': _lightning,
    'fabric = Fabric(strategy="cpu_swap")': _fabric,
    "finder = lightning_swap.SwapBatchSizeFinder": _finder,
    "from lightning_swap import ChunkedCrossEntropy": _chunked_loss,
    'CPUSwapStrategy(um="all"': _skip_unified,
    "from lightning_swap import profile, solve, SwapRuntime": _core,
    "model = torch.compile(model)": _compile,
    "accelerator = SwapAccelerator()": _accelerate,
    "ACCELERATE_CPU_SWAP=true ACCELERATE_CPU_SWAP_BUDGET_BYTES=12GiB accelerate launch": _launch,
    "accelerate-swap config --policy auto": _config_file,
    "from accelerate_swap.hf import SwapTrainer": _hf_trainer,
    "@find_batch_size(": _find_batch_size,
    "accelerate-swap estimate resnet50": _estimate,
    "from lightning_swap import FSDPCPUSwapStrategy, ModelParallelCPUSwapStrategy, with_cpu_swap": _fsdp,
}


def _runner(body: str):
    found = [runner for key, runner in RUNNERS.items() if key in body]
    return found[0] if len(found) == 1 else None


#: (page, language, text, first line) of every ``bash`` and ``python`` block of every page.
CODE = [(page, lang, body, line) for page in PAGES for lang, body, line in _blocks(page) if lang in ("bash", "python")]


def test_every_block_has_a_runner():
    missing = [f"{page}:{line}" for page, _, body, line in CODE if _runner(body) is None]
    assert not missing, f"blocks run by no test (a key of RUNNERS matches none, or several): {missing}"
    unused = [key for key in RUNNERS if not any(key in body for _, _, body, _ in CODE)]
    assert not unused, f"runners whose block is gone (remove them, or the block lost its line): {unused}"


@pytest.mark.slow
@pytest.mark.parametrize("page, lang, body, line", CODE, ids=[f"{page}:{line}" for page, _, _, line in CODE])
def test_documentation_block_runs(page, lang, body, line, tmp_path, request):
    runner = _runner(body)
    assert runner is not None
    runner(body, f"{page}:{line}", tmp_path, request)
