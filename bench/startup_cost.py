"""`python -m bench.startup_cost`: what the startup agreement and the input check cost.

1. The 7B shape (Llama-2-7B's config: 32 layers, width 4096, 32 heads, FFN 11008, vocabulary 32000) built on
   the meta device and sharded at world size 8 in this process: the seconds each part of the agreement takes
   on one rank (the tensors' records, the captured graph's and the plan's lines, the collective schedule's
   fake run) and the bytes each rank sends in each exchange (pickled, as all_gather_object sends them).
2. Those exchanges themselves: 8 gloo processes all-gathering payloads of exactly those sizes.
3. The per-call input check (check_inputs="always") on 2 gloo ranks: microseconds per call for token ids of
   (4, 128) and (8, 2048), and a call of the bundled GPT's rank module with and without it.

Prints a markdown table, writes bench/results/startup_cost.json and the table into docs/runtime.md;
`--doc-only` writes the table again from the stored results.
"""
from __future__ import annotations

import json
import pickle
import re
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "startup_cost.json"
DOC = Path(__file__).resolve().parent.parent / "docs" / "runtime.md"
LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)


def _timed(fn):  # noqa: ANN001, ANN202
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def seven_b(ws: int = 8) -> dict:
    """One rank's part of the agreement for the 7B shape on meta at world size `ws`: seconds and bytes."""
    import transformers

    import tpcompile
    from tpcompile.runtime.fingerprint import digest, graph_lines, plan_lines, tensor_entries
    from tpcompile.runtime.startup_check import schedule
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_7B))
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    entries, entries_s = _timed(lambda: tensor_entries(named, values=False))
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    sm, shard_s = _timed(lambda: tpcompile.shard(model, ws, example_kwargs={"input_ids": ids, "use_cache": False}))
    gm, rank_s = _timed(lambda: sm.rank(0))
    lines, graph_s = _timed(lambda: graph_lines(sm.captured))
    plan, plan_s = _timed(lambda: plan_lines(sm.plan, sm._ctx.overrides, [f"world_size={ws}"]))
    fake = [n.meta["val"] for n in sm.captured.graph.nodes if n.op == "placeholder"]
    from tpcompile.ops import collectives as C
    C.register_group("default", ws)  # shapes only: the fake run needs the world size, not a process group
    sched, sched_s = _timed(lambda: schedule(gm, fake, group_name=f"group of {ws}"))
    first = len(pickle.dumps(entries))
    second = len(pickle.dumps((digest(lines), digest(plan), sched)))
    return {"world_size": ws, "tensors": len(entries), "graph_nodes": len(lines), "collectives": len(sched),
            "state_records_s": entries_s, "graph_lines_s": graph_s, "plan_lines_s": plan_s, "schedule_s": sched_s,
            "agreement_s": entries_s + graph_s + plan_s + sched_s, "shard_s": shard_s, "rank_graph_s": rank_s,
            "state_bytes": first, "program_bytes": second,
            "graph_lines_bytes_on_mismatch": len(pickle.dumps(lines))}


def _exchange_rank(rank: int, sizes: list[int]) -> list[float]:
    import torch.distributed as dist
    out = []
    for n in sizes:
        payload = b"x" * n
        times = []
        for _ in range(5):
            got: list = [None] * dist.get_world_size()
            start = time.perf_counter()
            dist.all_gather_object(got, payload)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out


def exchanges(sizes: list[int], ws: int = 8) -> list[float]:
    """Median seconds of one all_gather_object of each payload size over `ws` gloo processes (the slowest rank)."""
    from tpcompile.runtime.launch import launch
    per_rank = launch(ws, _exchange_rank, sizes, timeout=600)
    return [max(r[i] for r in per_rank) for i in range(len(sizes))]


def _call_rank(rank: int) -> dict:
    import tpcompile
    from tpcompile.models import GPT, GPTConfig
    from tpcompile.runtime.input_check import InputCheck
    torch.set_num_threads(1)
    out = {}
    for shape in ((4, 128), (8, 2048)):
        ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(0))
        check = InputCheck(None, mode="always")
        for _ in range(20):
            check((ids,))
        start = time.perf_counter()
        for _ in range(300):
            check((ids,))
        out["x".join(map(str, shape))] = (time.perf_counter() - start) / 300
    torch.manual_seed(0)
    model = GPT(GPTConfig()).eval()
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    timed = {}
    for mode in ("always", "never"):
        gm = tpcompile.parallelize(model, example_inputs=(ids,), check_inputs=mode)
        with torch.no_grad():
            for _ in range(10):
                gm(ids)
            samples = []
            for _ in range(30):
                start = time.perf_counter()
                for _ in range(10):
                    gm(ids)
                samples.append((time.perf_counter() - start) / 10)
        timed[mode] = statistics.median(samples)
    out["gpt_forward_always_s"], out["gpt_forward_never_s"] = timed["always"], timed["never"]
    return out


def table(report: dict) -> str:
    """The markdown table of a report."""
    big, call = report["seven_b_ws8"], report["input_check"]
    us = lambda s: f"{1e6 * s:,.0f} µs"  # noqa: E731
    return "\n".join([
        "| what | cost |", "|---|---|",
        f"| 7B on meta at ws 8, one rank: records of {big['tensors']} tensors / lines of {big['graph_nodes']} graph "
        f"nodes / the plan / the schedule's fake run ({big['collectives']} collectives) | {big['state_records_s']:.3f} s "
        f"/ {big['graph_lines_s']:.3f} s / {big['plan_lines_s']:.3f} s / {big['schedule_s']:.2f} s |",
        f"| bytes each rank sends: tensors' records / digests and schedule | {big['state_bytes']:,} B / "
        f"{big['program_bytes']:,} B |",
        f"| the two exchanges among 8 gloo processes | {big['state_exchange_s'] * 1e3:.1f} ms + "
        f"{big['program_exchange_s'] * 1e3:.1f} ms |",
        f"| on a mismatch only: the graph's lines ({big['graph_lines_bytes_on_mismatch']:,} B per rank) | "
        f"{big['mismatch_exchange_s'] * 1e3:.1f} ms |",
        f"| input check per call (check_inputs='always'), ids 4x128 / 8x2048, 2 gloo ranks | {us(call['4x128'])} / "
        f"{us(call['8x2048'])} |",
        f"| bundled GPT rank forward (4x64 ids), check_inputs 'always' / 'never' | {us(call['gpt_forward_always_s'])} "
        f"/ {us(call['gpt_forward_never_s'])} |"])


def write_doc(report: dict) -> None:
    """Replace the table between the startup-cost markers of docs/runtime.md."""
    doc = DOC.read_text()
    DOC.write_text(re.sub(r"(<!-- startup-cost:start -->\n).*?(<!-- startup-cost:end -->)",
                          lambda m: m.group(1) + table(report) + "\n" + m.group(2), doc, flags=re.S))


def main() -> int:
    if "--doc-only" in sys.argv:  # the table again from the last run's results
        write_doc(json.loads(RESULTS.read_text()))
        return 0
    big = seven_b()
    secs = exchanges([big["state_bytes"], big["program_bytes"], big["graph_lines_bytes_on_mismatch"]])
    big.update(state_exchange_s=secs[0], program_exchange_s=secs[1], mismatch_exchange_s=secs[2])
    from tpcompile.runtime.launch import launch
    calls = launch(2, _call_rank, timeout=600)
    call = {k: max(r[k] for r in calls) for k in calls[0]}
    report = {"seven_b_ws8": big, "input_check": call, "torch": torch.__version__}
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))
    write_doc(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
