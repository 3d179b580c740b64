"""reference/checkpoint.py: single-file and sharded safetensors; every malformed checkpoint named precisely."""

import json

import pytest
import torch
from safetensors.torch import save_file

from reference.checkpoint import CheckpointError, load_checkpoint, read_safetensors
from tests.helpers import random_bamba_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return random_bamba_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=3)


def _rewrite(src, dst, edit):
    """Copy a checkpoint with its tensors passed through edit(dict) -> dict."""
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(edit(read_safetensors(src)), str(dst / "model.safetensors"))
    return dst


def test_sharded_checkpoint_loads_the_same_tensors(checkpoint, tmp_path):
    tensors = read_safetensors(checkpoint)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    _, sharded = load_checkpoint(tmp_path)
    _, single = load_checkpoint(checkpoint)
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


def test_missing_tensor_is_named_with_its_shape(checkpoint, tmp_path):
    bad = _rewrite(checkpoint, tmp_path / "bad", lambda t: {k: v for k, v in t.items() if not k.endswith("2.mamba.D")})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mamba\.D: missing .*expected shape \(4,\)"):
        load_checkpoint(bad)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    bad = _rewrite(checkpoint, tmp_path / "bad", lambda t: {**t, "model.layers.0.mamba.extra": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mamba\.extra: unexpected"):
        load_checkpoint(bad)


def test_misshapen_tensor_names_expected_and_actual(checkpoint, tmp_path):
    bad = _rewrite(checkpoint, tmp_path / "bad", lambda t: {**t, "model.layers.0.mamba.A_log": torch.zeros(8)})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mamba\.A_log: expected shape \(4,\), got \(8,\)"):
        load_checkpoint(bad)


def test_missing_directory_and_missing_weights_are_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_safetensors(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        read_safetensors(tmp_path)


def test_tied_embeddings_use_the_embedding_as_head(tmp_path):
    tied = random_bamba_checkpoint(tmp_path / "tied", seed=4, tie_word_embeddings=True)
    _, weights = load_checkpoint(tied)
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]


def test_tied_config_with_a_different_head_is_an_error(tmp_path):
    tied = random_bamba_checkpoint(tmp_path / "tied", seed=4, tie_word_embeddings=True)
    bad = _rewrite(tied, tmp_path / "bad",
                   lambda t: {**t, "lm_head.weight": torch.randn_like(t["model.embed_tokens.weight"])})
    with pytest.raises(CheckpointError, match="lm_head.weight: tie_word_embeddings is true"):
        load_checkpoint(bad)


def test_a_granite_checkpoint_is_checked_by_its_own_names(tmp_path):
    """GraniteMoeHybrid keys (experts, router, shared MLP, its norm names) are what its config expects: one missing
    or a Bamba key among them is an error naming it."""
    from harness import zoo
    from reference.checkpoint import CheckpointError, check_weights, read_safetensors
    from reference.config import ModelConfig

    path = zoo.write_checkpoint("granite-moe4-top2", tmp_path)
    cfg, tensors = ModelConfig.from_json(path), read_safetensors(path)
    assert tensors["model.layers.0.block_sparse_moe.input_linear.weight"].shape == (4, 2 * 48, 64)
    check_weights(cfg, tensors)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.block_sparse_moe.router.layer.weight"}
    with pytest.raises(CheckpointError, match=r"model.layers.1.block_sparse_moe.router.layer.weight: missing"):
        check_weights(cfg, missing)
    bamba_named = dict(tensors)
    bamba_named["model.final_layernorm.weight"] = bamba_named.pop("model.norm.weight")
    with pytest.raises(CheckpointError, match="model.norm.weight: missing"):
        check_weights(cfg, bamba_named)
    wrong = dict(tensors)
    wrong["model.layers.2.block_sparse_moe.output_linear.weight"] = torch.zeros(4, 48, 64)      # (E, I, D) swapped
    with pytest.raises(CheckpointError, match=r"output_linear.weight: expected shape \(4, 64, 48\)"):
        check_weights(cfg, wrong)
