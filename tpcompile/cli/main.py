"""The parser and the entry point: errors become one line on stderr, --debug shows the traceback."""
from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch

from tpcompile.cli import demo, diff, dump, generate, plan, profile, strategy, verify
from tpcompile.cli.common import one_line
from tpcompile.cli.failures import shadowing_folder, shadowing_message
from tpcompile.models.spec import ACCEPTED_FORMS
from tpcompile.errors import TPCompileError

EXIT_ERROR = 2  # usage and user errors; 1 is a verification mismatch


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line: 'tpcompile plan: error: ... (see tpcompile plan --help)'."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with all subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's parser would otherwise reset a flag given before the subcommand to its default
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an error")
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="show tpcompile's log lines with their rank (-v info, -vv debug; also TPCOMPILE_LOG=info)")
    parser = _Parser(prog="tpcompile", parents=[common],
                     description="Automatic tensor parallelism for PyTorch models: see what the compiler does "
                                 "to every rank, and check it.", epilog=f"MODEL is one of: {ACCEPTED_FORMS}")
    parser.add_argument("--version", action="version", version=f"tpcompile {version()} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    plan.add_parser(sub, common)
    dump.add_parser(sub, common)
    diff.add_parser(sub, common)
    verify.add_parser(sub, common)
    verify.add_parser(sub, common, name="check", alias_of="verify")
    demo.add_parser(sub, common)
    strategy.add_parser(sub, common)
    generate.add_parser(sub, common)
    profile.add_parser(sub, common)
    return parser


def version() -> str:
    """The installed distribution's version, else the package's own."""
    try:
        return importlib.metadata.version("tpcompile")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
        import tpcompile
        return str(getattr(tpcompile, "__version__", "unknown"))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    folder = shadowing_folder()
    if folder is not None:  # nothing below would work: say why instead of an AttributeError
        print(shadowing_message(folder), file=sys.stderr)
        return EXIT_ERROR
    try:
        ns = build_parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    ns.debug, ns.verbose = getattr(ns, "debug", False), getattr(ns, "verbose", 0)
    quiet = None
    if ns.verbose and not ns.debug:
        from tpcompile import logs
        quiet = logs.verbose(ns.verbose)  # tpcompile's lines with their rank, torch's held back
    elif not ns.debug:
        # torch logs warnings and errors (a failed fake-tensor run) while export fails or guesses; the
        # one-line error says what matters
        logging.disable(logging.CRITICAL)
    try:
        return ns.func(ns)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # every failure is one line unless --debug asks for the traceback
        if ns.debug:
            raise
        if isinstance(exc, (TPCompileError, OSError)):
            print(f"error: {one_line(str(exc))}", file=sys.stderr)
        else:
            print(f"error: unexpected {type(exc).__name__}: {one_line(str(exc))} "
                  f"(run again with --debug for the traceback, and please report it)", file=sys.stderr)
        return EXIT_ERROR
    finally:
        logging.disable(logging.NOTSET)
        if quiet is not None:
            quiet()
