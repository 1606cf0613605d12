"""``accelerate-swap``: what a new user types first. The usage line of a subcommand, the
``estimate`` command of ``docs/accelerate.md`` run as written (with the model that ships in ``examples/``), and
``--model`` naming the user's code from the working directory or by file path."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from accelerate_swap.cli import main

REPO = Path(__file__).resolve().parents[2]
#: The command docs/accelerate.md shows; run from the repository root.
DOCS_ESTIMATE = "accelerate-swap estimate --model examples.models:build --input-shape 1024 --input-dtype int64 --budget 24GiB"

_ENTRY_POINT = Path(sys.executable).parent / "accelerate-swap"

_TINY_MODEL = textwrap.dedent(
    """
    from torch import nn

    def build():
        return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4)])
    """
)


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The installed console script, importing this checkout's packages (as the suite does)."""
    if not _ENTRY_POINT.exists():
        pytest.skip(f"no accelerate-swap console script beside {sys.executable}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run([str(_ENTRY_POINT), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command", ["estimate", "config"])
def test_subcommand_usage_names_the_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage.startswith(f"usage: accelerate-swap {command} [-h]"), usage


@pytest.mark.slow
def test_docs_estimate_command_prints_a_plan():
    """docs/accelerate.md's command, exactly, through the console script from the repository root."""
    done = _run(shlex.split(DOCS_ESTIMATE)[1:], cwd=REPO)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Training-step memory for `examples.models:build`, input (32, 1024) int64" in out
    assert "12 segments" in out
    assert "Plan at batch 32 for a budget of 24.0 GiB (margin 5%):" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("blocks.")]
    assert [r[0] for r in rows] == [f"blocks.{i}" for i in range(12)]
    # GPT-2 small at batch 32 x 1024 tokens does not fit 24 GiB with every block kept
    assert "plain step at batch 32 (every segment kept): peak" in out and any(r[1] != "keep" for r in rows)
    assert "Largest batch for 24.0 GiB" in out


@pytest.mark.slow
def test_model_module_is_found_in_the_working_directory(tmp_path):
    """Note [Modules named on the command line]: a console script does not put the working
    directory on ``sys.path`` by itself (before the fix: "No module named 'my_models'")."""
    (tmp_path / "my_models.py").write_text(_TINY_MODEL)
    done = _run(["estimate", "--model", "my_models:build", "--input-shape", "32", "--budget", "1MiB"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Plan at batch 32 for a budget of 1.0 MiB" in done.stdout


def test_the_working_directory_leaves_sys_path_afterwards(tmp_path, monkeypatch, capsys):
    (tmp_path / "cwd_models.py").write_text(_TINY_MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or os.curdir) != str(tmp_path)])
    before = list(sys.path)
    assert main(["estimate", "--model", "cwd_models:build", "--input-shape", "32"]) == 0
    assert "4 segments" in capsys.readouterr().out
    assert sys.path == before


def test_model_from_a_file_path(tmp_path, capsys):
    path = tmp_path / "models dir" / "file_models.py"
    path.parent.mkdir()
    path.write_text(_TINY_MODEL)
    assert main(["estimate", "--model", f"{path}:build", "--input-shape", "32", "--budget", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert f"Training-step memory for `{path}:build`" in out and "Plan at batch 32" in out


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no/such/file.py:build", "there is no file 'no/such/file.py'"),
        ("{tmp}/m.py:nope", "cannot be imported"),
        ("{tmp}/broken.py:build", "cannot be loaded .ZeroDivisionError"),
        ("no_such_module_here:build", "cannot be imported"),
    ],
)
def test_bad_model_specs_name_the_flag(spec, message, tmp_path, capsys):
    (tmp_path / "m.py").write_text(_TINY_MODEL)
    (tmp_path / "broken.py").write_text("1 / 0\n")
    assert main(["estimate", "--model", spec.format(tmp=tmp_path), "--input-shape", "32"]) == 2
    err = capsys.readouterr().err
    assert "accelerate-swap estimate: error: `--model` names" in err
    assert re.search(message, err), err
