"""`bamba-harness compare` exit statuses: 2 for usage errors found before any work, 5 when nothing was checked,
130 / 143 when interrupted (one line, no traceback, a report that says so), and the table in --help."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from harness import runner
from harness.cli import DEFAULT_CHECKPOINT, main


@pytest.fixture
def no_server_url(monkeypatch):
    monkeypatch.delenv("BAMBA_SERVER_URL", raising=False)


def _usage_error(args, capsys) -> str:
    """Run `compare` with args; assert exit 2 with one line on stderr and return that line."""
    assert main(["compare", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bamba-harness: error: "), err
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_usage_error_not_a_table_of_skips(g1_checkpoint, tmp_path, capsys):
    err = _usage_error(["--engine", "reference", "--checkpoint", str(g1_checkpoint), "--device", "cuda",
                        "--scenarios", "batching-alone", "--out", str(tmp_path)], capsys)
    assert "--device cuda: no CUDA device on this machine" in err
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize("spec", ["", ",", " , "])
def test_empty_scenarios_is_a_usage_error(spec, g1_checkpoint, tmp_path, capsys, no_server_url):
    # the server engine without a URL skips everything at once: the old code ran (and skipped) the whole matrix
    err = _usage_error(["--engine", "server", "--checkpoint", str(g1_checkpoint), "--scenarios", spec,
                        "--out", str(tmp_path)], capsys)
    assert f"--scenarios {spec!r}: expected comma-separated kinds and/or scenario ids, got none" in err


def test_a_checkpoint_without_weights_is_a_usage_error(g1_checkpoint, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(g1_checkpoint / "config.json", bare)
    err = _usage_error(["--engine", "reference", "--checkpoint", str(bare), "--scenarios", "batching-alone",
                        "--out", str(tmp_path / "out")], capsys)
    assert f"checkpoint {bare}: neither model.safetensors nor model.safetensors.index.json" in err


def test_weights_that_do_not_match_the_config_are_a_usage_error_naming_the_file(g1_checkpoint, tmp_path, capsys):
    wrong = tmp_path / "wrong"
    shutil.copytree(g1_checkpoint, wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 16}))
    err = _usage_error(["--engine", "reference", "--checkpoint", str(wrong), "--scenarios", "batching-alone",
                        "--out", str(tmp_path / "out")], capsys)
    assert err.endswith(f"checkpoint {wrong / 'model.safetensors'}: model.layers.0.feed_forward.gate_proj.weight: "
                        "expected shape (64, 32), got (48, 32)")


def test_a_weights_file_that_is_not_safetensors_is_a_usage_error(g1_checkpoint, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(g1_checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    err = _usage_error(["--engine", "reference", "--checkpoint", str(broken), "--scenarios", "batching-alone",
                        "--out", str(tmp_path / "out")], capsys)
    assert f"checkpoint {broken / 'model.safetensors'}: not a readable safetensors file" in err


def test_an_unreadable_config_is_a_usage_error(g1_checkpoint, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(g1_checkpoint, broken)
    (broken / "config.json").write_text("{not json")
    err = _usage_error(["--engine", "reference", "--checkpoint", str(broken), "--out", str(tmp_path / "out")],
                       capsys)
    assert "config.json: not valid JSON" in err


@pytest.mark.parametrize("where", ["file", "below a file"])
def test_out_that_cannot_be_a_directory_is_a_usage_error_before_the_run(where, g1_checkpoint, tmp_path, capsys,
                                                                       monkeypatch):
    (tmp_path / "taken").write_text("a file")
    out = tmp_path / "taken" if where == "file" else tmp_path / "taken" / "out"
    monkeypatch.setattr(runner, "check_scenario", lambda *a, **kw: pytest.fail("a scenario ran"))
    err = _usage_error(["--engine", "reference", "--checkpoint", str(g1_checkpoint), "--scenarios", "batching-alone",
                        "--out", str(out)], capsys)
    assert f"--out {out}: " in err
    assert (tmp_path / "taken").read_text() == "a file"


def test_every_scenario_skipped_exits_5_and_allow_skips_makes_it_0(g1_checkpoint, tmp_path, capsys, no_server_url):
    args = ["compare", "--engine", "server", "--checkpoint", str(g1_checkpoint), "--scenarios", "batching",
            "--out", str(tmp_path)]
    assert main(args) == 5
    captured = capsys.readouterr()
    assert "every selected scenario was skipped: nothing was checked" in captured.err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"] == "nothing-checked" and report["counts"]["skipped"] == 3
    assert main([*args, "--allow-skips"]) == 0
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == "nothing-checked"


def test_no_scenario_selected_exits_5_even_with_allow_skips(tmp_path, capsys):
    # the kind "long" selects its scenarios that are not slow: none for the bundled tiny model (4096 positions)
    code = main(["compare", "--engine", "reference", "--checkpoint", str(DEFAULT_CHECKPOINT), "--scenarios", "long",
                 "--out", str(tmp_path), "--allow-skips"])
    assert code == 5
    assert "no scenario selected" in capsys.readouterr().err
    assert json.loads((tmp_path / "report.json").read_text())["counts"] == {
        "passed": 0, "failed": 0, "error": 0, "skipped": 0}


def _interrupt_second_scenario(monkeypatch, interrupt):
    """check_scenario runs the first scenario for real, then `interrupt()` where the second would run."""
    real = runner.check_scenario
    calls = []

    def check(engine, scenario, **kwargs):
        calls.append(scenario.id)
        if len(calls) == 2:
            interrupt()
        return real(engine, scenario, **kwargs)

    monkeypatch.setattr(runner, "check_scenario", check)


def _stale_outputs(out):
    out.mkdir()
    (out / "report.json").write_text(json.dumps({"verdict": "pass", "stale": True}))
    (out / "delta_by_position.png").write_bytes(b"stale")


def test_ctrl_c_exits_130_with_one_line_and_a_report_marked_interrupted(g1_checkpoint, tmp_path, capsys,
                                                                          monkeypatch):
    def ctrl_c():
        raise KeyboardInterrupt

    _interrupt_second_scenario(monkeypatch, ctrl_c)
    out = tmp_path / "out"
    _stale_outputs(out)
    try:
        code = main(["compare", "--engine", "reference", "--checkpoint", str(g1_checkpoint),
                     "--scenarios", "batching-alone,batching-together", "--out", str(out)])
    except KeyboardInterrupt:
        pytest.fail("main let KeyboardInterrupt escape (a traceback)")
    err = capsys.readouterr().err
    assert code == 130
    assert err.rstrip().splitlines()[-1] == "bamba-harness: interrupted" and "Traceback" not in err
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "interrupted" and "stale" not in report
    assert [s["scenario"] for s in report["scenarios"]] == ["batching-alone"]
    assert report["not_run"] == ["batching-together"]
    assert not (out / "delta_by_position.png").exists()
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]          # no temporary file left


class SigtermNotHandled(Exception):
    pass


def test_sigterm_exits_143_and_the_previous_handler_comes_back(g1_checkpoint, tmp_path, capsys, monkeypatch):
    def guard(signum, frame):        # where main installs no handler of its own, SIGTERM must not kill pytest
        raise SigtermNotHandled

    def sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)                # the handler runs at the next bytecode boundary, well before this ends

    _interrupt_second_scenario(monkeypatch, sigterm)
    previous = signal.signal(signal.SIGTERM, guard)
    try:
        code = main(["compare", "--engine", "reference", "--checkpoint", str(g1_checkpoint),
                     "--scenarios", "batching-alone,batching-together", "--out", str(tmp_path)])
        assert signal.getsignal(signal.SIGTERM) is guard
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert code == 143
    assert err.rstrip().splitlines()[-1] == "bamba-harness: interrupted (SIGTERM)" and "Traceback" not in err
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == "interrupted"


def test_help_lists_the_exit_statuses(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for line in ("0    at least one scenario was checked", "1    a scenario failed", "2    usage error",
                 "5    nothing was checked", "130  interrupted by SIGINT (Ctrl-C); 143 by SIGTERM"):
        assert line in text
    assert "--allow-skips" in text and "--against ENGINE" in text


def test_help_answers_without_importing_torch():
    probe = ("import sys, contextlib, io, harness.cli\n"
             "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
             "    harness.cli.main(['compare', '--help'])\n"
             "print(sorted(m for m in ('torch', 'transformers', 'harness.runner') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "harness.cli", "--help"], capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - started
    assert run.returncode == 0 and "Exit status:" in run.stdout
    assert elapsed < 3.0, f"--help took {elapsed:.1f} s"
