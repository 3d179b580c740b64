"""bench/invariant_cost.py measures decode, prefill and the workload in both modes and reports each cost (short
runs: the machinery, not a measurement)."""

import json

import pytest

from bench import invariant_cost


@pytest.mark.slow                        # eight engine runs under the interpreter, some of them token by token
def test_reports_every_part_in_both_modes(capsys, tmp_path):
    assert invariant_cost.main(["--new", "1", "--max-model-len", "64", "--batch-sizes", "2", "--steps", "2",
                                "--prefill-lengths", "20", "--out", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.strip().splitlines() if not line.startswith("wrote")]
    assert [line.split(":")[0] for line in lines] == ["decode, batch 2", "prefill, 20 tokens",
                                                      "workload, whole prompts", "workload, budget 3"]
    rows = json.loads((tmp_path / "invariant_cost.json").read_text())["rows"]
    for r in rows:
        assert r["default"] > 0 and r["invariant"] > 0 and r["cost"] > 0
    decode = rows[0]
    assert decode["cost"] == pytest.approx(decode["default"] / decode["invariant"])   # tok/s: the default's over
    assert rows[1]["cost"] == pytest.approx(rows[1]["invariant"] / rows[1]["default"])  # ms: the invariant's over
    assert "| decode, batch 2 |" in (tmp_path / "invariant_cost.md").read_text()


def test_an_unknown_part_to_skip_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        invariant_cost.main(["--skip", "decodes"])
    assert e.value.code == 2 and "unknown part 'decodes'" in capsys.readouterr().err
