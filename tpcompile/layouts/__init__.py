"""How a value is laid out across ranks, as data: `DimLayout`, one split dim as segments cut into pieces;
`token_shares`, the ranks' shares of a sequence's tokens."""
from tpcompile.layouts.dim_layout import (DimLayout, Segment, binds, block_of, dim_layout, even_cuts, holder_runs,
                                          holders, is_even, same_holdings, within_cut)

__all__ = ["DimLayout", "Segment", "binds", "block_of", "dim_layout", "even_cuts", "holder_runs", "holders", "is_even",
           "same_holdings", "within_cut"]
