"""bench/decode.py end to end on the CPU (tiny model, batch 1, graphs off and on): it writes its files, every row has
positive engine and forward rates from the steps it timed, and each measurement's engine is closed when it ends."""

from __future__ import annotations

import json

import pytest
import torch

from bench import decode
from vendored.engine import LLMEngine


def test_decode_bench_writes_rows_and_closes_its_engines(tmp_path, monkeypatch):
    built = []
    original_init = LLMEngine.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    assert decode.main(["--models", "tiny", "--batch-sizes", "1", "--steps", "2", "--out", str(tmp_path),
                        "--no-transformers"]) == 0
    result = json.loads((tmp_path / "decode.json").read_text())
    rows = result["rows"]
    assert [(r["batch"], r["cuda_graphs"]) for r in rows] == [(1, False), (1, True)]
    for row in rows:
        assert row["steps"] == 2 and row["engine_tokens_per_s"] > 0 and row["forward_tokens_per_s"] > 0, row
    assert (tmp_path / "decode.md").exists()
    assert len(built) == 2 and all(engine._closed for engine in built), "a measurement left its engine open"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_decode_profile_needs_a_gpu_and_says_so(capsys):
    from bench import decode_profile
    assert decode_profile.main(["--batch-sizes", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
