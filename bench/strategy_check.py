"""The cost model against measurement: hybrid-runtime step times on this machine, predicted and measured.

    python bench/strategy_check.py            # measure, print the table
    python bench/strategy_check.py --write    # also README's "Choosing a layout" table, bench/results/strategy_check.*

Each configuration (bundled GPT and a Hugging Face Llama; tp, dp, pp, microbatches, DDP or FSDP)
trains with tpcompile.parallelize_train in real gloo processes on this machine, one thread per
rank; its step time is the fastest of the timed steps (after warm-up steps, over every round),
between barriers: the step least disturbed by other work on a shared machine. The
cost model predicts every configuration with this machine's calibration
(tpcompile.strategy.this_machine); the report gives the Spearman rank correlation of predicted and
measured step times, and for each model and world size the planner's own choice
(plan_parallel on this machine, measured too) against the fastest configuration measured.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tpcompile.strategy import plan_parallel, this_machine  # noqa: E402
from tpcompile.strategy.cost import Layout, estimate  # noqa: E402
from tpcompile.strategy.profile import build_profile  # noqa: E402
from tpcompile.strategy.tp_profile import tp_profile  # noqa: E402

BATCH, SEQ, VOCAB = 8, 64, 512
WARMUP, STEPS = 2, 6
TIMEOUT_S = 600
QUIET_WAIT_S = [30.0]  # longest wait for the shared machine to quiet down before a measurement (--max-wait)


@dataclass(frozen=True)
class Config:
    """One measured layout."""

    model: str
    tp: int
    dp: int
    pp: int
    microbatches: int
    data_parallel: str = "ddp"
    sequence_parallel: bool = False
    recompute: bool = False
    plan: tuple = ()  # (module path, "replicate") pairs

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    def layout(self) -> Layout:
        return Layout(self.tp, self.dp, self.pp, self.microbatches, self.recompute, self.sequence_parallel,
                      self.data_parallel)

    def label(self) -> str:
        opts = [self.data_parallel if self.dp > 1 else "", "seq-par" if self.sequence_parallel else "",
                "recompute" if self.recompute else "", f"{len(self.plan)} whole" if self.plan else ""]
        return f"tp {self.tp} x dp {self.dp} x pp {self.pp}, {self.microbatches} mb" + "".join(
            f", {o}" for o in opts if o)


def build_model(name: str) -> torch.nn.Module:
    """The two models, fixed seed, training mode."""
    torch.manual_seed(0)
    if name == "gpt":
        from tpcompile.models import GPT, GPTConfig
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=128,
                             fused_qkv=False, tie_weights=False)).train()
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False)
    return LlamaForCausalLM(cfg).train()


def call(name: str, ids: torch.Tensor) -> tuple[tuple, dict]:
    return ((ids,), {}) if name == "gpt" else ((), {"input_ids": ids, "use_cache": False})


def loss_fn(output: Any, ids: torch.Tensor) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    logits = output[0] if logits is None else logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def configs() -> list[Config]:
    """The measured layouts of each model: world sizes 1, 2 and 4, every mesh dim, microbatches, DDP and FSDP."""
    out = []
    for model in ("gpt", "llama"):
        out += [Config(model, 1, 1, 1, 1), Config(model, 1, 1, 1, 4),
                Config(model, 1, 2, 1, 1), Config(model, 1, 2, 1, 1, "fsdp"), Config(model, 2, 1, 1, 1),
                Config(model, 1, 1, 2, 2), Config(model, 1, 1, 2, 8),
                Config(model, 1, 4, 1, 1), Config(model, 2, 2, 1, 1), Config(model, 4, 1, 1, 1),
                Config(model, 1, 2, 2, 2), Config(model, 2, 1, 2, 4)]
    return out


def _rank(rank: int, cfg: Config, port: int, queue: Any) -> None:
    """One process of a measured run: rank 0 puts the per-step times on the queue."""
    import torch.distributed as dist
    import tpcompile
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.world)
        mesh = tpcompile.init_mesh(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp)
        model = build_model(cfg.model)
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(WARMUP + STEPS)]
        per, dp_rank = BATCH // cfg.dp, mesh["dp"].get_local_rank()
        a, k = call(cfg.model, batches[0][:per])
        hm = tpcompile.parallelize_train(model, mesh, loss_fn=loss_fn, example_inputs=a, example_kwargs=k,
                                         microbatches=cfg.microbatches, data_parallel=cfg.data_parallel,
                                         sequence_parallel=cfg.sequence_parallel, plan=dict(cfg.plan) or None,
                                         activation_checkpointing=cfg.recompute)
        opt = torch.optim.AdamW(hm.parameters(), lr=1e-3)
        times = []
        for i, ids in enumerate(batches):
            mine = ids[dp_rank * per:(dp_rank + 1) * per]
            a, k = call(cfg.model, mine)
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            hm.step(*a, target=mine, **k)
            opt.step()
            dist.barrier()
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        if rank == 0:
            queue.put({"times": times})
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # the parent reports it; the other ranks time out of their collectives
        queue.put({"error": traceback.format_exc(limit=6)})


def busy_cores(window: float = 2.0) -> float:
    """CPU cores kept busy by every process on the machine over the next `window` seconds (from /proc/stat)."""
    def sample() -> tuple[float, float]:
        fields = [float(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
        return sum(fields[:8]), idle
    try:
        total0, idle0 = sample()
        time.sleep(window)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):  # no /proc: the 1-minute load average instead
        return os.getloadavg()[0]
    return _cores() * (1.0 - (idle1 - idle0) / max(total1 - total0, 1e-9))


def wait_for_quiet(busy: float) -> float:
    """Wait (at most --max-wait) until other work keeps fewer than `busy` cores busy; what it kept busy at the end.

    Sampling the CPUs over 2 s, not the load average: the load average still counts the previous
    measurement's own ranks for about a minute after they exit.
    """
    deadline = time.monotonic() + QUIET_WAIT_S[0]
    seen = busy_cores()
    while seen >= busy and time.monotonic() < deadline:
        seen = busy_cores()
    return seen


def measure(cfg: Config) -> dict:
    """Run one configuration in cfg.world spawned processes; its fastest step (the least disturbed by other work)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, cfg, port, queue), daemon=True) for r in range(cfg.world)]
    for p in procs:
        p.start()
    try:
        got = queue.get(timeout=TIMEOUT_S)
    except Exception:
        got = {"error": f"no result within {TIMEOUT_S} s"}
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if "error" in got:
        return {"error": got["error"]}
    return {"measured_s": min(got["times"]), "median_s": statistics.median(got["times"]), "times": got["times"]}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def predictor(model: str) -> Any:
    """cfg -> predicted step seconds on this machine (the cost model, all units split as the runtime runs them)."""
    profile = build_profile(build_model(model), example_inputs=call(model, torch.ones(1, 8, dtype=torch.long))[0],
                            example_kwargs=call(model, torch.ones(1, 8, dtype=torch.long))[1], seq_len=SEQ)
    tpps = {t: tp_profile(profile, t) for t in (1, 2, 4)}

    def predict(cfg: Config) -> float:
        return estimate(profile, tpps.get(cfg.tp), this_machine(cfg.world), cfg.layout(), BATCH).step_s
    return predict


def chosen(model: str, world: int) -> tuple[Config, float, Any]:
    """The planner's choice for `model` on `world` ranks of this machine, as a Config, and its prediction."""
    a, k = call(model, torch.ones(1, 8, dtype=torch.long))
    s = plan_parallel(build_model(model), this_machine(world), example_inputs=a, example_kwargs=k,
                      global_batch=BATCH, seq_len=SEQ)
    cfg = Config(model, s.tp, s.dp, s.pp, s.microbatches, s.data_parallel, s.sequence_parallel, s.recompute,
                 tuple(sorted(s.plan.items())))
    return cfg, s.predicted_step_s, s


def run(repeat: int, quick: bool, quiet_busy: float) -> dict:
    """Measure every configuration (and each planner's choice), predict each, and compare."""
    from tpcompile.strategy.calibrate import calibration
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    wait_for_quiet(quiet_busy)
    cal = calibration(refresh=True)  # this machine as it is now; plan_parallel and the predictions read it from the cache
    todo = configs()
    if quick:
        todo = [c for c in todo if c.model == "gpt"][:6]
    predict = {m: predictor(m) for m in sorted({c.model for c in todo})}
    choices: dict[tuple[str, int], Config] = {}
    predicted: dict[Config, float] = {}
    for model in predict:
        for world in (2, 4):
            cfg, pred, _ = chosen(model, world)
            choices[(model, world)] = cfg
            predicted[cfg] = pred
            if cfg not in todo:
                todo.append(cfg)
    rows = {c: {"predicted_s": predicted[c] if c in predicted else predict[c.model](c)} for c in todo}
    order = list(todo)
    for r in range(repeat):
        random.Random(r).shuffle(order)
        for cfg in order:
            busy = wait_for_quiet(quiet_busy)
            got = measure(cfg)
            rows[cfg].setdefault("busy", []).append(round(busy, 2))
            print(f"{cfg.model:6} {cfg.label():45} {got.get('measured_s', float('nan')) * 1e3:9.1f} ms "
                  f"(predicted {rows[cfg]['predicted_s'] * 1e3:9.1f} ms) {got.get('error', '')}", flush=True)
            if "error" in got:
                rows[cfg].setdefault("errors", []).append(got["error"])
                continue
            best = rows[cfg].get("measured_s")
            rows[cfg]["measured_s"] = got["measured_s"] if best is None else min(best, got["measured_s"])
    done = [(c, r) for c, r in rows.items() if "measured_s" in r]
    rho = spearman([r["predicted_s"] for _, r in done], [r["measured_s"] for _, r in done])
    per_model = {m: spearman([r["predicted_s"] for c, r in done if c.model == m],
                             [r["measured_s"] for c, r in done if c.model == m]) for m in predict}
    verdicts = []
    for (model, world), cfg in choices.items():
        same = [(c, r) for c, r in done if c.model == model and c.world == world]
        if cfg not in dict(same) or not same:
            continue
        fastest = min(same, key=lambda x: x[1]["measured_s"])
        ratio = rows[cfg]["measured_s"] / fastest[1]["measured_s"]
        verdicts.append({"model": model, "world": world, "choice": cfg.label(),
                         "choice_measured_s": rows[cfg]["measured_s"], "fastest": fastest[0].label(),
                         "fastest_measured_s": fastest[1]["measured_s"], "ratio": ratio, "within_10pct": ratio <= 1.10})
    return {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "wall_s": time.perf_counter() - start,
            "repeat": repeat, "quiet_busy": quiet_busy, "max_wait_s": QUIET_WAIT_S[0],
            "loadavg_start": load_start, "loadavg_end": os.getloadavg()[0],
            "cores": _cores(), "calibration": _calibration_summary(cal),
            "calibration_raw": cal,  # as calibration() returned it: a later cost model can re-predict these rows
            "rows": [{"model": c.model, "world": c.world, "layout": c.label(), **r} for c, r in rows.items()],
            "spearman": rho, "spearman_per_model": per_model, "choices": verdicts,
            "failed": [{"model": c.model, "layout": c.label(), "errors": r["errors"]} for c, r in rows.items()
                       if "measured_s" not in r]}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _calibration_summary(cal: dict) -> dict:
    """The measured rates the predictions used (tpcompile.strategy.calibrate.calibration())."""
    nominal = cal["nominal_flops"] or cal["matmul_flops"]
    return {"measured_at": cal.get("measured_at", ""), "matmul_gflops": cal["matmul_flops"] / 1e9,
            "efficiency": cal["matmul_flops"] / nominal, "memory_gbps": cal["memory_bw"] / 1e9,
            "matmul_contention": cal.get("matmul_contention", 1.0),
            "memory_contention": cal.get("memory_contention", 1.0), "op_overhead_us": cal["op_overhead"] * 1e6,
            "gloo_alpha_us": cal.get("alpha_2", cal["alpha"]) * 1e6,
            "gloo_alpha_4_us": cal.get("alpha_4", float("nan")) * 1e6,
            "gloo_idle_alpha_us": cal.get("alpha_idle", float("nan")) * 1e6,
            "gloo_gbps": cal.get("bandwidth_2", cal["bandwidth"]) / 1e9,
            "microbatch_overhead_ms": cal.get("microbatch_overhead", 0.0) * 1e3,
            "step_overhead_ms": cal.get("step_overhead", 0.0) * 1e3,
            "fsdp_overhead_ms": cal.get("fsdp_overhead", 0.0) * 1e3}


def report(data: dict) -> str:
    """The markdown table and verdicts."""
    cal = data["calibration"]
    busy = [v for r in data["rows"] for v in r.get("busy", [])]
    lines = [f"Produced by `python bench/strategy_check.py --write` on {data['date']} with torch {data['torch']}: "
             f"{len(data['rows'])} configurations of `tpcompile.parallelize_train`, gloo over 127.0.0.1, one process "
             f"per rank and one thread each, on {data['cores']} CPU cores; global batch {BATCH} x {SEQ} tokens, "
             f"AdamW; the fastest of {STEPS} steps after {WARMUP} warm-up steps in each of {data['repeat']} "
             f"rounds; whole run {data['wall_s']:.0f} s.", "",
             f"The machine is shared: before each measurement the script waits up to {data['max_wait_s']:.0f} s for "
             f"other work to keep fewer than {data['quiet_busy']} of the {data['cores']} cores busy (sampled over "
             f"2 s), then measures anyway; other work kept {_spread(busy)} cores busy just before the measurements "
             f"(column `busy before`, one value per round); the 1-minute load average was "
             f"{data['loadavg_start']:.1f} at the start and {data['loadavg_end']:.1f} at the end.", "",
             f"This machine as the cost model sees it (`tpcompile.strategy.calibrate`, measured at the start of "
             f"the run): one thread alone reaches {cal['matmul_gflops']:.1f} GFLOP/s in a matmul "
             f"({cal['efficiency']:.0%} of nominal peak) and {cal['memory_gbps']:.1f} GB/s in an elementwise op; "
             f"with every core busy those run {cal['matmul_contention']:.2f}x and {cal['memory_contention']:.2f}x "
             f"slower; {cal['op_overhead_us']:.1f} us per op; gloo {cal['gloo_alpha_us']:.0f} us per ring step "
             f"between computing ranks at 2 processes and {cal['gloo_alpha_4_us']:.0f} us at 4 "
             f"({cal['gloo_idle_alpha_us']:.0f} us between idle ones), {cal['gloo_gbps']:.2f} GB/s; the runtime's "
             f"own {cal['microbatch_overhead_ms']:.1f} ms per microbatch, {cal['step_overhead_ms']:.1f} ms per step "
             f"and {cal['fsdp_overhead_ms']:.1f} ms per FSDP call. More ranks than cores share them.", "",
             "| model | ranks | layout | predicted ms | measured ms | busy before |", "|---|---:|---|---:|---:|---|"]
    for r in sorted(data["rows"], key=lambda r: (r["model"], r["world"], r.get("measured_s", 1e9))):
        measured = f"{r['measured_s'] * 1e3:.1f}" if "measured_s" in r else "failed"
        load = ", ".join(f"{v:.1f}" for v in r.get("busy", []))
        lines.append(f"| {r['model']} | {r['world']} | {r['layout']} | {r['predicted_s'] * 1e3:.1f} | {measured} | "
                     f"{load} |")
    per = ", ".join(f"{m} {v:.2f}" for m, v in data["spearman_per_model"].items())
    lines += ["", f"Spearman rank correlation of predicted and measured step times: **{data['spearman']:.2f}** over "
              f"{sum('measured_s' in r for r in data['rows'])} configurations (target >= 0.8; per model: {per}).", "",
              "The planner's choice (`plan_parallel` with this machine's calibration) against the fastest layout "
              "measured at the same number of ranks:", "",
              "| model | ranks | choice | measured ms | fastest measured | its ms | choice / fastest | within 10% |",
              "|---|---:|---|---:|---|---:|---:|:-:|"]
    for v in data["choices"]:
        lines.append(f"| {v['model']} | {v['world']} | {v['choice']} | {v['choice_measured_s'] * 1e3:.1f} | "
                     f"{v['fastest']} | {v['fastest_measured_s'] * 1e3:.1f} | {v['ratio']:.2f} | "
                     f"{'yes' if v['within_10pct'] else '**no**'} |")
    for f in data["failed"]:
        lines.append(f"\nfailed: {f['model']} {f['layout']}: {f['errors'][0].strip().splitlines()[-1]}")
    return "\n".join(lines) + "\n"


def _spread(values: list[float]) -> str:
    """'a to b (median c)' of a list of values."""
    if not values:
        return "not recorded"
    return f"{min(values):.1f} to {max(values):.1f} (median {statistics.median(values):.1f})"


def _replace(path: Path, key: str, body: str) -> None:
    text = path.read_text()
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    i, j = text.index(start) + len(start), text.index(end)
    path.write_text(text[:i] + "\n" + body + text[j:])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write README's table and bench/results/strategy_check.*")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of measurement (the fastest round counts)")
    parser.add_argument("--quick", action="store_true", help="six GPT configurations only (a smoke run)")
    parser.add_argument("--from-json", action="store_true",
                        help="measure nothing: render bench/results/strategy_check.json again (with --write, into "
                             "README and strategy_check.md)")
    parser.add_argument("--quiet-busy", type=float, default=0.5,
                        help="wait until other work keeps fewer cores than this busy before each measurement "
                             "(default 0.5; the machine is shared)")
    parser.add_argument("--max-wait", type=float, default=QUIET_WAIT_S[0],
                        help="longest wait for that before each measurement, in seconds (then it measures anyway "
                             "and reports the load)")
    ns = parser.parse_args(argv)
    QUIET_WAIT_S[0] = ns.max_wait
    out = ROOT / "bench" / "results"
    data = json.loads((out / "strategy_check.json").read_text()) if ns.from_json else \
        run(ns.repeat, ns.quick, ns.quiet_busy)
    text = report(data)
    print(text)
    if ns.write:
        (out / "strategy_check.json").write_text(json.dumps(data, indent=1))
        (out / "strategy_check.md").write_text(text)
        _replace(ROOT / "README.md", "strategy", text)
    ok = data["spearman"] >= 0.8 and all(v["within_10pct"] for v in data["choices"]) and not data["failed"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
