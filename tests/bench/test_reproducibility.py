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


def _traced_run(perturb=None):
    """The vendored engine on two short requests (one prefill piece each, then decodes), every op call traced;
    `perturb(name, out, args)` may change an op's result or arguments after the real call."""
    from bench.reproducibility import Trace
    from vendored.engine import LLMEngine, model

    originals = {}
    if perturb is not None:
        for name in ("ssd_scan", "selective_state_update"):
            originals[name] = getattr(model, name)

            def changed(*args, _name=name, **kwargs):
                out = originals[_name](*args, **kwargs)
                perturb(_name, out, args)
                return out

            setattr(model, name, changed)
    try:
        engine = LLMEngine(TINY, max_num_batched_tokens=64, max_num_seqs=2, max_model_len=32)
        with Trace() as trace:
            outs = engine.generate([("a", [1, 5, 9, 2, 7], 2), ("b", [4, 4, 8], 2)])
        engine.close()
    finally:
        for name, fn in originals.items():
            setattr(model, name, fn)
    return outs, trace.calls


TINY = __import__("pathlib").Path(__file__).resolve().parents[2] / "fixtures" / "tiny-bamba"


def test_two_runs_trace_alike_and_a_changed_op_is_named_first():
    from bench.reproducibility import first_trace_difference

    _, a = _traced_run()
    names = {name for name, _ in a}
    assert {"ssd_scan", "selective_state_update", "causal_conv1d", "_mamba", "_attention", "logits"} <= names

    def nudge_scan(name, out, args):           # the scan's result, the last bit of one element
        if name == "ssd_scan":
            out.view(-1)[0] = torch.nextafter(out.view(-1)[0], torch.tensor(float("inf")))

    _, b = _traced_run(lambda name, out, args: None)        # the same run again: every fingerprint equal
    assert first_trace_difference(a, b) is None
    _, c = _traced_run(nudge_scan)
    d = first_trace_difference(a, c)
    assert d["name"] == "ssd_scan" and d["what"] == "result", d

    def nudge_state(name, out, args):          # the state pool a decode step updates in place, not its result
        if name == "selective_state_update":
            pool = args[0]
            pool.view(-1)[-1] = torch.nextafter(pool.view(-1)[-1], torch.tensor(float("inf")))

    _, e = _traced_run(nudge_state)
    d = first_trace_difference(b, e)
    assert d["name"] == "selective_state_update" and d["what"].startswith("an argument"), d
