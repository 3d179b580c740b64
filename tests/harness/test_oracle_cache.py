"""The oracle cache (Oracle.save_cache / load_cache, mutants.scale's seed 0 for every mutant): it is adopted only for
a checkpoint whose files hold the same bytes as the one it was computed for, wherever that lies and however often it
was written again, and the weights are hashed only where the files changed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import harness.runner as runner
from harness.engine import Request
from harness.runner import Oracle, checkpoint_record, restamp_cache

TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-bamba"
REQUEST = Request("a", (1, 5, 9, 3), max_new_tokens=2)


def _copy(dst: Path) -> Path:
    """tiny-bamba's files written again (new times, same bytes), as a model drawn again from its seed would be."""
    dst.mkdir()
    for f in TINY.iterdir():
        if f.is_file():
            shutil.copyfile(f, dst / f.name)
    return dst


@pytest.fixture
def cache(tmp_path):
    oracle = Oracle(_copy(tmp_path / "first"))
    oracle.results([REQUEST])
    oracle.save_cache(tmp_path / "cache.pt")
    return tmp_path / "cache.pt"


def _count_hashes(monkeypatch) -> list[str]:
    hashed = []
    real = runner._sha256
    monkeypatch.setattr(runner, "_sha256", lambda path: hashed.append(path.name) or real(path))
    return hashed


def test_the_same_weights_elsewhere_are_answered_from_the_cache(cache, tmp_path, monkeypatch):
    again = Oracle(_copy(tmp_path / "again"))
    hashed = _count_hashes(monkeypatch)
    again.load_cache(cache)
    assert sorted(hashed) == sorted(checkpoint_record(TINY))          # new times: every file hashed, once
    monkeypatch.setattr(again, "engine", lambda *a, **k: pytest.fail("computed what the cache holds"))
    want = Oracle(TINY).results([REQUEST])[0]
    got = again.results([REQUEST])[0]
    assert got.output_ids == want.output_ids and torch.equal(got.prompt_logprobs, want.prompt_logprobs)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.joinpath("model.safetensors").write_bytes(
        (b := bytearray(d.joinpath("model.safetensors").read_bytes()))[:-1] + bytes([b[-1] ^ 1])),
     "model.safetensors differs"),
    (lambda d: d.joinpath("config.json").write_text(d.joinpath("config.json").read_text().replace("}", ' }', 1)),
     "config.json differs"),
    (lambda d: shutil.copyfile(d / "model.safetensors", d / "model-extra.safetensors"), "model-extra.safetensors new"),
], ids=["a-weight-byte", "the-config", "another-shard"])
def test_other_weights_are_refused_naming_the_file(cache, tmp_path, change, message):
    other = _copy(tmp_path / "other")
    change(other)
    with pytest.raises(ValueError, match=f"computed for other weights .*{message}"):
        Oracle(other).load_cache(cache)
    with pytest.raises(ValueError, match=message):
        restamp_cache(cache, other)


def test_a_cache_without_a_record_of_its_files_is_refused(cache, tmp_path):
    old = torch.load(cache, weights_only=False)
    del old["files"]
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="older cache"):
        Oracle(TINY).load_cache(tmp_path / "old.pt")


def test_files_are_hashed_only_where_they_changed(cache, tmp_path, monkeypatch):
    first = tmp_path / "first"
    hashed = _count_hashes(monkeypatch)
    Oracle(first).load_cache(cache)                     # the files it was saved from, untouched
    assert hashed == []
    os.utime(first / "config.json", ns=(1, 1))
    Oracle(first).load_cache(cache)
    assert hashed == ["config.json"]


def test_restamping_records_the_new_times_so_no_process_hashes_again(cache, tmp_path, monkeypatch):
    again = _copy(tmp_path / "again")
    before = cache.read_bytes()
    restamp_cache(cache, again)
    assert cache.read_bytes() != before and not cache.with_name(cache.name + ".part").exists()
    hashed = _count_hashes(monkeypatch)
    Oracle(again).load_cache(cache)
    assert hashed == []
    restamp_cache(cache, again)                          # nothing changed: the file is left as it is
    assert hashed == []


def test_mutants_scale_stops_on_an_earlier_cache_of_other_weights(cache, tmp_path):
    from types import SimpleNamespace

    from mutants import scale

    model = _copy(tmp_path / "model")
    model.joinpath("config.json").write_text(model.joinpath("config.json").read_text().replace("}", " }", 1))
    out = tmp_path / "out"
    out.mkdir()
    shutil.copyfile(cache, out / "oracle-cache.pt")
    args = SimpleNamespace(model_dir=str(model), model="m", resume=True, time_limit=None, device="cpu", jobs=1,
                           scenarios="s", dtypes="bfloat16", clean_seeds=1, timeout=60, budget_rule="max",
                           budget_quantile=0.99, oracle_memory=None)
    with pytest.raises(SystemExit, match=f"--out {out}: .*computed for other weights .*config.json differs"):
        scale._measure(args, out, [], [])
