"""harness/measure_noise.py: the reference's own per-position error in a low dtype (what the budget rules read)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.engine import Request
from harness.measure_noise import main, position_errors, summary, texts
from harness.runner import Oracle

from .conftest import G1_MODEL

TINY = "fixtures/tiny-bamba"


def test_the_errors_are_the_oracles_twin_errors(g1_checkpoint):
    # the same |Δ| the judge's budget takes its maximum of (Oracle.position_errors), position by position
    sequences, text = texts(G1_MODEL.vocab_size, 2, 24)
    assert text.startswith("random ids")
    errors, agree = position_errors(g1_checkpoint, torch.bfloat16, sequences)
    oracle = Oracle(g1_checkpoint)
    try:
        requests = [Request(f"s{i}", tuple(ids), 0) for i, ids in enumerate(sequences)]
        judged = oracle.position_errors(requests, torch.bfloat16)
    finally:
        oracle.close()
    expected = [e for r in requests for e in judged[r.request_id]]
    assert len(errors) == len(agree) == 2 * 23
    torch.testing.assert_close(torch.tensor(errors), torch.tensor(expected), rtol=0, atol=1e-9)
    assert max(errors) > 0


def test_fp64_against_itself_is_exact():
    sequences, text = texts(512, 2, 32)
    assert text.startswith("held-out text")
    errors, agree = position_errors(TINY, torch.float64, sequences)
    assert max(errors) == 0 and all(agree)


def test_summary():
    errors = [0.01 * i for i in range(1, 101)] + [5.0]
    s = summary(errors, [True] * 100 + [False])
    assert s["positions"] == 101 and s["top1_agreement"] == pytest.approx(100 / 101)
    assert s["max"] == 5.0 and s["q99"] == 1.0 and s["max_over_q99"] == 5.0
    assert s["budget_max_rule"] == 10.0 and s["budget_floor_quantile_rule"] == 2.0
    assert s["median"] == pytest.approx(0.51) and s["mean"] == pytest.approx((sum(errors)) / 101)
    assert summary([0.0, 0.0], [True, True])["max_over_q99"] == 1.0        # exact: no outlier
    assert math.isinf(summary([0.0] * 200 + [1.0], [True] * 201)["max_over_q99"])


def test_the_command_writes_its_table_json_and_plot(tmp_path):
    assert main([TINY, "--random-twin", "--windows", "2", "--tokens", "48", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "noise.json").read_text())
    names = [m["model"] for m in report["models"]]
    assert names == ["tiny-bamba", "tiny-bamba (random weights)"]
    trained, random = (m["summary"] for m in report["models"])
    assert trained["positions"] == random["positions"] == 2 * 47
    assert trained["mean"] < random["mean"]           # trained weights: a calmer bf16 error than random ones
    assert (tmp_path / "noise.png").stat().st_size > 0
    assert "| tiny-bamba |" in (tmp_path / "noise.md").read_text()


def test_a_directory_without_a_config_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert "no config.json" in capsys.readouterr().err
