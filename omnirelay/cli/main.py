"""``omnirelay`` console script: one sub-command per module in :data:`COMMANDS`.

Each command module defines ``register(subparsers) -> None`` that adds its parser and
sets ``func`` (``func(args) -> int`` is the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from omnirelay import __version__
from omnirelay.errors import OmniRelayError

COMMANDS = (
    "omnirelay.cli.run",
    "omnirelay.cli.check",
    "omnirelay.cli.bench",
    "omnirelay.cli.doctor",
    "omnirelay.cli.serve",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnirelay",
        allow_abbrev=False,
        description="Serve multi-stage model pipelines (Thinker -> Talker -> Code2Wav) "
        "with a leak-proof stage-edge protocol.",
    )
    parser.add_argument("--version", action="version", version=f"omnirelay {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # command not built yet
                continue
            raise
        module.register(sub)
    # No abbreviations: a prefix of a long option (`--model` of `--model-name`) must be an
    # error, not silently another option.
    for command in sub.choices.values():
        command.allow_abbrev = False
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except OmniRelayError as exc:
        print(f"omnirelay {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"omnirelay {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
