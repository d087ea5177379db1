"""The planner's inputs: hardware quantities, cluster files checked with key and line, the strategy command line."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tpcompile.cli import main
from tpcompile.errors import TPCompileError
from tpcompile.strategy import Cluster, load_cluster
from tpcompile.strategy import comm
from tpcompile.strategy.quantities import parse_bytes, parse_flops, parse_rate, parse_seconds

CLUSTER_YAML = """\
# 32 nodes of 8 H100
gpus: 256
gpus_per_node: 8
gpu_memory: 80GB
intra_bw: 450GB/s
inter_bw: 400Gb/s
flops: 989TFLOPS
"""


@pytest.mark.parametrize("text, parse, expected", [
    ("80GB", parse_bytes, 80e9), ("80GiB", parse_bytes, 80 * 2 ** 30), ("1.5e9", parse_bytes, 1.5e9),
    ("450GB/s", parse_rate, 450e9), ("400Gb/s", parse_rate, 50e9), ("989TFLOPS", parse_flops, 989e12),
    ("989 TFLOP/s", parse_flops, 989e12), ("5us", parse_seconds, 5e-6), ("2ms", parse_seconds, 2e-3),
])
def test_quantities_read_as_written(text: str, parse, expected: float) -> None:
    """Decimal and binary prefixes, bytes and bits, FLOPS and durations read to the same numbers people mean."""
    assert math.isclose(parse("field", text), expected, rel_tol=1e-12)


@pytest.mark.parametrize("text, parse", [("80 parsecs", parse_bytes), ("fast", parse_rate), ("-3", parse_flops)])
def test_unreadable_quantity_names_field_and_example(text: str, parse) -> None:
    """A quantity that cannot be read is a TPCompileError naming the field and a valid spelling."""
    with pytest.raises(TPCompileError, match=r"--thing: .*write it like"):
        parse("--thing", text)


def test_cluster_file_reads_every_field(tmp_path: Path) -> None:
    """A cluster YAML file gives a Cluster with its quantities parsed (400Gb/s is 50 GB/s per GPU)."""
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER_YAML)
    c = load_cluster(path)
    assert (c.gpus, c.gpus_per_node, c.gpu_memory, c.intra_bw, c.inter_bw, c.flops) == \
        (256, 8, 80e9, 450e9, 50e9, 989e12)
    assert c.link(8) == (450e9, c.intra_latency) and c.link(16) == (50e9, c.inter_latency)


@pytest.mark.parametrize("text, message", [
    ("gpus: 16\ngpu_memroy: 80GB\n", r"line 2: unknown key 'gpu_memroy'; did you mean gpu_memory"),
    ("gpus: 16\ninter_bw: quick\n", r"line 2: inter_bw: cannot read 'quick'"),
    ("gpus: 16\ngpus: 8\n", r"line 2: key 'gpus' repeats line 1"),
    ("- gpus: 16\n", r"line 1: expected one 'key: value' per line"),
    ("gpus_per_node: 8\n", r"'gpus' is missing"),
    ("gpus: 12\ngpus_per_node: 8\n", r"12 GPUs, not a whole number of nodes of 8"),
    ("gpus: 16\nflops: [1, 2]\n", r"line 2: flops: expected a single value"),
    ("gpus: 16\n  bad: : yaml\n", r"YAML syntax error at line 2"),
])
def test_cluster_file_errors_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    """Every fault in a cluster file is a TPCompileError naming the file, the key and its line."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(TPCompileError, match=message):
        load_cluster(path)


def test_missing_cluster_file() -> None:
    """A cluster path that does not exist says so and how the file should look."""
    with pytest.raises(TPCompileError, match="does not exist.*gpus: 256"):
        load_cluster("/nonexistent/cluster.yaml")


def test_ring_collectives_follow_alpha_beta() -> None:
    """All-reduce moves 2(p-1)/p of the bytes in 2(p-1) steps, all-gather and reduce-scatter (p-1)/p in p-1 steps;
    a call over one rank moves nothing and costs nothing (the runtime skips the exchange)."""
    n, p, bw, alpha = 1e9, 8, 100e9, 1e-5
    ar, ag = comm.all_reduce(n, p, bw, alpha), comm.all_gather(n, p, bw, alpha)
    assert math.isclose(ar.seconds, 14 * alpha + 2 * 7 / 8 * n / bw) and math.isclose(ar.sent, 1.75e9)
    assert math.isclose(ag.seconds, 7 * alpha + 7 / 8 * n / bw) and comm.reduce_scatter is comm.all_gather
    assert comm.all_reduce(n, 1, bw, alpha) == comm.ZERO and comm.all_reduce(0, 4, bw, alpha) == comm.ZERO


def _strategy_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_has_the_contract_keys(capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints one object with tp, dp, pp, microbatches, predicted_step_s, memory_per_gpu_bytes, alternatives."""
    out = _strategy_json(capsys, ["strategy", "gpt", "--gpus", "4", "--gpus-per-node", "4", "--gpu-memory", "80GB",
                                  "--intra-bw", "450GB/s", "--inter-bw", "50GB/s", "--flops", "989TFLOPS",
                                  "--global-batch", "8", "--seq-len", "32", "--json"])
    for key in ("tp", "dp", "pp", "microbatches", "predicted_step_s", "memory_per_gpu_bytes", "alternatives"):
        assert key in out
    assert out["tp"] * out["dp"] * out["pp"] == 4 and out["predicted_step_s"] > 0
    assert out["alternatives"] and all(a["tp"] * a["dp"] * a["pp"] == 4 for a in out["alternatives"])
    assert all(a["predicted_step_s"] >= out["predicted_step_s"] for a in out["alternatives"] if a["fits"])


def test_cli_cluster_file_and_flag_override(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--cluster reads the file; a flag given beside it wins over the file's value."""
    path = tmp_path / "c.yaml"
    path.write_text("gpus: 8\ngpus_per_node: 8\ngpu_memory: 40GB\n")
    out = _strategy_json(capsys, ["strategy", "mlp", "--cluster", str(path), "--gpus", "4", "--gpus-per-node",
                                  "4", "--global-batch", "8", "--json"])
    assert out["cluster"]["gpus"] == 4 and out["cluster"]["gpu_memory"] == 40e9


def test_cli_table_names_the_choice(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --json the command prints the choice, the alternatives with why each lost, on stdout."""
    assert main(["strategy", "hf:llama", "--gpus", "2", "--gpus-per-node", "2", "--global-batch", "4",
                 "--seq-len", "16", "--config", "num_hidden_layers=2"]) == 0
    text = capsys.readouterr().out
    assert "chosen: tp " in text and "why not chosen" in text and "slower" in text


@pytest.mark.parametrize("argv, message", [
    (["strategy", "gpt", "--global-batch", "8"], "--gpus N"),
    (["strategy", "gpt", "--gpus", "4", "--gpu-memory", "lots", "--global-batch", "8"], "--gpu-memory: cannot read"),
    (["strategy", "gpt", "--gpus", "3", "--global-batch", "8", "--gpus-per-node", "2"], "not a whole number of nodes"),
    (["strategy", "gpt", "--gpus", "8", "--gpus-per-node", "1", "--global-batch", "3", "--seq-len", "16"],
     "divides the global batch"),
])
def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """Bad flags end in one 'error:' line naming the flag, with exit code 2."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]


def test_cluster_rejects_bad_fields() -> None:
    """A Cluster with a non-positive size or unknown dtype is refused with the field named."""
    with pytest.raises(TPCompileError, match="gpus must be an int"):
        Cluster(gpus=0)
    with pytest.raises(TPCompileError, match="dtype 'fp8'"):
        Cluster(gpus=8, dtype="fp8")
