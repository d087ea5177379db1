"""Damaged or mismatched weight files and DCP checkpoints raise TPCompileErrors naming the file and tensor (in
process); checkpoints move between parallelize, parallelize_train and stock DCP of the plain model (one 2-rank
gloo launch, tests/files_matrix.py; the Hugging Face Llama in a second one, under -m slow)."""
from __future__ import annotations

import copy
import glob
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as stock_dcp
from safetensors.torch import save_file
from torch import nn

import tpcompile
from files_matrix import DIRECTIONS, TABLE, buffered, launch_matrix, plain_wrong
from tpcompile import dcp
from tpcompile.checkpoint.weights import load_rank_weights
from tpcompile.passes.rank_module import local_tensor

Error = tpcompile.TPCompileError


def _rank0(model: nn.Module) -> tuple[Any, torch.fx.GraphModule]:
    """The model sharded at 2 ranks, and a fresh copy of rank 0's module."""
    x = torch.zeros(2, 16, device="meta" if next(model.parameters()).is_meta else "cpu")
    sm = tpcompile.shard(model, 2, example_inputs=(x,))
    return sm, copy.deepcopy(sm.rank(0))


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stock DCP checkpoint of Buffered's state dict (one process)."""
    path = tmp_path_factory.mktemp("stock") / "ckpt"
    stock_dcp.save(buffered().state_dict(), checkpoint_id=str(path), no_dist=True)
    return path


def _damaged(stock: Path, tmp_path: Path, how: str) -> Path:
    """A copy of the stock checkpoint, damaged as `how` says."""
    path = tmp_path / how
    shutil.copytree(stock, path)
    data = glob.glob(str(path / "*.distcp"))[0]
    if how == "no_distcp":
        os.remove(data)
    elif how == "cut_distcp":
        os.truncate(data, os.path.getsize(data) // 2)
    elif how == "garbled_distcp":
        with open(data, "r+b") as f:
            f.write(b"\xff" * 64)
    elif how == "garbled_metadata":
        (path / ".metadata").write_bytes(b"not a pickle")
    return path


NAMES = r"(?:'(?:up|down)\.(?:weight|bias)'|'scale')"  # Buffered's saved tensors


@pytest.mark.parametrize("how, says", [
    ("no_distcp", rf"incomplete: its data file __0_0\.distcp is missing \(it holds tensor {NAMES}"),
    ("cut_distcp", rf"truncated: __0_0\.distcp has \d+ bytes but tensor {NAMES} is stored up to byte"),
    ("garbled_distcp", rf"tensor {NAMES} cannot be read from __0_0\.distcp"),
    ("garbled_metadata", r"\.metadata' cannot be read \(UnpicklingError"),
])
def test_damaged_checkpoint_names_file_and_tensor(stock: Path, tmp_path: Path, how: str, says: str) -> None:
    """A missing, cut or garbled .distcp or .metadata is a TPCompileError naming the directory, file and tensor."""
    path = _damaged(stock, tmp_path, how)
    sm, gm = _rank0(buffered(1))
    with pytest.raises(Error, match=says) as err:
        dcp.load(gm, path, sharded=sm, rank=0, no_dist=True)
    assert str(path) in str(err.value)


def test_checkpoint_without_metadata_is_named(stock: Path, tmp_path: Path) -> None:
    """A directory of .distcp files without .metadata (a save that did not finish) is named as such."""
    path = _damaged(stock, tmp_path, "no_metadata")
    os.remove(path / ".metadata")
    sm, gm = _rank0(buffered(1))
    with pytest.raises(Error, match=r"has no \.metadata file"):
        dcp.load(gm, path, sharded=sm, rank=0, no_dist=True)
    with pytest.raises(Error, match=r"\.distcp files but no \.metadata: the save did not finish"):
        load_rank_weights(gm, sm, 0, path)  # what parallelize(weights=path) reads such a directory with


def test_checkpoint_of_another_model_names_tensors_and_shapes(tmp_path: Path) -> None:
    """Missing, extra and misshapen tensors are named with their shapes on both sides."""
    state = buffered().state_dict()
    state["extra.weight"] = torch.zeros(3, 4)
    state["up.weight"] = torch.zeros(32, 8)
    del state["down.bias"]
    stock_dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    sm, gm = _rank0(buffered(1))
    with pytest.raises(Error) as err:
        dcp.load(gm, tmp_path, sharded=sm, rank=0, no_dist=True)
    msg = str(err.value)
    assert f"checkpoint {str(tmp_path)!r} is not of this model" in msg
    assert "are not in it: down.bias [16]" in msg
    assert "not in the model: extra.weight [3, 4]" in msg
    assert "up.weight [32, 8] in the checkpoint vs [32, 16] in the model" in msg


@pytest.mark.parametrize("stored, model_dtype, loads", [
    (torch.bfloat16, torch.float32, True), (torch.float16, torch.float64, True),
    (torch.float64, torch.float32, False), (torch.int64, torch.float32, False),
])
def test_checkpoint_dtypes(tmp_path: Path, stored: torch.dtype, model_dtype: torch.dtype, loads: bool) -> None:
    """A lossless widening cast loads exactly; narrowing or int -> float names file, tensor, dtypes and the way out."""
    state = {k: (v * 100).to(stored) for k, v in buffered().state_dict().items()}
    stock_dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    sm, gm = _rank0(buffered(1).to(model_dtype))
    if loads:
        dcp.load(gm, tmp_path, sharded=sm, rank=0, no_dist=True)
        want = local_tensor(state["up.weight"].to(model_dtype), sm.slice_for("up.weight"), 0, 2)
        assert torch.equal(gm.get_parameter("up.weight"), want)
        return
    with pytest.raises(Error) as err:
        dcp.load(gm, tmp_path, sharded=sm, rank=0, no_dist=True)
    msg = str(err.value)
    assert str(tmp_path) in msg and f"is stored as {stored} but the model holds {model_dtype}" in msg
    assert f"model.to({stored})" in msg and "convert the" in msg


def test_safetensors_dtype_rule(tmp_path: Path) -> None:
    """The same rule for .safetensors: bfloat16 loads into float32, float64 into float32 raises naming the file."""
    model = buffered()
    save_file({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, str(tmp_path / "bf16.safetensors"))
    save_file({k: v.double() for k, v in model.state_dict().items()}, str(tmp_path / "f64.safetensors"))
    sm, gm = _rank0(buffered(1))
    load_rank_weights(gm, sm, 0, tmp_path / "bf16.safetensors")
    assert torch.equal(gm.scale, model.scale.to(torch.bfloat16).float())
    with pytest.raises(Error, match=r"f64\.safetensors'.*'[a-z.]+' is stored as torch\.float64 but the model holds "
                                    r"torch\.float32"):
        load_rank_weights(gm, sm, 0, tmp_path / "f64.safetensors")


def _safetensors(path: Path, how: str) -> Path:
    """A .safetensors file of Buffered, cut in half, empty or with a garbled header."""
    save_file(buffered().state_dict(), str(path))
    raw = path.read_bytes()
    path.write_bytes({"cut": raw[: len(raw) // 2], "empty": b"", "garbled": raw[:8] + b"#" * (len(raw) - 8)}[how])
    return path


@pytest.mark.parametrize("how, says", [
    ("cut", r"tensor '[a-z.]+' is stored up to byte \d+ but the file has \d+ bytes \(truncated\)"),
    ("empty", "header too small"), ("garbled", "invalid JSON in header"),
])
def test_damaged_safetensors_names_the_file(tmp_path: Path, how: str, says: str) -> None:
    """A truncated, empty or garbled .safetensors file is a TPCompileError naming it (and the cut tensor)."""
    path = _safetensors(tmp_path / "model.safetensors", how)
    sm, gm = _rank0(buffered(1))
    with pytest.raises(Error, match=f"weights file {str(path)!r}.*{says}"):
        load_rank_weights(gm, sm, 0, path)


@pytest.mark.parametrize("content, says", [
    ([torch.zeros(2)], "holds a list, not a state dict"),
    ({"model": {"up.weight": torch.zeros(2)}}, r"entry 'model' is not a tensor but dict; pass torch\.load"),
    (b"garbage", "cannot be loaded"),
])
def test_pt_that_is_not_a_state_dict(tmp_path: Path, content: Any, says: str) -> None:
    """A .pt file holding a list, a nested dict or garbage is a TPCompileError naming it."""
    path = tmp_path / "w.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    sm, gm = _rank0(buffered(1))
    with pytest.raises(Error, match=f"weights file {str(path)!r}.*{says}"):
        load_rank_weights(gm, sm, 0, path)


def test_buffers_in_tpcompile_checkpoints(stock: Path, tmp_path: Path) -> None:
    """dcp.save writes the persistent buffer but not the non-persistent one; a stock checkpoint loads into a rank."""
    sm, gm = _rank0(buffered())
    dcp.save(gm, tmp_path, sharded=sm, rank=0)
    saved = set(stock_dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata)
    assert "scale" in saved and "table" not in saved
    sm1, gm1 = _rank0(buffered(1))
    gm1.table.fill_(7.0)  # a value of its own, which a load must leave alone
    dcp.load(gm1, stock, sharded=sm1, rank=0, no_dist=True)
    model = buffered()
    for name, t in list(model.named_parameters()) + [("scale", model.scale)]:
        assert torch.equal(gm1.state_dict()[name], local_tensor(t, sm1.slice_for(name), 0, 2)), name
    assert torch.all(gm1.table == 7.0)


def test_old_checkpoint_with_non_persistent_buffer_is_read(tmp_path: Path) -> None:
    """A checkpoint that holds a non-persistent buffer (older tpcompile wrote them) is read, not called extra."""
    stock_dcp.save({**buffered().state_dict(), "table": torch.full((16,), 3.0)}, checkpoint_id=str(tmp_path),
                   no_dist=True)
    sm, gm = _rank0(buffered(1))
    dcp.load(gm, tmp_path, sharded=sm, rank=0, no_dist=True)
    assert torch.all(gm.table == 3.0)


def test_save_failure_is_a_tpcompile_error(tmp_path: Path) -> None:
    """A checkpoint that cannot be written (its path runs through a file) is a TPCompileError naming it."""
    (tmp_path / "file").write_text("x")
    sm, gm = _rank0(buffered())
    with pytest.raises(Error, match=r"could not write checkpoint '.*file/ckpt': rank 0: NotADirectoryError"):
        dcp.save(gm, tmp_path / "file" / "ckpt", sharded=sm, rank=0)


def test_missing_buffer_keeps_its_value_unless_meta(tmp_path: Path) -> None:
    """A persistent buffer the checkpoint lacks keeps a real value; built on meta it is an error naming it."""
    state = buffered().state_dict()
    del state["scale"]
    stock_dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    sm, gm = _rank0(buffered(1))
    kept = gm.scale.clone()
    dcp.load(gm, tmp_path, sharded=sm, rank=0, no_dist=True)
    assert torch.equal(gm.scale, kept)
    model = buffered(meta=True)
    model.table = TABLE.clone()  # only scale is left without a value
    sm, gm = _rank0(model)
    with pytest.raises(Error, match=r"lacks 1 tensor\(s\) that the model holds on the meta device.*: scale; "):
        dcp.load(gm, tmp_path, sharded=sm, rank=0, no_dist=True)


def test_meta_non_persistent_buffer_is_named_by_every_loader(stock: Path, tmp_path: Path) -> None:
    """A non-persistent buffer built on meta: state dict, .safetensors, .pt and DCP all name it and the way out."""
    state = buffered().state_dict()
    save_file(state, str(tmp_path / "w.safetensors"))
    torch.save(state, tmp_path / "w.pt")
    sm, gm = _rank0(buffered(meta=True))
    says = r"table is a non-persistent buffer .* build the module\(s\) owning it \(the model\) on a real device"
    for weights in (state, tmp_path / "w.safetensors", tmp_path / "w.pt"):
        with pytest.raises(Error, match=says):
            load_rank_weights(copy.deepcopy(gm), sm, 0, weights)
    with pytest.raises(Error, match=f"checkpoint {str(stock)!r} lacks.*{says}"):
        dcp.load(copy.deepcopy(gm), stock, sharded=sm, rank=0, no_dist=True)


def test_meta_model_with_real_buffer_module_loads(stock: Path) -> None:
    """The way out: the model on meta but its non-persistent buffer on a real device loads from stock DCP."""
    model = buffered(meta=True)
    model.table = TABLE.clone()  # as if the module owning it were built outside torch.device("meta")
    sm = tpcompile.shard(model, 2, example_inputs=(torch.zeros(2, 16, device="meta"),))
    ranks = [copy.deepcopy(sm.rank(r)) for r in range(2)]
    for r, gm in enumerate(ranks):
        dcp.load(gm, stock, sharded=sm, rank=r, no_dist=True)
    x = torch.randn(3, 16)
    outs = tpcompile.simulate_ranks(2, lambda r: ranks[r](x))
    with torch.no_grad():
        want = buffered()(x)
    for out in outs:
        torch.testing.assert_close(out, want)


# ---- every direction: stock DCP of the plain model, parallelize at 2 ranks, parallelize_train at (1, 2, 1) ----


@pytest.mark.gloo
@pytest.mark.parametrize("direction", [f"{m} {d}" for m in ("gpt", "buffered") for d in DIRECTIONS])
def test_checkpoints_move_every_direction(direction: str) -> None:
    """At both ranks, every tensor loaded along this direction equals the saved model's, bit for bit."""
    ranks, _ = launch_matrix(("gpt", "buffered"))
    assert [r[direction] for r in ranks] == [[], []]


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["gpt", "buffered"])
@pytest.mark.parametrize("saved_by", ["parallelize", "train"])
def test_sharded_checkpoints_load_into_the_plain_model(name: str, saved_by: str) -> None:
    """Stock torch.distributed.checkpoint.load fills the plain model from either checkpoint: the saved weights."""
    _, base = launch_matrix(("gpt", "buffered"))
    assert plain_wrong(name, f"{base}/{name}/{saved_by}") == []


@pytest.mark.gloo
def test_hybrid_meta_model_names_its_non_persistent_buffer() -> None:
    """parallelize_train on meta from DCP names the non-persistent buffer; built on a real device it keeps its value."""
    ranks, base = launch_matrix(("gpt", "buffered"))
    for r in ranks:
        msg = r["buffered train on meta"]
        assert f"checkpoint {base + '/buffered/stock'!r} lacks 1 tensor(s)" in msg, msg
        assert "table is a non-persistent buffer" in msg and "on a real device" in msg
        assert r["buffered train on meta, table real"] == []


@pytest.mark.gloo
@pytest.mark.slow
def test_llama_checkpoints_move_every_direction() -> None:
    """HF Llama (non-persistent rotary inv_freq): every direction, and into the plain model, bit for bit."""
    ranks, base = launch_matrix(("llama",))
    for direction in DIRECTIONS:
        assert [r[f"llama {direction}"] for r in ranks] == [[], []], direction
    for saved_by in ("parallelize", "train"):
        assert plain_wrong("llama", f"{base}/llama/{saved_by}") == [], saved_by


@pytest.mark.gloo
@pytest.mark.slow
def test_meta_llama_names_its_rotary_buffer() -> None:
    """Llama on meta: both entry points name inv_freq and the way out; with its rotary module real it loads."""
    ranks, _ = launch_matrix(("llama",))
    for r in ranks:
        for key in ("llama parallelize on meta", "llama train on meta"):
            assert "model.rotary_emb.inv_freq" in r[key] and "non-persistent buffer" in r[key], r[key]
            assert "on a real device" in r[key]
        assert r["llama parallelize on meta, rotary real"] == []
