"""What the pages a user reads say of the code, checked against the code (issue 42, item 4):
the budget parser as the docs call it, every ``ACCELERATE_CPU_SWAP_*`` variable the plugin
accepts listed, and the plain ``Trainer``'s warning promised with its condition."""

from __future__ import annotations

import re
from pathlib import Path

import lightning_swap.core
from accelerate_swap.plugin import ENV_PREFIX, OPTIONS, env_name

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))


def _flat(page: Path) -> str:
    return " ".join(page.read_text().split())


def test_the_budget_parser_runs_as_the_docs_call_it():
    """Every inline span that names ``parse_bytes`` is a call that works as written, and gives bytes."""
    shown = [(page.name, span) for page in PAGES for span in re.findall(r"`([^`]*parse_bytes[^`]*)`", _flat(page))]
    assert shown, "no page shows the budget parser"
    for page, span in shown:
        value = eval(span, {"lightning_swap": lightning_swap})  # noqa: S307 - the docs' own text
        assert isinstance(value, int) and value > 0, (page, span, value)


def test_the_accelerate_page_lists_every_variable_the_plugin_accepts():
    """docs/accelerate.md's list, written ``ACCELERATE_CPU_SWAP_POLICY`` or ``..._POLICY``, has
    one variable per option of the plugin's table (``SwapConfig``'s fields and its own)."""
    section = _flat(ROOT / "docs" / "accelerate.md").split("## Environment variables", 1)[1].split("##", 1)[0]
    listed = set(re.findall(r"`(?:ACCELERATE_CPU_SWAP|\.\.\.)_([A-Z_]+)`", section))
    assert {env_name(o)[len(ENV_PREFIX):] for o in OPTIONS} - listed == set()


def test_the_plain_trainer_warning_is_promised_with_its_condition():
    """Note [A switch never silently ignored] in ``accelerate_swap/guard.py``: a plain
    ``Accelerator`` (a plain ``Trainer``'s) is warned only once ``accelerate_swap`` was imported, so a
    page that says a plain ``Trainer`` under the switch "says so" says when (or points to where it is said)."""
    claims = [
        (page.name, m.group(0)) for page in PAGES
        for m in re.finditer(r"plain `Trainer` under `ACCELERATE_CPU_SWAP=true`[^.]*says so[^.]*\.", _flat(page))
    ]
    assert claims
    assert [c for c in claims if "`accelerate_swap` is imported" not in c[1] and "the warning above" not in c[1]] == []
