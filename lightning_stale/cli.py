"""The ``lightning-stale`` command line: one subcommand per module in :mod:`lightning_stale.commands`.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``, and may define
``EPILOG`` (text printed after the options as written); heavy imports happen inside ``run`` so that ``--help`` is
instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from collections.abc import Sequence

from lightning_stale import __version__

COMMANDS = ("demo", "inspect", "period", "simulate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-stale",
        description="Measure, predict and reset stale low-precision optimizer states.",
    )
    parser.add_argument("--version", action="version", version=f"lightning-stale {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"lightning_stale.commands.{name}")
        cmd = sub.add_parser(name, help=module.HELP, description=textwrap.fill(module.HELP, 100),
                             epilog=getattr(module, "EPILOG", None),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
