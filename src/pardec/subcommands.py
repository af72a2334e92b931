"""``python -m <package> <subcommand> [options]``: a subcommand names a module of the package whose ``main(argv,
prog)`` takes the rest of the command line (:func:`dispatch`, shared by :mod:`pardec.bench` and
:mod:`pardec.report`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence


def dispatch(package: str, description: str, commands: dict[str, tuple[str, str]],
             argv: Sequence[str] | None = None):
    """Run ``commands[argv[0]]`` = (module of ``package``, one-line help) on ``argv[1:]``; ``--help`` (or nothing)
    lists the subcommands, an unknown one is refused with the valid choices. Returns what its ``main`` returns."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = f"python -m {package}"
    epilog = "subcommands:\n" + "\n".join(f"  {name:<12} {text}" for name, (_, text) in commands.items())
    epilog += f"\n\n'{prog} <subcommand> --help' describes one."
    ap = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("subcommand", choices=list(commands), metavar="subcommand",
                    help="one of: " + ", ".join(commands))
    if not argv:
        ap.print_help()
        ap.exit(2)
    if argv[0] in ("-h", "--help"):
        ap.print_help()
        ap.exit(0)
    if argv[0] not in commands:
        ap.error(f"unknown subcommand {argv[0]!r} (choose from {', '.join(commands)})")
    module = importlib.import_module(f"{package}.{commands[argv[0]][0]}")
    return module.main(argv[1:], prog=f"{prog} {argv[0]}")
