"""bench/reproducibility.py's comparison of two runs' results: every field, bit for bit (the probe itself needs a
CUDA device: its allocator's free memory is what it poisons)."""

from __future__ import annotations

import pytest
import torch

from bench.reproducibility import first_difference, main
from harness.engine import RequestResult


def result(prompt=(-1.0, -2.0, -3.0), out_ids=(4, 5), out=(-0.5, -0.25)) -> RequestResult:
    top = torch.tensor([[3, 1]] * len(prompt))
    return RequestResult("r", torch.tensor(prompt, dtype=torch.float64), top, torch.tensor([[-1.0, -2.0]] * len(prompt)),
                         list(out_ids), torch.tensor(out, dtype=torch.float64), torch.tensor([[4, 2]] * len(out)),
                         torch.tensor([[-0.5, -3.0]] * len(out)))


def test_identical_results_show_no_difference():
    assert first_difference(result(), result()) is None
    assert first_difference(result(prompt=(float("nan"), -2.0, -3.0)), result(prompt=(float("nan"), -2.0, -3.0))) \
        is None


def test_the_first_differing_field_and_position_are_named():
    d = first_difference(result(), result(prompt=(-1.0, -2.0, -3.0 + 2 ** -40)))
    assert d["field"] == "prompt_logprobs" and d["first_position"] == 2 and d["positions"] == 1
    assert d["max_abs"] == pytest.approx(2 ** -40) and not d["nan"]
    d = first_difference(result(), result(out_ids=(4, 6)))
    assert d["field"] == "output_ids" and d["first_position"] == 1
    assert first_difference(result(), result(out_ids=(4,), out=(-0.5,)))["field"] == "output_ids"
    d = first_difference(result(), result(out=(-0.5, float("nan"))))
    assert d["field"] == "output_logprobs" and d["nan"] and d["max_abs"] == float("inf")


def test_it_refuses_to_run_without_cuda(capsys):
    with pytest.raises(SystemExit):
        main(["--checkpoint", "fixtures/tiny-bamba", "--device", "cpu"])
    assert "CUDA" in capsys.readouterr().err
