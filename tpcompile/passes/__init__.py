"""Compiler passes, one per file, each a function `name_pass(gm, ctx) -> gm`."""
