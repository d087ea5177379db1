"""The `tpcompile` command line: plan, dump, diff, verify (alias check) and demo, one module each."""
from tpcompile.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
