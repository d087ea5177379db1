"""`tpcompile strategy MODEL`: the parallel layout the cost model chooses for MODEL on a cluster, and why."""
from __future__ import annotations

import argparse
import json
import warnings

from tpcompile.cli.common import one_line, parse_config
from tpcompile.models.spec import ACCEPTED_FORMS
from tpcompile.cli.progress import note, step
from tpcompile.errors import TPCompileError

# flag -> Cluster field; None defaults leave the cluster file's value (or the Cluster default) in place
CLUSTER_FLAGS = {"gpus": "gpus", "gpus_per_node": "gpus_per_node", "gpu_memory": "gpu_memory",
                 "intra_bw": "intra_bw", "inter_bw": "inter_bw", "flops": "flops", "efficiency": "efficiency"}


def add_parser(sub: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    """Register the subcommand."""
    p = sub.add_parser(
        "strategy", parents=[parent], help="choose tp, dp, pp, microbatches, recompute for a cluster",
        description="Build MODEL on the meta device (no weights are allocated), capture it at the planning "
                    "sequence length, and search every layout of --gpus GPUs (tp within a node x dp x pp, "
                    "microbatches, recompute, sequence parallelism, DDP or FSDP, per-unit split or replicate) "
                    "with a cost model; print the choice, the best alternatives and why each lost. "
                    "Hardware defaults are an H100 SXM node (8 x 80GB, 450GB/s NVLink, 50GB/s network "
                    "per GPU, 989TFLOPS bf16); a --cluster file sets any of them, flags override it.",
        epilog=f"MODEL is one of: {ACCEPTED_FORMS}. docs/strategy.md explains the cost model.")
    p.add_argument("model", metavar="MODEL", help=ACCEPTED_FORMS)
    p.add_argument("--cluster", metavar="FILE", help="a cluster YAML file (keys as the flags, with _: "
                                                     "gpus, gpus_per_node, gpu_memory, intra_bw, ...)")
    p.add_argument("--gpus", metavar="N", help="GPUs in all (required without --cluster)")
    p.add_argument("--gpus-per-node", metavar="G", help="GPUs per node (default 8); tp stays within a node")
    p.add_argument("--gpu-memory", metavar="BYTES", help="memory per GPU, e.g. 80GB (default)")
    p.add_argument("--intra-bw", metavar="RATE", help="bandwidth per GPU within a node, e.g. 450GB/s (default)")
    p.add_argument("--inter-bw", metavar="RATE", help="network bandwidth per GPU across nodes, e.g. 50GB/s "
                                                      "(default; 400Gb/s also reads)")
    p.add_argument("--flops", metavar="RATE", help="dense peak per GPU, e.g. 989TFLOPS (default)")
    p.add_argument("--efficiency", metavar="FRACTION",
                   help="fraction of --flops matmuls reach (default 0.56, fit to a published run: docs/strategy.md)")
    p.add_argument("--global-batch", type=int, required=True, metavar="B", help="samples per training step")
    p.add_argument("--seq-len", type=int, default=None, metavar="S",
                   help="tokens per sample (default: the example inputs' length)")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="override a size or switch of an hf: or bundled model, e.g. --config hidden_size=8192 "
                        "(repeatable)")
    p.add_argument("--inference", action="store_true", help="plan forward passes only (no gradients, no optimizer)")
    p.add_argument("--top", type=int, default=5, metavar="K", help="alternatives to show (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run)


def resolve_cluster(ns: argparse.Namespace):  # -> Cluster
    """The cluster from --cluster and the hardware flags (flags win)."""
    from tpcompile.strategy.cluster import Cluster, load_cluster, with_fields
    flags = {field: getattr(ns, flag) for flag, field in CLUSTER_FLAGS.items() if getattr(ns, flag) is not None}
    if ns.cluster:
        base = load_cluster(ns.cluster)
    else:
        if "gpus" not in flags:
            raise TPCompileError("tpcompile strategy: say how many GPUs with --gpus N (or give a --cluster FILE)")
        from tpcompile.strategy.cluster import PARSERS
        base = Cluster(gpus=PARSERS["gpus"]("--gpus", flags["gpus"]))
    return with_fields(base, **flags)


def run(ns: argparse.Namespace) -> int:
    """Plan and print the table (or the JSON object)."""
    from tpcompile.strategy import plan_parallel
    from tpcompile.strategy.planner import meta_model

    cluster = resolve_cluster(ns)
    config = parse_config(ns.config)
    with step(f"building {ns.model} on the meta device"):
        model, args, kwargs = meta_model(ns.model, config)
    with step(f"capturing {type(model).__name__} and searching layouts of {cluster.gpus} GPUs"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            strategy = plan_parallel(model, cluster, example_inputs=args, example_kwargs=kwargs,
                                     global_batch=ns.global_batch, seq_len=ns.seq_len, training=not ns.inference)
    for w in caught:
        from tpcompile.errors import TPCompileWarning
        if issubclass(w.category, TPCompileWarning):
            note(f"warning: {one_line(str(w.message))}")
    strategy.model = f"{strategy.model} ({ns.model})"
    if ns.json:
        print(json.dumps(strategy.to_dict()))
        return 0
    print(strategy.table(top=ns.top), end="")
    return 0
