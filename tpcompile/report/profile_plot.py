"""A PNG of the profile: one stacked bar per block (compute, communication, waiting), the prediction beside it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tpcompile.errors import TPCompileError


def save_png(data: dict[str, Any], path: Path) -> Path:
    """Draw the report's blocks as stacked horizontal bars into `path` (matplotlib, imported only here)."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display: the chart only goes to a file
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise TPCompileError(f"the profile chart {path} needs matplotlib, which is not installed "
                             f"({e}); pip install matplotlib, or leave out --png") from e
    blocks = data["blocks"]
    names = [b["module"] if len(b["module"]) <= 40 else b["module"][:37] + "..." for b in blocks]
    compute = [b["compute_ms"] for b in blocks]
    wait = [b["wait_ms"] for b in blocks]
    comm = [max(b["comm_ms"] - w, 0.0) for b, w in zip(blocks, wait)]
    predicted = [(b.get("predicted_compute_ms") or 0.0) + sum(c.get("predicted_ms") or 0.0 for c in b["collectives"])
                 for b in blocks]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(blocks) + 1.6))
    ys = list(range(len(blocks)))[::-1]
    ax.barh(ys, compute, color="#4c78a8", label="compute")
    ax.barh(ys, comm, left=compute, color="#f58518", label="communication (own cost)")
    ax.barh(ys, wait, left=[c + m for c, m in zip(compute, comm)], color="#e45756", label="waiting on other ranks")
    if any(predicted):
        ax.scatter(predicted, ys, marker="|", s=300, color="black", label="predicted (cost model)", zorder=3)
    ax.set_yticks(ys)
    ax.set_yticklabels(names, fontsize=8)
    ax.set_xlabel("ms per step (mean over steps and ranks)")
    title = f"{data.get('model', 'model')}: step {data['step_ms']:.1f} ms"
    if data.get("predicted_step_ms") is not None:
        title += f" (predicted {data['predicted_step_ms']:.1f} ms)"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
