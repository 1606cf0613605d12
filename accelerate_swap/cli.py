"""``accelerate-swap``: the command line of the Accelerate plugin.

``accelerate-swap config`` writes a project's sidecar YAML (the switch and the options; see
:mod:`accelerate_swap.plugin`) and prints the environment line that points
``accelerate launch`` at it. Each subcommand is a pair (add its parser, run it) in
``_COMMANDS``, in the manner of ``accelerate``'s own CLI.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

from .plugin import ENV_CONFIG, FILE_FLAG, SwapPlugin, parse_option

__all__ = ["build_parser", "main"]

DEFAULT_CONFIG_FILE = "accelerate_swap.yaml"

_HEADER = """\
# accelerate-swap configuration, written by `accelerate-swap config`.
# Use it with:  {env} accelerate launch your_script.py
# Keys: enabled (the switch), policy, segments, min_offload_bytes, budget_bytes,
# prefetch_segments, log_plan, log_stats. ACCELERATE_CPU_SWAP_<KEY> variables override them.
"""


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """``--name_with_underscores`` (Accelerate's spelling) and ``--name-with-dashes``."""
    flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    parser.add_argument(*flags, dest=name, **kwargs)


# -- config ------------------------------------------------------------------------------
def _add_config_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "config",
        help="Write the swap plugin's config file for a project and print the environment line to use.",
        description=(
            "Write a YAML file with the swap plugin's switch and options, and print how to point "
            "`accelerate launch` at it (ACCELERATE_CPU_SWAP_CONFIG), or the same settings as "
            "ACCELERATE_CPU_SWAP_* variables. Options left out get their defaults."
        ),
    )
    _flag(parser, "config_file", default=DEFAULT_CONFIG_FILE, help=f"where to write (default: ./{DEFAULT_CONFIG_FILE})")
    _flag(parser, "policy", help="keep | offload | recompute | selective | recompute_offload, or 'segment.name=action,...'")
    _flag(parser, "segments", help="comma-separated qualified module names or 'package.module:BlockClass' (default: repeated blocks)")
    _flag(parser, "min_offload_bytes", help="saved tensors smaller than this stay on the device (e.g. 16KiB)")
    _flag(parser, "budget_bytes", help="device memory budget for the planner (e.g. 12GiB)")
    _flag(parser, "prefetch_segments", help="segments prefetched ahead in backward (default: 1 on CUDA, 0 on CPU)")
    _flag(parser, "no_log_plan", action="store_true", help="do not log the plan table")
    _flag(parser, "no_log_stats", action="store_true", help="do not send per-step statistics to accelerator.log")
    _flag(parser, "disabled", action="store_true", help="write `enabled: false` (keep the options, switch the plugin off)")


def _config_from_args(args: argparse.Namespace) -> SwapPlugin:
    options = {}
    for name in ("policy", "segments", "min_offload_bytes", "budget_bytes", "prefetch_segments"):
        raw = getattr(args, name)
        if raw is not None:
            options[name] = parse_option(name, raw, f"--{name}")
    return SwapPlugin(**options, log_plan=not args.no_log_plan, log_stats=not args.no_log_stats)


def write_config_file(plugin: SwapPlugin, path: str | os.PathLike, *, enabled: bool = True) -> Path:
    """Write ``plugin``'s options and the switch to ``path``; read back to prove it parses."""
    import yaml

    target = Path(path).expanduser().resolve()
    body = yaml.safe_dump({FILE_FLAG: enabled, **plugin.to_dict()}, sort_keys=False, default_flow_style=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(_HEADER.format(env=f"{ENV_CONFIG}={shlex.quote(str(target))}") + body)
    if SwapPlugin.from_yaml(target).to_dict() != plugin.to_dict():
        raise RuntimeError(f"{target} does not read back as the options written; please report this.")
    return target


def _run_config(args: argparse.Namespace) -> int:
    plugin = _config_from_args(args)
    target = write_config_file(plugin, args.config_file, enabled=not args.disabled)
    env_line = " ".join(f"{k}={shlex.quote(v)}" for k, v in plugin.to_env().items())
    print(f"accelerate-swap configuration saved at {target}")
    if args.disabled:
        print("The file switches the plugin off (enabled: false); ACCELERATE_CPU_SWAP=true overrides that.")
    print("Use it with:")
    print(f"  {ENV_CONFIG}={shlex.quote(str(target))} accelerate launch your_script.py")
    print("or, without the file:")
    print(f"  {env_line} accelerate launch your_script.py")
    return 0


#: name -> (add the subcommand's parser, run it).
_COMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], int]]] = {
    "config": (_add_config_parser, _run_config),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        "accelerate-swap",
        description="Planned CPU offload and recompute for Accelerate training loops.",
        usage="accelerate-swap <command> [<args>]",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    for add_parser, _ in _COMMANDS.values():
        add_parser(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 1
    try:
        return _COMMANDS[args.command][1](args)
    except ValueError as err:
        print(f"accelerate-swap {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
