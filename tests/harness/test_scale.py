"""The real-width scale models (harness/scale.py): what they are written as, and that their SSM scalars do what the
module says. Real widths need a GPU (tests/engine/test_scale_gpu.py); here each entry is shrunk to a few hundred
parameters a layer through config overrides, which keeps every drawing rule and the file layout."""

from __future__ import annotations

import json

import pytest
import torch

from harness import cli, scale
from reference.checkpoint import expected_shapes, load_checkpoint
from reference.model import BambaReference
from tests.helpers import unclamped_delta
from vendored.engine.weights import read_tensors

SHRUNK = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8)


@pytest.mark.parametrize("name", list(scale.SCALE))
def test_an_entry_loads_everywhere_in_one_shard_per_layer(name, tmp_path):
    path = scale.write_checkpoint(name, tmp_path / name, progress=False, **SHRUNK)
    cfg, weights = load_checkpoint(path)
    assert cfg.num_hidden_layers == scale.SCALE[name]["num_hidden_layers"]
    assert cfg.attn_layer_indices == tuple(scale.SCALE[name]["attn_layer_indices"])
    assert cfg.time_step_limit == tuple(scale.BAMBA_9B["time_step_limit"])
    assert set(weights) == set(expected_shapes(cfg)) and all(w.dtype == torch.bfloat16 for w in weights.values())
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(weights)
    assert len(set(index.values())) == cfg.num_hidden_layers + 1
    assert set(read_tensors(path)) == set(weights)                      # the vendored engine's own loader


def test_an_entry_is_the_same_bytes_every_time(tmp_path):
    a = scale.write_checkpoint("bamba9b-2layer", tmp_path / "a", progress=False, **SHRUNK)
    b = scale.write_checkpoint("bamba9b-2layer", tmp_path / "b", progress=False, **SHRUNK)
    c = scale.write_checkpoint("bamba9b-2layer", tmp_path / "c", seed=1, progress=False, **SHRUNK)
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert all((a / s).read_bytes() == (b / s).read_bytes() for s in shards)
    assert any((a / s).read_bytes() != (c / s).read_bytes() for s in shards)


def test_the_real_width_config_is_bamba_9b():
    raw = scale.config_dict("bamba9b-32layer")
    assert (raw["hidden_size"], raw["mamba_n_heads"], raw["mamba_d_head"], raw["mamba_d_state"], raw["vocab_size"],
            raw["mamba_chunk_size"], raw["num_attention_heads"], raw["num_key_value_heads"]) == (
        4096, 128, 64, 128, 128256, 256, 32, 8)
    with pytest.raises(KeyError, match="expected one of"):
        scale.config_dict("bamba9b-3layer")


def test_heads_decay_at_three_rates():
    """A quarter very slow (the state outlives a chunk of 256), a quarter slow, half fast."""
    A = scale.scale_ssm_scalars("model.layers.0.mamba.A_log", (128,), torch.Generator().manual_seed(0), "cpu")
    a = A.exp()
    kind = torch.arange(128) % 4
    assert ((a[kind == 0] >= 1e-3) & (a[kind == 0] <= 1e-2)).all()
    assert ((a[kind == 1] >= 0.02) & (a[kind == 1] <= 0.2)).all()
    assert (a[kind >= 2] >= 1).all()


def test_both_time_step_bounds_clamp_a_real_share_of_delta(tmp_path, monkeypatch):
    """Δ = softplus(dt + dt_bias) before the clamp, over every mamba layer, head and token of random prompts: at
    least 7% lies below the lower bound and 7% above the upper one. dt's spread does not depend on the width (the
    projection is scaled by 1/√fan_in), so the shrunk model measures what the real one does."""
    path = scale.write_checkpoint("bamba9b-4layer", tmp_path / "m", progress=False, **SHRUNK)
    ref = BambaReference.from_pretrained(path, dtype=torch.float32)
    delta = unclamped_delta(monkeypatch, ref, torch.randint(0, 300, (64,), generator=torch.Generator().manual_seed(0)))
    lo, hi = ref.cfg.time_step_limit
    below, above = float((delta < lo).float().mean()), float((delta > hi).float().mean())
    print(f"Δ below {lo}: {below:.3f}, above {hi}: {above:.3f}")
    assert below >= 0.07 and above >= 0.07, f"share below {lo}: {below:.3f}, above {hi}: {above:.3f}"


def test_write_model_command(tmp_path, capsys):
    assert cli.main(["write-model", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "scale bamba9b-2layer" in listed and "zoo   pure-mamba2" in listed
    assert "zoo   granite-moe4-top2 (GraniteMoeHybrid)" in listed
    assert cli.main(["write-model", "granite-moe4-top2", str(tmp_path / "g")]) == 0
    assert '"model_type": "granitemoehybrid"' in (tmp_path / "g" / "config.json").read_text()
    assert cli.main(["write-model", "pure-mamba2", str(tmp_path / "z")]) == 0
    assert (tmp_path / "z" / "model.safetensors").is_file()
    assert cli.main(["write-model", "pure-mamba2", str(tmp_path / "z")]) == cli.EXIT_USAGE     # not empty
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert cli.main(["write-model", "bamba9b-3layer", str(tmp_path / "y")]) == cli.EXIT_USAGE
    assert "unknown model 'bamba9b-3layer'" in capsys.readouterr().err
    assert cli.main(["write-model", "pure-mamba2"]) == cli.EXIT_USAGE
