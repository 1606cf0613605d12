"""``accelerate-swap``: the command line of the Accelerate plugin.

``accelerate-swap config`` writes a project's sidecar YAML (the switch and the options; see
:mod:`accelerate_swap.plugin`) and prints the environment line that points
``accelerate launch`` at it. ``accelerate-swap estimate`` prints the plan and the largest batch
for a model without training (:mod:`accelerate_swap.estimate`). Each subcommand is a pair (add
its parser, run it) in ``_COMMANDS``, in the manner of ``accelerate``'s own CLI. A bad value
exits with status 2 and a message naming the flag.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import Field, fields
from pathlib import Path
from typing import Optional

from .plugin import ENV_CONFIG, FILE_FLAG, OPTIONS, SwapPlugin, parse_option

__all__ = ["build_parser", "main"]

DEFAULT_CONFIG_FILE = "accelerate_swap.yaml"

_HEADER = """\
# accelerate-swap configuration, written by `accelerate-swap config`.
# Use it with:  {env} accelerate launch your_script.py
# Keys: enabled (the switch), {keys}.
# ACCELERATE_CPU_SWAP_<KEY> variables override them.
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
    for f in fields(SwapPlugin):  # Note [One option table]: a flag per option, its help the option's
        help = f.metadata["help"].replace("``", "").replace("%", "%%")
        switch = _switch_flag(f)
        if switch is not None:  # a yes/no option: one flag that turns its default over
            _flag(parser, switch, action="store_true", help=f"turn {f.name} {'off' if f.default else 'on'}: {help}")
        else:
            _flag(parser, f.name, help=help)
    _flag(parser, "disabled", action="store_true", help="write `enabled: false` (keep the options, switch the plugin off)")


def _switch_flag(option: Field) -> Optional[str]:
    """The flag of a yes/no option (``no_log_plan`` for one on by default), or ``None``."""
    if not isinstance(option.default, bool):
        return None
    return f"no_{option.name}" if option.default else option.name


def _config_from_args(args: argparse.Namespace) -> SwapPlugin:
    options = {}
    for f in fields(SwapPlugin):
        switch = _switch_flag(f)
        if switch is not None:
            if getattr(args, switch):
                options[f.name] = not f.default
        elif getattr(args, f.name) is not None:
            options[f.name] = parse_option(f.name, getattr(args, f.name), f"--{f.name}")
    return SwapPlugin(**options)


def write_config_file(plugin: SwapPlugin, path: str | os.PathLike, *, enabled: bool = True) -> Path:
    """Write ``plugin``'s options and the switch to ``path``; read back to prove it parses."""
    import yaml

    target = Path(path).expanduser().resolve()
    body = yaml.safe_dump({FILE_FLAG: enabled, **plugin.to_dict()}, sort_keys=False, default_flow_style=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    header = _HEADER.format(env=f"{ENV_CONFIG}={shlex.quote(str(target))}", keys=", ".join(OPTIONS))
    target.write_text(header + body)
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


# -- estimate ----------------------------------------------------------------------------
def _add_estimate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="Print the plan and the largest batch for a model under a memory budget, without training.",
        description=(
            "Profile one training step of a torchvision model (built with weights=None: nothing is "
            "downloaded) or of the model a factory returns, in fake mode (no arithmetic), and print "
            "the plan at --batch_size and the largest batch whose plan fits --budget."
        ),
    )
    parser.add_argument("model_name", nargs="?", help="a torchvision model name, e.g. resnet50 (or use --model)")
    _flag(
        parser,
        "model",
        help="'package.module:factory' (importable from the working directory) or 'path/to/file.py:factory', "
        "called with no arguments, returning the nn.Module; e.g. examples.models:build from the repository root",
    )
    _flag(parser, "batch_size", default="32", help="the batch profiled and planned (default 32)")
    _flag(parser, "image_size", default="224", help="image height and width: input (batch, 3, size, size) (default 224)")
    _flag(parser, "input_shape", help="one sample's shape instead, comma-separated (e.g. 3,32,32 or 512 for token ids)")
    _flag(parser, "input_dtype", default="float32", help="float32 (default), float16, bfloat16, or int64 (token ids)")
    parser.add_argument("--budget", "--budget_bytes", "--budget-bytes", dest="budget", help="device memory budget (e.g. 8GiB)")
    _flag(parser, "policy", default="auto", help="auto (default: any action per segment) or one action for every segment")
    _flag(parser, "segments", help="comma-separated qualified module names or 'package.module:BlockClass' (default: repeated blocks)")
    _flag(parser, "margin", default="0.05", help="fraction of the budget held back for the largest batch (default 0.05)")
    _flag(parser, "max_batch_size", default="8192", help="the largest batch considered (default 8192)")
    _flag(parser, "precision", default="32-true", help="32-true (default), bf16-mixed or 16-mixed: the forward under autocast, as training runs it")
    _flag(parser, "loss", default="cross_entropy", help="cross_entropy (default: of the output's last dimension) or sum (the output summed)")
    _flag(parser, "optimizer", default="adamw", help="adamw (default) or adam (state: 2 x parameters), momentum (1 x), sgd or none (0)")


def _positive_int(raw: str, flag: str) -> int:
    text = str(raw).strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"`{flag}` got {raw!r}; allowed: an integer >= 1.")
    return int(text)


def _run_estimate(args: argparse.Namespace) -> int:
    from .estimate import DTYPES, build_model, estimate

    if (args.model_name is None) == (args.model is None):
        raise ValueError(
            "`--model` / `model_name`: give exactly one: a torchvision model name (e.g. `accelerate-swap "
            "estimate resnet50`) or --model package.module:factory."
        )
    batch_size = _positive_int(args.batch_size, "--batch_size")
    max_batch_size = _positive_int(args.max_batch_size, "--max_batch_size")
    if args.input_shape is not None:
        parts = [p.strip() for p in str(args.input_shape).split(",")]
        if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"`--input_shape` got {args.input_shape!r}; allowed: comma-separated integers >= 1, e.g. 3,224,224.")
        input_shape = tuple(int(p) for p in parts)
    else:
        size = _positive_int(args.image_size, "--image_size")
        input_shape = (3, size, size)
    if args.input_dtype not in DTYPES:
        raise ValueError(f"`--input_dtype` got {args.input_dtype!r}; allowed: {', '.join(DTYPES)}.")
    try:
        margin = float(args.margin)
    except ValueError:
        margin = -1.0
    if not 0 <= margin < 1:
        raise ValueError(f"`--margin` got {args.margin!r}; allowed: a number in [0, 1).")
    budget = parse_option("budget_bytes", args.budget, "--budget") if args.budget is not None else None
    policy = parse_option("policy", args.policy, "--policy")
    if isinstance(policy, Mapping):
        raise ValueError(f"`--policy` got {args.policy!r}; allowed: auto or one action for every segment.")
    segments = parse_option("segments", args.segments, "--segments") if args.segments is not None else None
    spec, source = (args.model, "--model") if args.model is not None else (args.model_name, "model_name")
    model = build_model(spec, source=source)
    result = estimate(
        model,
        batch_size=batch_size,
        input_shape=input_shape,
        input_dtype=args.input_dtype,
        budget_bytes=budget,
        policy=policy,
        segments=segments,
        margin=margin,
        max_batch_size=max_batch_size,
        model_name=spec,
        precision=str(args.precision).strip().lower(),
        loss=str(args.loss).strip().lower(),
        optimizer=str(args.optimizer).strip().lower(),
    )
    print(result.render())
    return 0


#: name -> (add the subcommand's parser, run it).
_COMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], int]]] = {
    "config": (_add_config_parser, _run_config),
    "estimate": (_add_estimate_parser, _run_estimate),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        "accelerate-swap",
        description="Planned CPU offload and recompute for Accelerate training loops.",
        usage="accelerate-swap <command> [<args>]",
    )
    # prog: each subcommand's usage reads `accelerate-swap estimate ...`, not the top-level usage line
    subparsers = parser.add_subparsers(dest="command", metavar="<command>", prog=parser.prog)
    for add_parser, _ in _COMMANDS.values():
        add_parser(subparsers)
    return parser


@contextmanager
def _working_directory_importable() -> Iterator[None]:
    """Note [Modules named on the command line]: ``--model package.module:factory`` and
    ``--segments package.module:Block`` name the user's code, usually in the project they run
    the command from. ``python -m`` puts the working directory on ``sys.path``; a console script
    puts its own ``bin`` directory there instead. So, as ``uvicorn`` does for its app, the
    working directory is importable while a command runs, and removed again afterwards."""
    cwd = os.getcwd()
    added = not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path)
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 1
    try:
        with _working_directory_importable():
            return _COMMANDS[args.command][1](args)
    except ValueError as err:
        print(f"accelerate-swap {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
