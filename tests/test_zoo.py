"""The zoo (bench/zoo.py over tests/hf_zoo.py): every causal-LM architecture transformers ships, at 2 and 4 ranks.

The default suite runs the builder's unit tests and a rotating sample: two architectures the cached matrix
(bench/results/zoo.json) records as equal and split, chosen by a hash of today's date (the same all day;
TPCOMPILE_ZOO_SAMPLE=a,b picks them by name to rerun another day's sample). The whole matrix is marked slow.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
pytest.importorskip("transformers")
import hf_zoo  # noqa: E402
from bench import zoo  # noqa: E402
from bench.zoo_render import BEGIN, END, failure_class, reason_of, render  # noqa: E402

import tpcompile  # noqa: E402

META, ROWS = zoo.load_cache(zoo.CACHE)
SAMPLE_MAX_S = 10.0  # a sampled architecture took at most this long in the cached run


def rotating_sample(n: int = 2) -> list[str]:
    """`n` architectures the cache records as split, drawn by a hash of today's date (or named by the env)."""
    if os.environ.get("TPCOMPILE_ZOO_SAMPLE"):
        return os.environ["TPCOMPILE_ZOO_SAMPLE"].split(",")
    pool = sorted(a for a, r in ROWS.items() if r["status"] == "split" and r["seconds"] <= SAMPLE_MAX_S)
    seed = int(hashlib.sha256(datetime.date.today().isoformat().encode()).hexdigest(), 16)
    return random.Random(seed).sample(pool, min(n, len(pool)))


@pytest.mark.parametrize("arch", rotating_sample())
def test_rotating_sample_is_equal_and_split(arch: str) -> None:
    """An architecture the matrix recorded as split is still equal at 2 and 4 ranks, held x ws <= 1.25."""
    row = zoo.run_arch(arch)
    assert row["status"] == "split", f"{arch}: {reason_of(row)}"


def test_zoo_lists_every_causal_lm_type() -> None:
    """The zoo is exactly transformers' causal-LM mapping, and the cache has a row for each of them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import transformers

    assert hf_zoo.zoo_types() == list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if META.get("transformers") != transformers.__version__:
        pytest.skip(f"the cached matrix is of transformers {META.get('transformers')}: rerun python -m bench.zoo")
    missing = sorted(set(hf_zoo.zoo_types()) - set(ROWS))
    assert not missing, f"no cached row for {missing}: python -m bench.zoo runs them"
    assert all(r["status"] != "unsharded fails" or r["reason"] for r in ROWS.values())


def test_docs_section_is_the_cache_rendered() -> None:
    """docs/architectures.md's zoo section is what bench/zoo_render.py makes of the cache, never typed."""
    text = zoo.DOCS.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, "no zoo section: python -m bench.zoo --render writes it"
    section = BEGIN + text.split(BEGIN, 1)[1].split(END, 1)[0] + END
    names = [n for n in hf_zoo.zoo_types() if n in ROWS]
    assert section + "\n" == render([ROWS[n] for n in names], META), "stale: python -m bench.zoo --render"


def test_small_sizes_reach_sub_configs() -> None:
    """A composite config's text and vision parts get the small sizes, not their defaults."""
    config = hf_zoo.zoo_config("gemma3")
    for part in (config.text_config, config.vision_config):
        assert (part.hidden_size, part.num_hidden_layers, part.num_attention_heads) == (64, 2, 4)
    assert config.text_config.vocab_size == 128


def test_layer_lists_keep_one_layer_of_each_kind() -> None:
    """A per-layer list cut to two layers keeps the first of each kind (a hybrid keeps its attention layer)."""
    config = hf_zoo.zoo_config("beam")  # 5 sliding layers per full one by default
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert hf_zoo._layer_list(["conv"] * 5, 2) == ["conv", "conv"]


def test_composite_causal_lm_takes_its_decoder_config() -> None:
    """A causal LM declared for one part of a composite config (Musicgen's decoder) is built from that part."""
    assert hf_zoo.config_class("musicgen").__name__ == "MusicgenDecoderConfig"
    assert hf_zoo.config_class("llama").__name__ == "LlamaConfig"


def test_oversized_config_is_refused_before_building(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model over MAX_PARAMS is counted on the meta device and refused, never allocated."""
    monkeypatch.setattr(hf_zoo, "MAX_PARAMS", 1000)
    with pytest.raises(hf_zoo.TooLarge, match="parameters after shrinking"):
        hf_zoo.zoo_build("llama")


def test_one_line_reasons() -> None:
    """A TPCompileError gives its first sentence (no way out); any other exception its type and first line."""
    err = tpcompile.TPCompileError("input 'x' has size 13; shard with size 13. More text")
    assert hf_zoo.one_line(err) == "input 'x' has size 13"
    assert hf_zoo.one_line(RuntimeError("shape mismatch\ntraceback text")) == "RuntimeError: shape mismatch"
    assert failure_class("ws 2: input 'x' has size 13 in dim 1") == "input … has size N in dim N"


def test_unsharded_reason_names_the_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose forward raises is listed apart with the error in one line; a working one has no reason."""
    assert hf_zoo.unsharded_reason("gpt2") is None

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied\nmore")

    monkeypatch.setattr(torch.nn.Embedding, "forward", broken)
    assert hf_zoo.unsharded_reason("gpt2") == ("forward at (2, 8): RuntimeError: mat1 and mat2 shapes cannot be "
                                               "multiplied")


@pytest.mark.slow
def test_every_architecture_builds_or_has_a_reason() -> None:
    """Every listed architecture builds small and runs unsharded, or has a one-line reason why not."""
    reasons = {name: hf_zoo.unsharded_reason(name) for name in hf_zoo.zoo_types()}
    assert all(r is None or (r and "\n" not in r) for r in reasons.values())
    assert sum(r is None for r in reasons.values()) >= 0.95 * len(reasons), {k: v for k, v in reasons.items() if v}


@pytest.mark.slow
@pytest.mark.parametrize("arch", hf_zoo.zoo_types())
def test_whole_zoo(arch: str) -> None:
    """Every architecture that runs unsharded is equal at 2 and 4 ranks and split (held x ws <= 1.25)."""
    row = zoo.run_isolated(arch, zoo.BUDGET_S)
    if row["status"] == "unsharded fails":
        pytest.skip(f"does not run unsharded: {row['reason']}")
    assert row["status"] == "split", f"{arch}: {reason_of(row)}"
