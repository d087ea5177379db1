"""docs/ops.md: every aten op of the table, the rule that handles it and where that rule is written."""
from __future__ import annotations

import inspect
from pathlib import Path

from tpcompile.sharding_rules import load_table
from tpcompile.sharding_rules.registry import RULES

_PKG = Path(__file__).resolve().parents[1]


def op_table_markdown() -> str:
    """The markdown of docs/ops.md, made from ops.yaml and the registered rules."""
    lines = ["# Ops and their rules", "",
             "Generated from `tpcompile/sharding_rules/ops.yaml` and the `@rule` functions "
             "(`python -m tpcompile.report.op_table > docs/ops.md`; a test checks it is current).",
             "",
             "Propagation (`passes/propagate.py`) runs the op's rule on every node; the rewriter "
             "(`passes/rewrite.py`, table `REWRITES`) then emits the op on each rank's values, except for "
             "row splits and vocabulary embeddings (partial results and one all-reduce), reductions and "
             "norms over a split dim (partial statistics and one small collective, `passes/rewrite_stats.py`), "
             "live dropout (masks from tpcompile's random streams) and metadata assertions about a split "
             "tensor's global size (dropped). An op with no row (or whose rule gives up) is placed by PyTorch "
             "DTensor's strategy for it when that needs no communication "
             "(`sharding_rules/dtensor_fallback.py`); otherwise it is replicated, with a warning if a split "
             "reaches it.",
             "", "| aten op | rule | fields | rule function |", "|---|---|---|---|"]
    for op, spec in sorted(load_table().items(), key=lambda kv: (kv[1].rule, kv[0])):
        fn = RULES[spec.rule].fn
        where = Path(inspect.getsourcefile(fn)).resolve().relative_to(_PKG)
        fields = ", ".join(f"{k} {v}" for k, v in spec.args.items()) or "-"
        lines.append(f"| `{op}` | {spec.rule} | {fields} | `{where}`: `{fn.__name__}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(op_table_markdown(), end="")
