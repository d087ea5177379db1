"""The cluster a layout is planned for: GPUs, nodes, memory, links and compute, from flags, a dict or a YAML file.

A cluster file holds one `key: value` per line with the field names of `Cluster`; quantities are
written as people write them (tpcompile/strategy/quantities.py):

    gpus: 256
    gpus_per_node: 8
    gpu_memory: 80GB
    intra_bw: 450GB/s      # NVLink, per GPU
    inter_bw: 50GB/s       # InfiniBand, per GPU (400 Gb/s)
    flops: 989TFLOPS       # dense bf16 peak per GPU

Files are read with the safe YAML loader and checked like plan files (tpcompile/overrides.py):
every error names the file, the key and its line.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

import yaml

from tpcompile.errors import TPCompileError
from tpcompile.strategy.quantities import (parse_bytes, parse_fraction, parse_memory, parse_peak, parse_rate,
                                           parse_seconds)

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Fraction of a GPU's dense peak that large training matmuls reach; fit to one published run
# (docs/strategy.md, "Calibration"), the only constant not read off the model or the flags.
DEFAULT_EFFICIENCY = 0.56


@dataclass(frozen=True)
class Cluster:
    """Hardware per GPU (rates are per GPU: a node's NVLink and each GPU's own network port)."""

    gpus: int
    gpus_per_node: int = 8
    gpu_memory: float = 80e9  # bytes
    intra_bw: float = 450e9  # bytes/s within a node
    inter_bw: float = 50e9  # bytes/s across nodes
    flops: float = 989e12  # dense peak, FLOP/s
    efficiency: float = DEFAULT_EFFICIENCY  # fraction of `flops` that matmuls reach
    memory_bw: float = 3.35e12  # bytes/s, for the memory-bound ops
    intra_latency: float = 10e-6  # seconds per collective step within a node
    inter_latency: float = 20e-6  # seconds per collective step across nodes
    op_overhead: float = 0.0  # seconds per executed op (launch / dispatch)
    microbatch_overhead: float = 0.0  # seconds per microbatch and stage outside the ops (schedule, loss, hooks)
    fsdp_overhead: float = 0.0  # seconds per FSDP unit and gather or reduce call outside the transfer
    step_overhead: float = 0.0  # seconds per training step outside the ops and microbatches (optimizer calls, hooks)
    overlap: float = 1.0  # fraction of data-parallel communication that can hide behind compute
    shared_cores: int = 0  # > 0: the ranks are processes taking turns on this many cores (this machine)
    optimizer_bytes: float = 32.0  # per parameter and optimizer step, read and written (a fused Adam: 32)
    optimizer_ops: float = 1.0  # ops per parameter tensor and optimizer step, each costing op_overhead
    dtype: str = "bf16"  # compute and activation dtype; weights, gradients and Adam state cost 16 B/param
    memory_margin: float = 0.1  # fraction of GPU memory kept free (allocator, workspace, framework)
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.shared_cores, bool) or not isinstance(self.shared_cores, int) or self.shared_cores < 0:
            raise TPCompileError(f"cluster shared_cores must be an int >= 0 (0: a device per rank), "
                                 f"got {self.shared_cores!r}")
        for key in ("gpus", "gpus_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TPCompileError(f"cluster {key} must be an int >= 1, got {value!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise TPCompileError(f"cluster has {self.gpus} GPUs, not a whole number of nodes of "
                                 f"{self.gpus_per_node}; give gpus as a multiple of gpus_per_node")
        if self.dtype not in DTYPE_BYTES:
            raise TPCompileError(f"cluster dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        for key in ("gpu_memory", "intra_bw", "inter_bw", "flops", "efficiency", "memory_bw", "optimizer_bytes",
                    "optimizer_ops"):
            if not getattr(self, key) > 0:
                raise TPCompileError(f"cluster {key} must be positive, got {getattr(self, key)!r}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one activation (or gathered weight) element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def usable_memory(self) -> float:
        """Bytes per GPU a layout may plan to use."""
        return self.gpu_memory * (1.0 - self.memory_margin)

    @property
    def matmul_rate(self) -> float:
        """FLOP/s that matmuls reach."""
        return self.flops * self.efficiency

    def link(self, span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a group whose ranks lie within `span` consecutive ranks."""
        if span <= self.gpus_per_node:
            return self.intra_bw, self.intra_latency
        return self.inter_bw, self.inter_latency

    def describe(self) -> str:
        """One line: '256 GPUs (32 nodes of 8), 80 GB, 989 TFLOPS x 0.56, 450 / 50 GB/s'."""
        from tpcompile.strategy.quantities import format_flops, format_rate
        nodes = max(1, self.gpus // self.gpus_per_node)
        return (f"{self.name + ': ' if self.name else ''}{self.gpus} GPUs ({nodes} node{'s' * (nodes > 1)} of "
                f"{min(self.gpus, self.gpus_per_node)}), {self.gpu_memory / 1e9:.0f} GB each, "
                f"{format_flops(self.flops)} x {self.efficiency:.2f}, links {format_rate(self.intra_bw)} "
                f"within / {format_rate(self.inter_bw)} across nodes, {self.dtype}")


def _int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            if isinstance(value, str) and value.strip().isdigit():
                return int(value)
        except ValueError:
            pass
        raise TPCompileError(f"{field}: {value!r} is not a whole number")
    return value


def _number(field: str, value: Any) -> float:
    try:
        if not isinstance(value, bool):
            return float(value)
    except (TypeError, ValueError):
        pass
    raise TPCompileError(f"{field}: {value!r} is not a number")


def _text(field: str, value: Any) -> str:
    return str(value)


PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "gpus": _int, "gpus_per_node": _int, "gpu_memory": parse_memory, "intra_bw": parse_rate,
    "inter_bw": parse_rate, "flops": parse_peak, "efficiency": parse_fraction, "memory_bw": parse_rate,
    "intra_latency": parse_seconds, "inter_latency": parse_seconds, "op_overhead": parse_seconds,
    "microbatch_overhead": parse_seconds, "fsdp_overhead": parse_seconds, "step_overhead": parse_seconds,
    "overlap": parse_fraction, "shared_cores": _int, "optimizer_bytes": parse_bytes,
    "optimizer_ops": _number, "dtype": _text, "memory_margin": parse_fraction, "name": _text,
}
EXAMPLE = "gpus: 256"


def cluster_from_dict(values: dict[str, Any], where: Callable[[str], str] = lambda k: "") -> Cluster:
    """A Cluster from field -> value (quantities as text or numbers); `where(key)` locates a key in messages."""
    known = sorted(PARSERS)
    fields: dict[str, Any] = {}
    for key, value in values.items():
        if key not in PARSERS:
            close = difflib.get_close_matches(str(key), known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; known keys are {', '.join(known)}"
            raise TPCompileError(f"cluster{where(key)}: unknown key {key!r}{hint}")
        fields[key] = PARSERS[key](f"cluster{where(key)}: {key}", value)
    if "gpus" not in fields:
        raise TPCompileError(f"cluster{where('')}: 'gpus' is missing; say how many GPUs, e.g. '{EXAMPLE}'")
    try:
        return Cluster(**fields)
    except TPCompileError as e:
        source = where("").strip()
        raise TPCompileError(f"{e} ({source})" if source else str(e)) from None


def load_cluster(path: Union[str, os.PathLike]) -> Cluster:
    """Read and validate a cluster YAML file; errors name the file, the key and its line."""
    p = Path(path)
    if not p.is_file():
        raise TPCompileError(f"cluster file {str(p)!r} does not exist or is not a file; pass the path of a "
                             f"YAML file with lines like '{EXAMPLE}'")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TPCompileError(f"cluster file {p} cannot be read as UTF-8 text ({e})") from e
    return parse_cluster(text, str(p))


def parse_cluster(text: str, source: str = "<cluster>") -> Cluster:
    """Validate cluster YAML text (see load_cluster); `source` names it in messages."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        raise TPCompileError(f"cluster file {source}: YAML syntax error{at}: {getattr(e, 'problem', e)}; "
                             f"each line should read like '{EXAMPLE}'") from e
    if root is None or not isinstance(root, yaml.MappingNode):
        line = 1 if root is None else root.start_mark.line + 1
        raise TPCompileError(f"cluster file {source} line {line}: expected one 'key: value' per line, "
                             f"e.g. '{EXAMPLE}'")
    values: dict[str, Any] = {}
    lines: dict[str, int] = {}
    for key_node, value_node in root.value:
        line = key_node.start_mark.line + 1
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
            raise TPCompileError(f"cluster file {source} line {line}: a key must be a field name such as 'gpus'")
        key = key_node.value
        if key in lines:
            raise TPCompileError(f"cluster file {source} line {line}: key {key!r} repeats line {lines[key]}")
        if not isinstance(value_node, yaml.ScalarNode):
            raise TPCompileError(f"cluster file {source} line {value_node.start_mark.line + 1}: {key}: expected a "
                                 f"single value, e.g. '{EXAMPLE}'")
        values[key] = yaml.safe_load(value_node.value) if value_node.tag != "tag:yaml.org,2002:str" \
            else value_node.value
        lines[key] = line
    return cluster_from_dict(values, lambda k: f" file {source} line {lines[k]}" if k in lines else
                             f" file {source}")


def as_cluster(value: Any) -> Cluster:
    """A Cluster from a Cluster, a dict of fields, or the path of a cluster YAML file."""
    if isinstance(value, Cluster):
        return value
    if isinstance(value, dict):
        return cluster_from_dict(value)
    if isinstance(value, (str, os.PathLike)):
        return load_cluster(value)
    raise TPCompileError(f"cluster must be a tpcompile.strategy.Cluster, a dict of its fields or the path of a "
                         f"cluster YAML file; got {type(value).__name__}")


def with_fields(cluster: Cluster, **changes: Any) -> Cluster:
    """A copy of `cluster` with some fields parsed from text and replaced."""
    parsed = {k: PARSERS[k](f"--{k.replace('_', '-')}", v) for k, v in changes.items() if v is not None}
    return dataclasses.replace(cluster, **parsed)
