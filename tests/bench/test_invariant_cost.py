"""bench/invariant_cost.py runs both modes under both budgets and reports each ratio (one new token: the machinery,
not a measurement)."""

import pytest

from bench import invariant_cost


@pytest.mark.slow                        # four engine runs under the interpreter, two of them token by token
def test_reports_both_budgets_in_both_modes(capsys):
    assert invariant_cost.main(["--new", "1", "--max-model-len", "64"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["whole prompts", "budget 3"]
    for line in lines:
        assert "default" in line and "batch_invariant" in line and "ratio" in line and "process CPU time" in line
