"""The config zoo's checkpoints (harness/zoo.py): deterministic, in the Hugging Face layout, and drawn so that the
fields they vary really act (both time-step bounds clamp a real share of Δ, the pad token sits inside prompts)."""

from __future__ import annotations

import torch
from safetensors import safe_open

from harness import zoo
from reference.model import BambaReference
from tests.helpers import unclamped_delta


def test_an_entry_is_the_same_bytes_every_time(tmp_path):
    a = zoo.write_checkpoint("groups2-kv-heads-equal-q-heads", tmp_path / "a")
    b = zoo.write_checkpoint("groups2-kv-heads-equal-q-heads", tmp_path / "b")
    for name in ("config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_tied_entry_stores_no_head(tmp_path):
    path = zoo.write_checkpoint("tied-embeddings-vocab300", tmp_path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys


def test_pad_entry_puts_the_pad_token_inside_prompts():
    pad = zoo.pad_token_id("rms-eps0.1-pad-in-prompts")
    tokens = zoo.prompt_source("rms-eps0.1-pad-in-prompts").tokens(20, 0)
    assert pad is not None and tokens.count(pad) >= 6 and tokens[0] == pad


def test_both_time_step_bounds_clamp_a_real_share_of_delta(tmp_path, monkeypatch):
    """Δ = softplus(dt + dt_bias) before the clamp, over every mamba layer, head and token of a 40-token prompt: at
    least a tenth of it lies below the lower bound and a tenth above the upper one (an engine that drops either bound
    changes those Δ)."""
    name = "dt-limit-both-bounds"
    ref = BambaReference.from_pretrained(zoo.write_checkpoint(name, tmp_path))
    delta = unclamped_delta(monkeypatch, ref, zoo.prompt_source(name).tokens(40, 0))
    lo, hi = ref.cfg.time_step_limit
    assert (delta < lo).float().mean() >= 0.1 and (delta > hi).float().mean() >= 0.1, (
        f"share below {lo}: {(delta < lo).float().mean():.2f}, above {hi}: {(delta > hi).float().mean():.2f}")


def test_half_the_heads_decay_slowly():
    cfg = zoo.model_config("pure-mamba2")
    A = -torch.exp(zoo.draw_weights(cfg, 0)["model.layers.0.mamba.A_log"])
    assert ((A.abs() <= 0.2).sum() == cfg.mamba_n_heads // 2) and (A.abs() >= 1).sum() == cfg.mamba_n_heads // 2


def test_the_docs_show_the_zoo_as_it_is():
    """docs/config-zoo.md's tables are zoo.markdown(family): an entry added, removed or changed shows there."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "config-zoo.md").read_text()
    for family in ("bamba", "granitemoehybrid"):
        assert zoo.markdown(family) in page, f"docs/config-zoo.md: regenerate the {family} table (zoo.markdown)"
