"""Whether a token split (sequence parallelism) survives a reshape done on each rank's share of the tokens.

Under sequence parallelism a rank holds a contiguous share of every sequence's tokens. A reshape of the
token dim is valid on that share alone only when each entry of the output dim holds whole tokens of one
rank: patch merging (`x.view(B, T // 2, 2 * C)`) puts 2 neighbouring tokens in one entry, which needs a
share that is a multiple of 2. The share of a dynamic length is known only at run time.
"""
from __future__ import annotations

import math
from typing import Sequence

import sympy

from tpcompile.sharding_rules.rule_context import Size


def merged_tokens(blocks: Sequence[Size], inner: int, q: int, ws: int) -> int:
    """How many neighbouring tokens one entry of the output dim holds that a rank's share may split; 1 when none.

    `blocks` are the token dim's element runs (tokens x `inner`, the elements after the token dim in the
    reshaped dims), `q` the elements one entry of the output dim spans. When q divides inner, an entry is
    part of one token, for any share. Otherwise it holds k tokens' worth: fine only for a token count fixed
    by the model whose every rank's share is a multiple of k.
    """
    if inner % q == 0:
        return 1
    fixed = [sympy.sympify(f) for f in blocks]
    if all(f.is_number and float(f).is_integer() for f in fixed):  # a fixed count (an int, or a float like 8.0)
        if all(int(f) % ws == 0 and (int(f) // ws) % q == 0 for f in fixed):
            return 1
    return q // math.gcd(q, inner)
