"""mutants/scale.py's bookkeeping: which mutants it judges, how a mutant's runs become killed / survived / not live
beside the clean runs, and the table. (Its GPU runs are measured in docs/scale.md.)"""

from __future__ import annotations

import math

import pytest

from mutants.mutant import load_all
from mutants.scale import classify_mutant, summarise, table

MUTANTS = {m.name: m for m in load_all()}


def _row(scenario, dtype, verdict, digest, *, seed=0, max_delta=0.1, excess=None, checks=()):
    return dict(scenario=scenario, dtype=dtype, seed=seed, verdict=verdict, digest=digest, max_delta=max_delta,
                budget=1.0, excess=excess or {"all": 0.95}, checks=list(checks),
                first_failure="x: positions all: ..." if verdict == "FAIL" else "")


def _fake_measurement(tmp_path, **changes):
    """A model directory the driver accepts (a config and 100 bytes of weights) and _measure's arguments."""
    from types import SimpleNamespace

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"0" * 100)
    (tmp_path / "out").mkdir()
    args = dict(model_dir=str(model), model="m", resume=False, time_limit=None, device="cpu", jobs=1,
                scenarios="s", dtypes="bfloat16", clean_seeds=1, timeout=60, budget_rule="max",
                budget_quantile=0.99, oracle_memory=None, every_scenario=False)
    return SimpleNamespace(**{**args, **changes}), tmp_path / "out"


def _passing_worker(note=None, extra=None):
    """A fake _run_worker that records one passing run (and the oracle cache, when asked to save it): note(results,
    kwargs) is called first; extra(results) gives more fields of the row."""
    import json

    from mutants import scale

    def fake(tree, results, log, *, save_cache=None, seed_start=0, **kwargs):
        if note is not None:
            note(results, kwargs)
        if save_cache is not None:
            save_cache.write_bytes(b"cache")
        row = dict(scenario="s", dtype="bfloat16", seed=seed_start, verdict="PASS", **(extra(results) if extra else {}))
        results.write_text(json.dumps(row) + "\n" + json.dumps(scale.DONE) + "\n")
        return 0

    return fake


def test_only_engine_mutants_are_judged():
    assert classify_mutant(MUTANTS["ssd-D-dropped"]) is None
    assert "not an engine mutant" in classify_mutant(MUTANTS["judge-budget-without-atol"])
    assert "not an engine mutant" in classify_mutant(MUTANTS["oracle-kv-heads-tiled"])


def test_a_mutant_is_killed_survives_or_is_not_live():
    clean = [_row("s", "bfloat16", "PASS", "aaa"), _row("s", "bfloat16", "PASS", "bbb", seed=1, excess={"all": 1.1})]
    killed = summarise("m1", [_row("s", "bfloat16", "FAIL", "ccc", excess={"all": 2.5}, checks=["excess"])], clean,
                       ["bfloat16"])
    assert killed["live"] and killed["bfloat16"]["outcome"] == "killed"
    assert killed["bfloat16"]["by"] == ["s:excess"] and killed["bfloat16"]["max_excess_ratio"] == 2.5
    assert killed["bfloat16"]["clean_max_excess_ratio"] == 1.1
    survived = summarise("m2", [_row("s", "bfloat16", "PASS", "ddd")], clean, ["bfloat16"])
    assert survived["bfloat16"]["outcome"] == "survived"
    same = summarise("m3", [_row("s", "bfloat16", "PASS", "aaa")], clean, ["bfloat16"])   # seed 0's digest
    assert not same["live"] and same["bfloat16"]["outcome"] == "not live"
    error = summarise("m4", [dict(scenario="s", dtype="bfloat16", seed=0, verdict="ERROR", checks=["error"])],
                      clean, ["bfloat16"])
    assert error["bfloat16"]["outcome"] == "killed"
    partial = summarise("m5", [_row("s", "bfloat16", "PASS", "eee")], clean, ["bfloat16"], ["s", "t"])
    assert partial["bfloat16"]["outcome"] == "incomplete" and partial["bfloat16"]["missing"] == ["t"]
    text = table(clean, [killed, survived, same, partial], {"judge-x": "not an engine mutant"}, ["bfloat16"])
    assert ("bfloat16: 1 of 2 live engine mutants killed (50%); 1 not live; 0 undetermined, 1 incomplete, 0 not "
            "run (none of these counted)") in text
    assert "| m5 | incomplete (1 scenarios not run) |" in text
    assert "| s | bfloat16 | 2 | 0 |" in text and "- judge-x: not an engine mutant" in text
    # every row of each markdown table has its header's columns (a bare |Δ| in a header would split a column)
    import re
    for block in text.split("\n\n"):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        if rows:
            cells = {len(re.split(r"(?<!\\)\|", line)) for line in rows}
            assert len(cells) == 1, rows


@pytest.mark.parametrize("name", ["tp-rank-given-wrong-group"])
def test_tensor_parallel_mutants_need_two_gpus(name):
    import torch

    reason = classify_mutant(MUTANTS[name])
    if torch.cuda.device_count() < 2:
        assert reason and "needs 2 GPUs" in reason
    else:
        assert reason is None


def test_clean_seeds_are_split_over_the_processes_without_gaps():
    from mutants.scale import _seed_groups

    assert _seed_groups(20, 2) == [(1, 10), (11, 9)]
    assert _seed_groups(20, 3) == [(1, 7), (8, 7), (15, 5)]
    assert _seed_groups(2, 4) == [(1, 1)]
    assert _seed_groups(1, 2) == []
    for seeds, procs in [(20, 2), (21, 4), (7, 7), (5, 1)]:
        covered = [s for first, count in _seed_groups(seeds, procs) for s in range(first, first + count)]
        assert covered == list(range(1, seeds))


def test_a_results_file_is_complete_only_with_its_done_mark_and_a_cut_line_is_dropped(tmp_path):
    import json

    from mutants.scale import DONE, _complete, _read

    f = tmp_path / "r.jsonl"
    assert not _complete(f) and _read(f) == []
    f.write_text(json.dumps(_row("s", "bfloat16", "PASS", "a")) + "\n" + '{"scenario": "t", "dty')  # killed mid-line
    assert [r["scenario"] for r in _read(f)] == ["s"] and not _complete(f)
    f.write_text(json.dumps(_row("s", "bfloat16", "PASS", "a")) + "\n" + json.dumps(DONE) + "\n")
    assert _complete(f) and len(_read(f)) == 1
    # finished for scenario s: not complete once t is asked too (--resume runs t alone), unless killed in s already
    asked = dict(seeds=[0], scenarios=["s", "t"], dtypes=["bfloat16"])
    assert _complete(f, seeds=[0], scenarios=["s"], dtypes=["bfloat16"]) and not _complete(f, **asked)
    assert not _complete(f, seeds=[0], scenarios=["s"], dtypes=["bfloat16", "float32"])
    assert not _complete(f, stop_at_kill=True, **asked)
    f.write_text(json.dumps(_row("s", "bfloat16", "FAIL", "a")) + "\n" + json.dumps(DONE) + "\n")
    assert _complete(f, stop_at_kill=True, **asked) and not _complete(f, **asked)


def test_report_only_tables_what_the_directory_holds_and_names_what_is_incomplete(tmp_path):
    import json

    from mutants.scale import DONE, main

    def write(name, rows, done=True):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows + ([DONE] if done else [])))

    write("clean-seed0.jsonl", [_row("s", "bfloat16", "PASS", "aaa")])
    write("clean-seed1.jsonl", [_row("s", "bfloat16", "PASS", "bbb", seed=1, excess={"all": 1.2})])
    write("mutant-ssd-D-dropped.jsonl", [_row("s", "bfloat16", "FAIL", "ccc", checks=["logprob"])])
    write("mutant-ssu-D-dropped.jsonl", [_row("s", "bfloat16", "PASS", "aaa")], done=False)   # cut short
    status = main(["--report-only", "--out", str(tmp_path), "--dtypes", "bfloat16", "--scenarios", "s",
                   "--clean-seeds", "2", "--only", "ssd-D-dropped,ssu-D-dropped,judge-budget-without-atol"])
    text = (tmp_path / "table.md").read_text()
    assert status == 1, "an incomplete mutant run must not exit 0"
    assert "| ssd-D-dropped | killed (s:logprob)" in text and "| s | bfloat16 | 2 | 0 |" in text
    assert "Incomplete (run again with --resume): clean-seed0-repeat.jsonl, mutant-ssu-D-dropped.jsonl" in text
    assert "- judge-budget-without-atol: not an engine mutant" in text
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["incomplete"] == ["clean-seed0-repeat.jsonl", "mutant-ssu-D-dropped.jsonl"]
    write("mutant-ssu-D-dropped.jsonl", [_row("s", "bfloat16", "PASS", "ddd")])
    write("clean-seed0-repeat.jsonl", [dict(_row("s", "bfloat16", "PASS", "aaa"), repeat=True)])
    assert main(["--report-only", "--out", str(tmp_path), "--dtypes", "bfloat16", "--scenarios", "s",
                 "--clean-seeds", "2", "--only", "ssd-D-dropped,ssu-D-dropped"]) == 0


def test_a_mutant_differing_only_where_the_clean_engine_varies_is_undetermined():
    clean = [_row("s", "bfloat16", "PASS", "aaa"), _row("t", "bfloat16", "PASS", "ttt"),
             dict(_row("s", "bfloat16", "PASS", "a2"), repeat=True), dict(_row("t", "bfloat16", "PASS", "ttt"),
                                                                            repeat=True)]
    from mutants.scale import unstable

    assert unstable(clean) == [("s", "bfloat16")]
    either = summarise("m1", [_row("s", "bfloat16", "PASS", "a2"), _row("t", "bfloat16", "PASS", "ttt")], clean,
                       ["bfloat16"])
    assert either["bfloat16"]["outcome"] == "not live"           # one of the clean engine's own results
    varied = summarise("m2", [_row("s", "bfloat16", "PASS", "zzz"), _row("t", "bfloat16", "PASS", "ttt")], clean,
                       ["bfloat16"])
    assert varied["bfloat16"]["outcome"] == "undetermined" and not varied["live"]
    live = summarise("m3", [_row("s", "bfloat16", "PASS", "zzz"), _row("t", "bfloat16", "PASS", "uuu")], clean,
                     ["bfloat16"])
    assert live["bfloat16"]["outcome"] == "survived" and live["live"]
    text = table(clean, [either, varied, live], {}, ["bfloat16"])
    assert "| s | bfloat16 | 1 | 0 |" in text, "the repeat of seed 0 is not counted as another clean run"
    assert "differ (not bit-reproducible) in: s bfloat16" in text


def test_a_survivor_names_where_it_differs_and_which_other_mutants_gave_the_same_output():
    """Two different edits with bit-identical output where both differ from the clean run: the clean engine varied
    between runs (seen on the H200: budget257 in bf16), which the table says beside each such survivor."""
    clean = [_row("s", "bfloat16", "PASS", "aaa"), _row("t", "bfloat16", "PASS", "ttt")]
    a = summarise("m1", [_row("s", "bfloat16", "PASS", "aaa"), _row("t", "bfloat16", "PASS", "t2")], clean,
                  ["bfloat16"])
    b = summarise("m2", [_row("s", "bfloat16", "PASS", "aaa"), _row("t", "bfloat16", "PASS", "t2")], clean,
                  ["bfloat16"])
    c = summarise("m3", [_row("s", "bfloat16", "PASS", "s3"), _row("t", "bfloat16", "PASS", "ttt")], clean,
                  ["bfloat16"])
    assert a["bfloat16"]["differs_in"] == ["t"] and c["bfloat16"]["differs_in"] == ["s"]
    text = table(clean, [a, b, c], {}, ["bfloat16"])
    assert ("| m1 | survived (differs in t; beside the clean run: mean ×1.000; that output bit-identical to 1 other "
            "mutants') |") in text
    assert "| m3 | survived (differs in s; beside the clean run: mean ×1.000) |" in text


def test_the_memory_gate_admits_workers_while_their_estimates_fit():
    import threading
    import time

    from mutants.scale import MemoryGate

    gate, order = MemoryGate(100.0), []

    def worker(name, need, hold_s):
        with gate.hold(need):
            order.append(("start", name, gate.used))
            time.sleep(hold_s)
        order.append(("end", name))

    big = threading.Thread(target=worker, args=("oracle", 60, 0.3))
    big.start()
    time.sleep(0.05)
    small = [threading.Thread(target=worker, args=(f"engine{i}", 30, 0.05)) for i in range(3)]
    for t in small:
        t.start()
    for t in [big, *small]:
        t.join(5)
    starts = [e[1] for e in order if e[0] == "start"]
    assert starts[0] == "oracle" and len(starts) == 4
    # one engine at a time fits beside the oracle (60 + 30), never two (120): the gate neither overfills nor idles
    assert max(e[2] for e in order if e[0] == "start") == 90
    with MemoryGate(10.0).hold(50):                   # larger than the whole capacity: runs alone, never blocks
        pass


def test_a_waiting_worker_is_admitted_on_the_estimate_of_when_it_starts():
    """A worker waits on a function of the current estimate: lowered by a measurement while it waits (recheck), it
    starts beside the running one at once, and holds what it was admitted on, not what the estimate became."""
    import threading
    import time

    from mutants.scale import MemoryGate

    gate, need, started = MemoryGate(100.0), {"engine": 80.0}, threading.Event()

    def waiter():
        with gate.hold(lambda: need["engine"]):
            started.set()
            need["engine"] = 50.0                         # changed while held: what it gives back is what it took
            time.sleep(0.1)

    with gate.hold(lambda: need["engine"]):               # 80 of 100 held: another 80 cannot start
        thread = threading.Thread(target=waiter)
        thread.start()
        assert not started.wait(0.2)
        need["engine"] = 20.0                             # the measurement
        gate.recheck()
        assert started.wait(2)                            # 80 + 20 fit
        assert gate.used == 100.0
    thread.join(2)
    assert gate.used == 0.0


def test_mutants_are_admitted_on_the_repeat_of_seed_0s_measured_peak(tmp_path, monkeypatch):
    """The repeat of seed 0 runs every scenario as an engine process on the cache: once it has finished, its peak
    replaces the size-based estimate of a mutant's engine process (at real width several then share the GPU)."""
    from types import SimpleNamespace

    import mutants.run
    from mutants import scale

    held = []
    real_hold = scale.MemoryGate.hold

    def spy_hold(self, need):
        held.append(need())
        return real_hold(self, need)

    peak = lambda results: {"peak_gpu_reserved_gb": 1e-8} if results.name == scale.REPEAT else {}  # noqa: E731
    monkeypatch.setattr(scale, "_run_worker", _passing_worker(extra=peak))
    monkeypatch.setattr(scale.MemoryGate, "hold", spy_hold)
    monkeypatch.setattr(mutants.run, "copy_tree", lambda root, tree, **kw: tree.mkdir(parents=True))
    args, out = _fake_measurement(tmp_path, jobs=1)       # one at a time: the repeat first, then each mutant
    judged = [SimpleNamespace(name=f"m{i}", apply=lambda tree: None) for i in range(2)]
    assert set(scale._measure(args, out, judged, [])) == {0}
    measured = (1e-8 * scale.MEASURED_MARGIN + scale.CONTEXT_GB) * 1e9
    assert held == [scale.ORACLE_PROCESS_X * 100, scale.ENGINE_PROCESS_X * 100, measured, measured]


def test_an_oracle_process_is_admitted_on_its_measured_peak_once_there_is_one(tmp_path):
    import json

    from mutants.scale import CONTEXT_GB, MEASURED_MARGIN, measured_need

    results = tmp_path / "clean-seed0.jsonl"
    assert measured_need(results) is None                       # nothing measured yet: the size-based estimate
    rows = [_row("s", "bfloat16", "PASS", "a"), _row("t", "bfloat16", "PASS", "b"), _row("t", "float32", "SKIP", "")]
    rows[0]["peak_gpu_reserved_gb"], rows[1]["peak_gpu_reserved_gb"] = 20.0, 31.5
    results.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"done": true}\n')
    assert measured_need(results) == pytest.approx((31.5 * MEASURED_MARGIN + CONTEXT_GB) * 1e9)


def test_clean_seeds_start_beside_seed_0_and_mutants_wait_for_its_oracle_cache(tmp_path, monkeypatch):
    """The orchestration, with workers faked: the clean seed groups need no cache and start at once, beside seed 0;
    the repeat of seed 0 and every mutant judge against seed 0's cached oracle results, so none starts before seed 0
    has ended and left its cache."""
    import json
    import threading
    import time
    from types import SimpleNamespace

    import mutants.run
    from mutants import scale

    events, lock = [], threading.Lock()

    def fake_worker(tree, results, log, *, save_cache=None, seed_start=0, **kwargs):
        with lock:
            events.append(("start", results.name, time.monotonic()))
        time.sleep(0.3 if results.name == "clean-seed0.jsonl" else 0.05)
        if save_cache is not None:
            save_cache.write_bytes(b"cache")
        results.write_text(json.dumps(dict(scenario="s", dtype="bfloat16", seed=seed_start, verdict="PASS")) + "\n"
                           + json.dumps(scale.DONE) + "\n")
        with lock:
            events.append(("end", results.name, time.monotonic()))
        return 0

    monkeypatch.setattr(scale, "_run_worker", fake_worker)
    monkeypatch.setattr(mutants.run, "copy_tree", lambda root, tree, **kw: tree.mkdir(parents=True))
    args, out = _fake_measurement(tmp_path, jobs=2, clean_seeds=5)
    judged = [SimpleNamespace(name=f"m{i}", apply=lambda tree: None) for i in range(3)]
    statuses = scale._measure(args, out, judged, scale._seed_groups(5, 2))
    assert set(statuses) == {0}
    start = {name: t for kind, name, t in events if kind == "start"}
    end = {name: t for kind, name, t in events if kind == "end"}
    assert set(start) == {"clean-seed0.jsonl", "clean-seeds1-2.jsonl", "clean-seeds3-4.jsonl", scale.REPEAT,
                          "mutant-m0.jsonl", "mutant-m1.jsonl", "mutant-m2.jsonl"}
    assert all(start[f"clean-seeds{a}.jsonl"] < end["clean-seed0.jsonl"] for a in ("1-2", "3-4"))
    assert all(start[name] >= end["clean-seed0.jsonl"] for name in start
               if name.startswith("mutant-") or name == scale.REPEAT)


def test_a_cache_only_oracle_answers_what_the_cache_holds_and_refuses_the_rest(tmp_path):
    """A mutant's worker is admitted as an engine process on this promise: what seed 0 ran comes from its cache, bit
    for bit, and anything else (another request, a reference model in another dtype) raises OracleNotCached instead
    of loading the fp64 model."""
    import torch

    from harness.engine import Request
    from harness.runner import Oracle
    from mutants.scale import OracleNotCached, cache_only_oracle

    checkpoint = "fixtures/tiny-bamba"
    ran = Request("a", (1, 5, 9, 3), max_new_tokens=3)
    full = Oracle(checkpoint)
    expected = full.results([ran])[0]
    full.save_cache(tmp_path / "cache.pt")
    cached = cache_only_oracle(Oracle)(checkpoint)
    with pytest.raises(OracleNotCached):              # nothing loaded yet
        cached.results([ran])
    cached.load_cache(tmp_path / "cache.pt")
    got = cached.results([ran])[0]
    assert got.output_ids == expected.output_ids and len(got.output_ids) == 3
    assert torch.equal(got.prompt_logprobs, expected.prompt_logprobs)
    assert torch.equal(got.output_logprobs, expected.output_logprobs)
    with pytest.raises(OracleNotCached):              # a continuation seed 0 never drew
        cached.results([ran.teacher_forced((7, 7, 7))])
    with pytest.raises(OracleNotCached):              # the bf16 reference a budget needs, never computed
        cached.budget([ran], torch.bfloat16)
    assert not cached._engines                        # no reference model was loaded


def test_a_mutant_worker_the_cache_cannot_answer_runs_again_as_an_oracle_process(tmp_path, monkeypatch):
    """The two-phase gate: a mutant's worker starts cache-only under the engine estimate; when it stops for want of
    the oracle (NEEDS_ORACLE) it is started again without the restriction, under the oracle estimate, and its status
    is that second run's. A worker that finishes on the cache runs once."""
    import json
    import threading
    from types import SimpleNamespace

    import mutants.run
    from mutants import scale

    calls, lock = [], threading.Lock()
    held = []
    real_hold = scale.MemoryGate.hold

    def spy_hold(self, need):
        held.append(need() if callable(need) else need)
        return real_hold(self, need)

    def fake_worker(tree, results, log, *, save_cache=None, seed_start=0, cache_only=False, **kwargs):
        with lock:
            calls.append((results.name, cache_only, held[-1]))
        if save_cache is not None:
            save_cache.write_bytes(b"cache")
        if results.name == "mutant-m1.jsonl" and cache_only:
            results.write_text(json.dumps(dict(scenario="s", dtype="bfloat16", seed=0, verdict="PASS")) + "\n")
            return scale.NEEDS_ORACLE
        rows = [dict(scenario=sid, dtype="bfloat16", seed=seed_start, verdict="PASS") for sid in ("s", "t")]
        results.write_text("".join(json.dumps(r) + "\n" for r in rows) + json.dumps(scale.DONE) + "\n")
        return 0

    monkeypatch.setattr(scale, "_run_worker", fake_worker)
    monkeypatch.setattr(scale.MemoryGate, "hold", spy_hold)
    monkeypatch.setattr(mutants.run, "copy_tree", lambda root, tree, **kw: tree.mkdir(parents=True))
    args, out = _fake_measurement(tmp_path, scenarios="s,t")
    judged = [SimpleNamespace(name=f"m{i}", apply=lambda tree: None) for i in range(2)]
    statuses = scale._measure(args, out, judged, [])
    assert set(statuses) == {0}
    oracle, engine = scale.ORACLE_PROCESS_X * 100, scale.ENGINE_PROCESS_X * 100
    assert ("clean-seed0.jsonl", False, oracle) in calls
    assert (scale.REPEAT, True, engine) in calls
    assert [c for c in calls if c[0] == "mutant-m0.jsonl"] == [("mutant-m0.jsonl", True, engine)]
    assert [c for c in calls if c[0] == "mutant-m1.jsonl"] == [("mutant-m1.jsonl", True, engine),
                                                               ("mutant-m1.jsonl", False, oracle)]


def test_a_mutant_whose_worker_never_started_is_in_the_table_as_not_run(tmp_path):
    import json

    from mutants.scale import DONE, main

    for name, rows in (("clean-seed0.jsonl", [_row("s", "bfloat16", "PASS", "aaa")]),
                       ("clean-seed0-repeat.jsonl", [dict(_row("s", "bfloat16", "PASS", "aaa"), repeat=True)]),
                       ("mutant-ssd-D-dropped.jsonl", [_row("s", "bfloat16", "FAIL", "ccc", checks=["logprob"])])):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows + [DONE]))
    status = main(["--report-only", "--out", str(tmp_path), "--dtypes", "bfloat16", "--scenarios", "s",
                   "--clean-seeds", "1", "--only", "ssd-D-dropped,ssu-D-dropped"])
    text = (tmp_path / "table.md").read_text()
    assert status == 1
    assert "| ssu-D-dropped | not run |" in text
    assert "bfloat16: 1 of 1 live engine mutants killed (100%); 0 not live; 0 undetermined, 0 incomplete, 1 not run" \
        in text
    assert "Incomplete (run again with --resume): mutant-ssu-D-dropped.jsonl" in text


def test_seed_0_runs_again_when_its_oracle_cache_is_lost(tmp_path, monkeypatch):
    """--resume with clean seed 0's rows but not its cache: the worker would skip every recorded run and leave an
    empty cache, so the file is set aside and seed 0 runs from the start."""
    import json

    from mutants import scale

    started = []

    def fake_worker(tree, results, log, *, save_cache=None, seed_start=0, **kwargs):
        started.append((results.name, results.is_file()))
        if save_cache is not None:
            save_cache.write_bytes(b"cache")
        results.write_text(json.dumps(dict(scenario="s", dtype="bfloat16", seed=0, verdict="PASS")) + "\n"
                           + json.dumps(scale.DONE) + "\n")
        return 0

    monkeypatch.setattr(scale, "_run_worker", fake_worker)
    args, out = _fake_measurement(tmp_path, resume=True)
    (out / "clean-seed0.jsonl").write_text(json.dumps(dict(scenario="s", dtype="bfloat16", seed=0, verdict="PASS"))
                                           + "\n" + json.dumps(scale.DONE) + "\n")
    assert set(scale._measure(args, out, [], [])) == {0}
    assert ("clean-seed0.jsonl", False) in started          # started afresh, not on the old file
    assert (out / "clean-seed0.jsonl.without-cache").is_file() and (out / "oracle-cache.pt").is_file()


def test_a_lost_oracle_cache_keeps_the_other_dtypes_seed_0_rows_and_every_earlier_set_aside_row(tmp_path,
                                                                                                 monkeypatch):
    """Seed 0 runs again in the dtype asked now: the rows of that dtype are appended to the set-aside file (whose
    earlier rows stay), and the other dtype's rows stay in clean-seed0.jsonl for the summary."""
    import json

    from mutants import scale

    def row(dtype, digest):
        return dict(scenario="s", dtype=dtype, seed=0, verdict="PASS", digest=digest)

    seen = []

    def fake_worker(tree, results, log, *, save_cache=None, **kwargs):
        seen.append(scale._read(results))
        if save_cache is not None:
            save_cache.write_bytes(b"cache")
        with open(results, "a") as f:
            f.write(json.dumps(row("float32", "new")) + "\n" + json.dumps(scale.DONE) + "\n")
        return 0

    monkeypatch.setattr(scale, "_run_worker", fake_worker)
    args, out = _fake_measurement(tmp_path, resume=True, dtypes="float32")
    (out / "clean-seed0.jsonl.without-cache").write_text(json.dumps(row("bfloat16", "first")) + "\n")
    (out / "clean-seed0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        row("bfloat16", "bf16"), row("float32", "old"), scale.DONE)))
    scale._measure(args, out, [], [])
    assert seen[0] == [row("bfloat16", "bf16")]
    assert scale._read(out / "clean-seed0.jsonl") == [row("bfloat16", "bf16"), row("float32", "new")]
    assert scale._read(out / "clean-seed0.jsonl.without-cache") == [row("bfloat16", "first"), row("float32", "old")]


def test_the_plot_draws_a_non_finite_effect_past_every_finite_one(tmp_path, monkeypatch):
    """An engine that returned inf (ssd-chunk-to-sequence-off-by-one in bf16) is the largest effect, not a missing
    bar: it is drawn past the largest finite value, hatched."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from mutants.scale import plot

    clean = [_row("s", "bfloat16", "PASS", "aaa")]
    mutants = [summarise("finite", [_row("s", "bfloat16", "FAIL", "b", max_delta=3.0)], clean, ["bfloat16"]),
               summarise("inf", [_row("s", "bfloat16", "FAIL", "c", max_delta=float("inf"))], clean, ["bfloat16"])]
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: saved.append(fig))
    assert plot(mutants, ["bfloat16"], tmp_path / "power.png")
    bars = {b.get_y(): b for b in saved[0].axes[0].patches}
    widths = [b.get_width() for _, b in sorted(bars.items())]
    assert all(map(math.isfinite, widths)) and widths[1] > widths[0] == 3.0
    assert [b.get_hatch() for _, b in sorted(bars.items())] == [None, "//"]


@pytest.mark.parametrize("checkpoint", ["fixtures/tiny-bamba", "bamba9b-2layer", "granite4h-tiny-2layer"])
def test_the_default_scenarios_exist_at_every_chunk_size(checkpoint):
    # the same eight roles at Q = 16 (tiny-bamba, deep-bamba) as at Q = 256 (the real-width models)
    import json
    from pathlib import Path

    from harness import scale
    from harness.scenarios import build_scenarios
    from mutants.scale import DEFAULT_SCENARIOS, default_scenarios
    from reference.config import ModelConfig

    raw = (json.loads((Path(checkpoint) / "config.json").read_text()) if checkpoint.startswith("fixtures")
           else scale.config_dict(checkpoint))
    wanted = default_scenarios(raw["mamba_chunk_size"]).split(",")
    assert len(wanted) == 8 and set(wanted) <= {s.id for s in build_scenarios(ModelConfig.from_dict(raw))}
    assert DEFAULT_SCENARIOS == default_scenarios(256)


def _ruled(row, **rules):
    """A row judged by several rules: rules[name] = (verdict, checks, delta over budget, budget, floor)."""
    return dict(row, rules={name: dict(verdict=v, checks=list(c), first_failure="f" if v == "FAIL" else "",
                                       delta_over_budget=d, budget=b, **({"budget_floor": f} if f else {}))
                            for name, (v, c, d, b, f) in rules.items()})


def test_runs_judged_by_two_rules_give_a_table_per_rule_and_stop_only_when_killed_by_both(tmp_path):
    import json

    from mutants.scale import DONE, _complete, _killed, as_rule, main, parse_rules

    assert parse_rules("quantile, max") == ["quantile", "max"]
    for bad in ("", "median", "max,mean", "quantile,max,quantile"):
        with pytest.raises(SystemExit, match="--budget-rule"):
            parse_rules(bad)
    both = _ruled(_row("s", "bfloat16", "PASS", "ccc"), max=("PASS", (), 0.4, 8.0, None),
                  quantile=("FAIL", ("logprob",), 1.6, 8.0, 2.0))
    assert not _killed(both) and _killed(dict(both, verdict="ERROR"))
    assert as_rule(both, "quantile")["verdict"] == "FAIL" and as_rule(both, "max")["verdict"] == "PASS"
    assert as_rule(both, "quantile")["budget_floor"] == 2.0 and "budget_floor" not in as_rule(both, "max")

    def write(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows + [DONE]))

    clean = lambda seed, delta: _ruled(_row("s", "bfloat16", "PASS", f"c{seed}", seed=seed, max_delta=delta),  # noqa
                                       max=("PASS", (), delta / 8, 8.0, None), quantile=("PASS", (), 0.5, 8.0, 1.0))
    write("clean-seed0.jsonl", [clean(0, 0.5)])
    write("clean-seed0-repeat.jsonl", [dict(clean(0, 0.5), repeat=True)])
    write("clean-seed1.jsonl", [clean(1, 0.8)])
    # killed by the quantile rule in s only: runs t too (stop at kill waits for both rules), survives t by the max
    write("mutant-ssd-D-dropped.jsonl", [both, _ruled(_row("t", "bfloat16", "PASS", "ddd"),
                                                      max=("PASS", (), 0.3, 8.0, None),
                                                      quantile=("PASS", (), 0.9, 8.0, 2.0))])
    asked = dict(seeds=[0], scenarios=["s", "t"], dtypes=["bfloat16"], stop_at_kill=True)
    (tmp_path / "cut.jsonl").write_text(json.dumps(both) + "\n" + json.dumps(DONE) + "\n")
    assert not _complete(tmp_path / "cut.jsonl", **asked), "a kill by one rule of two ended the mutant's runs"
    clean_t = lambda seed: _ruled(_row("t", "bfloat16", "PASS", f"t{seed}", seed=seed),  # noqa: E731
                                  max=("PASS", (), 0.1, 8.0, None), quantile=("PASS", (), 0.2, 8.0, 1.0))
    write("clean-seed0.jsonl", [clean(0, 0.5), clean_t(0)])
    write("clean-seed0-repeat.jsonl", [dict(clean(0, 0.5), repeat=True), dict(clean_t(0), repeat=True)])
    write("clean-seed1.jsonl", [clean(1, 0.8), clean_t(1)])
    status = main(["--report-only", "--out", str(tmp_path), "--dtypes", "bfloat16", "--scenarios", "s,t",
                   "--clean-seeds", "2", "--only", "ssd-D-dropped", "--budget-rule", "quantile,max"])
    assert status == 0
    quantile, maxed = (tmp_path / "table.md").read_text(), (tmp_path / "table-max.md").read_text()
    assert quantile.startswith("Budget rule: quantile (quantile 0.99); the same runs judged by max too")
    assert "| ssd-D-dropped | killed (s:logprob)" in quantile and "| ssd-D-dropped | survived" in maxed
    # the clean table: largest |Δ| over seeds 0.8; budget the quantile floor 1 (the max rule's 8); their ratio
    assert "| s | bfloat16 | 2 | 0 | 0.8 | 1 | 1.25 | 0.50 |" in quantile
    assert "| s | bfloat16 | 2 | 0 | 0.8 | 8 | 10.00 | 0.10 |" in maxed
    assert json.loads((tmp_path / "report-max.json").read_text())["budget_rule"] == "max"
    assert json.loads((tmp_path / "report.json").read_text())["budget_rules"] == ["quantile", "max"]


def test_the_report_names_the_model_measured_and_a_name_of_another_shape_is_refused(tmp_path):
    import json
    from types import SimpleNamespace

    from harness import scale
    from mutants.scale import model_config

    args = lambda model, model_dir: SimpleNamespace(model=model, model_dir=model_dir)       # noqa: E731
    plain = args(None, None)
    assert model_config(plain)["num_hidden_layers"] == 2 and plain.model == "bamba9b-2layer"
    held = tmp_path / "deep-one"
    held.mkdir()
    (held / "config.json").write_text(json.dumps(scale.config_dict("bamba9b-32layer")))
    named = args(None, str(held))
    assert model_config(named)["num_hidden_layers"] == 32 and named.model == "deep-one"
    assert model_config(args("my-label", str(held)))["num_hidden_layers"] == 32          # not a scale name: a label
    assert model_config(args("bamba9b-32layer", str(held)))["num_hidden_layers"] == 32
    with pytest.raises(SystemExit, match="--model bamba9b-2layer with --model-dir .*deep-one: the directory holds "
                                         "another model \\(num_hidden_layers 32 where bamba9b-2layer has 2\\)"):
        model_config(args("bamba9b-2layer", str(held)))
    with pytest.raises(SystemExit, match="--model my-label: no such scale model"):
        model_config(args("my-label", str(tmp_path / "empty")))


def test_the_excess_lines_count_clean_runs_over_the_ratio_and_failed_by_ratio_and_z():
    from mutants.scale import excess_lines

    over = _row("a", "bfloat16", "PASS", "d1", seed=1, excess={"all": 1.1, "after-chunk": 1.7})
    over.update(excess_positions={"all": 500, "after-chunk": 33}, excess_z={"all": -9.0, "after-chunk": 0.8},
                excess_over_ratio=["after-chunk"])
    failed = _row("a", "bfloat16", "FAIL", "d2", seed=2, excess={"all": 2.4}, checks=["excess"])
    failed.update(excess_positions={"all": 500}, excess_z={"all": 12.0}, excess_over_ratio=["all"])
    legacy = _row("b", "bfloat16", "PASS", "d3", seed=3, excess={"all": 0.9})        # recorded before paired z
    fp32 = {**_row("a", "float32", "PASS", "d4"), "excess": {}}                  # no excess test in fp32
    text = "\n".join(excess_lines([over, failed, legacy, fp32]))
    assert ("bfloat16: 4 judged classes in 3 runs; largest ratio 2.40 (a seed 2 all, 500 positions); largest "
            "paired z 12.00 (a seed 2 all, 500 positions) of the 3 classes that record it; runs over the ratio "
            "limit 2, failed by the excess test 1") in text
    assert "float32" not in text
    assert excess_lines([fp32]) == [] and excess_lines([{**over, "repeat": True}]) == []


def test_the_report_reads_clean_seeds_that_an_earlier_call_grouped_otherwise(tmp_path):
    """Seeds 1-3 recorded by a call with another --clean-procs (clean-seeds1-2.jsonl, clean-seed3.jsonl), then the
    report run with a grouping that names clean-seeds1-3.jsonl: every seed is counted and nothing is incomplete; a
    seed no file holds is still named."""
    import json

    from mutants.scale import DONE, main

    def write(name, rows):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows + [DONE]))

    write("clean-seed0.jsonl", [_row("s", "bfloat16", "PASS", "aaa")])
    write("clean-seed0-repeat.jsonl", [dict(_row("s", "bfloat16", "PASS", "aaa"), repeat=True)])
    write("clean-seeds1-2.jsonl", [_row("s", "bfloat16", "PASS", f"d{k}", seed=k) for k in (1, 2)])
    write("clean-seed3.jsonl", [_row("s", "bfloat16", "PASS", "d3", seed=3)])
    write("mutant-ssd-D-dropped.jsonl", [_row("s", "bfloat16", "FAIL", "ccc", checks=["logprob"])])
    args = ["--report-only", "--out", str(tmp_path), "--dtypes", "bfloat16", "--scenarios", "s",
            "--clean-procs", "1", "--only", "ssd-D-dropped"]
    assert main(args + ["--clean-seeds", "4"]) == 0
    assert "| s | bfloat16 | 4 | 0 |" in (tmp_path / "table.md").read_text()
    assert main(args + ["--clean-seeds", "5"]) == 1
    assert "Incomplete (run again with --resume): clean-seeds1-4.jsonl" in (tmp_path / "table.md").read_text()


def test_a_workers_fp32_row_on_a_model_with_routed_experts_carries_its_routing_allowance(tmp_path):
    """The worker (what runs each clean seed and mutant) on tiny-granite in fp32: the row records the scenario's
    routing near-tie search (how many positions it widened, by how much at most), which the judge used."""
    import json

    from mutants.scale import main

    results = tmp_path / "rows.jsonl"
    assert main(["--worker", "--checkpoint", "fixtures/tiny-granite", "--scenarios", "batching-together",
                 "--dtypes", "float32", "--device", "cpu", "--results", str(results)]) == 0
    row = json.loads(results.read_text().splitlines()[0])
    assert row["verdict"] == "PASS" and row["dtype"] == "float32"
    allowance = row["routing_allowance"]
    assert allowance["positions"] >= 0 and allowance["largest"] >= 0.0
    assert (allowance["positions"] == 0) == (allowance["largest"] == 0.0)


def test_a_fresh_measurement_clears_what_earlier_workers_wrote_and_nothing_else(tmp_path, monkeypatch):
    """Without --resume the workers' results, logs and the oracle cache of an earlier measurement go; a file the
    user keeps in --out (the driver's own log, where `... --out DIR >> DIR/driver.log` writes it) stays."""
    from types import SimpleNamespace

    import mutants.run
    from mutants import scale

    seen = {}
    note = lambda results, kwargs: seen.setdefault("left", sorted(p.name for p in results.parent.iterdir()))  # noqa
    monkeypatch.setattr(scale, "_run_worker", _passing_worker(note))
    monkeypatch.setattr(mutants.run, "copy_tree", lambda root, tree, **kw: tree.mkdir(parents=True))
    args, out = _fake_measurement(tmp_path)
    for name in ("clean-seed0.jsonl", "clean-seed0.log", "clean-seeds1-2.jsonl", scale.REPEAT, "mutant-m0.jsonl",
                 "mutant-m0.log", "oracle-cache.pt", "driver.log", "notes.jsonl"):
        (out / name).write_text("old\n")
    scale._measure(args, out, [SimpleNamespace(name="m0", apply=lambda tree: None)], [])
    assert seen["left"] == ["driver.log", "notes.jsonl"]
    assert (out / "driver.log").read_text() == "old\n"


def test_seed_0s_worker_stopped_after_a_run_leaves_the_cache_of_every_run_it_recorded(tmp_path, monkeypatch):
    """Seed 0 saves the oracle cache after each run, before the run's row: a worker the time limit stops mid-way
    leaves a cache that answers every recorded run (so --resume carries on instead of starting seed 0 again)."""
    import json

    import torch

    import harness.runner
    from harness.runner import Oracle
    from harness.scenarios import PromptSource, build_scenarios
    from mutants.scale import OracleNotCached, cache_only_oracle, main
    from reference.config import ModelConfig

    real, calls = harness.runner.check_scenario, []

    def stopped_on_the_second(*args, **kwargs):
        calls.append(args[1].id)
        if len(calls) == 2:
            raise KeyboardInterrupt("the time limit")
        return real(*args, **kwargs)

    monkeypatch.setattr(harness.runner, "check_scenario", stopped_on_the_second)
    results, cache = tmp_path / "clean-seed0.jsonl", tmp_path / "oracle-cache.pt"
    with pytest.raises(KeyboardInterrupt):
        main(["--worker", "--checkpoint", "fixtures/tiny-bamba", "--scenarios", "batching-together,sampled-decode-T2",
              "--dtypes", "float32", "--device", "cpu", "--results", str(results), "--save-cache", str(cache)])
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["scenario"] for r in rows] == ["batching-together"]        # no DONE: the worker did not finish
    assert cache.is_file() and not cache.with_name(cache.name + ".part").exists()
    monkeypatch.setattr(harness.runner, "check_scenario", real)
    cached = cache_only_oracle(Oracle)("fixtures/tiny-bamba", device="cpu")
    cached.load_cache(cache)
    cfg = ModelConfig.from_dict(json.loads(open("fixtures/tiny-bamba/config.json").read()))
    by_id = {s.id: s for s in build_scenarios(cfg)}
    report = real("vendored", by_id["batching-together"], oracle=cached, source=PromptSource(cfg.vocab_size, seed=0),
                  dtype=torch.float32, device="cpu")
    assert report.passed and not cached._engines                        # answered from the cache alone
    with pytest.raises(OracleNotCached):                                  # the run it was stopped in: not cached
        real("vendored", by_id["sampled-decode-T2"], oracle=cached, source=PromptSource(cfg.vocab_size, seed=0),
             dtype=torch.float32, device="cpu")


def test_oracle_memory_streams_the_workers_reference_models_with_the_same_verdicts_and_numbers(tmp_path):
    """--oracle-memory reaches the workers: under a cap smaller than tiny-bamba's fp64 weights the oracle and twins
    run layer-streamed (the row says so) and every judged number is the resident run's (one digest)."""
    import json

    from mutants.scale import main

    rows = {}
    for mode, cap in (("resident", []), ("streamed", ["--oracle-memory", "64KiB"])):
        results = tmp_path / f"{mode}.jsonl"
        assert main(["--worker", "--checkpoint", "fixtures/tiny-bamba", "--scenarios", "batching-together",
                     "--dtypes", "float32", "--device", "cpu", "--results", str(results), *cap]) == 0
        rows[mode] = json.loads(results.read_text().splitlines()[0])
    assert rows["resident"]["oracle_weights"] == "resident" and rows["streamed"]["oracle_weights"] == "streamed"
    assert rows["streamed"]["verdict"] == rows["resident"]["verdict"] == "PASS"
    assert rows["streamed"]["digest"] == rows["resident"]["digest"]
    assert rows["streamed"]["budget"] == rows["resident"]["budget"]
    # fp32 has no excess test (so no class moments), and its mean |Δ| is over every compared position
    resident = rows["resident"]
    assert resident["excess_moments"] == {} and 0 < resident["mean_delta"] <= resident["max_delta"]
    # what the larger-k table weighs: under the max rule the largest |Δ| sets it, (max |Δ| - atol) / E, with the
    # budget 2·E + atol (0 where every |Δ| is within atol); a passing run needs no more than its own k
    atol = 1e-5
    scale = (resident["budget"] - atol) / 2.0
    assert resident["k_to_pass"] == pytest.approx(max(0.0, (resident["max_delta"] - atol) / scale), abs=1e-12)
    assert resident["k_to_pass"] <= 2.0


def test_oracle_memory_is_passed_to_every_worker_and_a_bad_size_is_a_usage_error(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    import mutants.run
    from mutants import scale

    caps = set()
    note = lambda results, kwargs: caps.add(kwargs["oracle_memory"])  # noqa: E731
    monkeypatch.setattr(scale, "_run_worker", _passing_worker(note))
    monkeypatch.setattr(mutants.run, "copy_tree", lambda root, tree, **kw: tree.mkdir(parents=True))
    args, out = _fake_measurement(tmp_path, oracle_memory=16 * 2**30, clean_seeds=3)
    scale._measure(args, out, [SimpleNamespace(name="m0", apply=lambda tree: None)], scale._seed_groups(3, 1))
    assert caps == {16 * 2**30}
    with pytest.raises(SystemExit) as exit_:
        scale.main(["--oracle-memory", "lots", "--out", str(tmp_path / "x")])
    assert exit_.value.code == 2 and "--oracle-memory 'lots'" in capsys.readouterr().err


def test_live_in_takes_the_mutants_live_in_earlier_measurements_in_the_dtypes_asked(tmp_path):
    import json

    from mutants.scale import live_in, main

    def report(folder, dtypes, outcomes):
        folder.mkdir()
        mutants = [dict(name=name, **{d: {"outcome": o} for d, o in zip(dtypes, row)})
                   for name, row in outcomes.items()]
        (folder / "report.json").write_text(json.dumps(dict(dtypes=dtypes, mutants=mutants)))
        return str(folder)

    wide = report(tmp_path / "wide", ["bfloat16", "float32"], {"ssd-D-dropped": ("killed", "not live"),
                                                               "ssu-D-dropped": ("not live", "survived"),
                                                               "engine-dt-bias-dropped": ("not live", "not live")})
    deep = report(tmp_path / "deep", ["bfloat16"], {"ssd-dt-bias-dropped": ("survived",),
                                                    "engine-dt-bias-dropped": ("incomplete",)})
    assert live_in([wide, deep], ["bfloat16"]) == {"ssd-D-dropped", "ssd-dt-bias-dropped"}
    assert live_in([wide], ["float32"]) == {"ssu-D-dropped"}
    assert live_in([wide + "/report.json"], ["bfloat16", "float32"]) == {"ssd-D-dropped", "ssu-D-dropped"}
    with pytest.raises(SystemExit, match="none of --dtypes float32"):
        live_in([deep], ["float32"])
    with pytest.raises(SystemExit, match="not a mutants.scale report.json"):
        live_in([str(tmp_path / "absent")], ["bfloat16"])
    # the driver judges those of them --only names (nothing was measured here: they are in the table as not run)
    out = tmp_path / "out"
    out.mkdir()
    main(["--report-only", "--out", str(out), "--dtypes", "bfloat16", "--scenarios", "s", "--clean-seeds", "1",
          "--live-in", f"{wide},{deep}", "--only", "ssd-D-dropped,ssu-D-dropped,engine-dt-bias-dropped"])
    table = (out / "table.md").read_text()
    assert "| ssd-D-dropped | not run |" in table
    assert "ssu-D-dropped" not in table and "engine-dt-bias-dropped" not in table


def test_a_survivors_effect_is_given_in_units_of_the_clean_runs_error():
    """Beside the clean engine's run of the same seed and scenario: mean |Δ|, mean KL and top-1 misses as ratios
    (a bug drowned in the rounding reads well over 1, a change of rounding alone near 1)."""
    from mutants.scale import beside_clean

    def row(scenario, digest, *, mean, kl, top1, **extra):
        return dict(_row(scenario, "bfloat16", "PASS", digest), mean_delta=mean, mean_kl=kl, top1=top1, **extra)

    clean = [row("s", "aaa", mean=0.2, kl=0.01, top1=0.8), row("t", "ttt", mean=0.4, kl=0.02, top1=0.9),
             dict(row("s", "a2", mean=9.0, kl=9.0, top1=0.0), repeat=True)]      # the repeat is not the scale
    mine = [row("s", "m1", mean=0.3, kl=0.022, top1=0.7), row("t", "m2", mean=0.5, kl=0.05, top1=0.85)]
    effect = beside_clean(mine, clean)
    assert effect["mean"] == pytest.approx((1.25, 1.5))
    assert effect["kl"] == pytest.approx((2.2, 2.5))
    assert effect["top1 misses"] == pytest.approx((1.5, 1.5))
    # rows older than mean_delta: the excess test's "all" ratios (both over the same bf16 reference)
    old = [dict(r, excess={"all": 0.9}) for r in clean[:2]]
    for r in old:
        del r["mean_delta"]
    assert beside_clean([dict(_row("s", "bfloat16", "PASS", "m"), excess={"all": 1.35})], old)["mean"] \
        == pytest.approx((1.5, 1.5))
    # a clean value of 0 (every top-1 agreeing, no KL) or no clean run of that scenario leaves the measure out
    perfect = [row("s", "aaa", mean=0.2, kl=0.0, top1=1.0)]
    assert beside_clean([row("s", "m", mean=0.2, kl=0.01, top1=0.9)], perfect) == {"mean": (1.0, 1.0)}
    assert beside_clean([row("u", "m", mean=0.2, kl=0.01, top1=0.9)], clean) == {}
    survived = summarise("m1", mine, clean, ["bfloat16"])
    assert survived["bfloat16"]["beside_clean"] == effect
    text = table(clean, [survived], {}, ["bfloat16"])
    assert ("survived (differs in s, t; beside the clean run: mean ×1.250-1.500, kl ×2.200-2.500, "
            "top1 misses ×1.500)") in text
    killed = summarise("m2", [dict(mine[0], verdict="FAIL")], clean, ["bfloat16"])
    assert killed["bfloat16"]["beside_clean"] == {}


def test_a_runs_mean_delta_is_over_every_compared_position():
    from types import SimpleNamespace

    from mutants.scale import _mean_delta

    report = SimpleNamespace(comparisons=[SimpleNamespace(deltas=[0.1, 0.3]), SimpleNamespace(deltas=[0.5])])
    assert _mean_delta(report) == pytest.approx(0.3)
    assert _mean_delta(SimpleNamespace(comparisons=[SimpleNamespace(deltas=[])])) is None


def _moments_row(scenario, digest, *, cand, ref, n=2000, sd=0.05, corr=0.5, **extra):
    """A bf16 row whose "all" class has n positions, these means, both errors' sd `sd` and correlation `corr`."""
    cov = corr * sd * sd
    return dict(_row(scenario, "bfloat16", "PASS", digest, excess={"all": cand / ref}),
                excess_moments={"all": [n, cand, ref, sd * sd, sd * sd, cov]}, excess_atol=1e-5, **extra)


def test_a_lower_excess_limit_is_weighed_on_the_runs_moments():
    """excess_fails_at: the excess test at another ratio limit, from a row's class moments (the paired z as compare
    computes it, and the ratio-alone bound); None for a row without them."""
    from mutants.scale import excess_fails_at

    row = _moments_row("s", "m", cand=0.135, ref=0.1)         # 1.35x the reference over 2000 positions
    # sd of d = c - x·r: sqrt(0.0025 (1 + x² - x)); at 1.3: 0.0025·1.39 -> sd 0.0589, se 0.00132, z = 0.005/0.00132
    assert excess_fails_at(row, 1.3) is True and excess_fails_at(row, 1.25) is True
    assert excess_fails_at(row, 1.4) is False and excess_fails_at(row, 1.5) is False
    assert excess_fails_at(_moments_row("s", "m", cand=0.135, ref=0.1, n=40), 1.3) is False   # z 0.54 on 40
    assert excess_fails_at(_moments_row("s", "m", cand=0.21, ref=0.1, n=40), 1.3) is True     # over 2x
    assert excess_fails_at(_row("s", "bfloat16", "PASS", "m"), 1.3) is None


def test_the_table_weighs_lower_excess_limits_by_clean_failures_and_survivors_killed():
    from mutants.scale import LOWER_LIMITS

    clean = [_moments_row("s", "aaa", cand=0.1, ref=0.1), _moments_row("t", "ttt", cand=0.118, ref=0.1)]
    drowned = summarise("drowned", [_moments_row("s", "d1", cand=0.135, ref=0.1),
                                    _moments_row("t", "d2", cand=0.128, ref=0.1)], clean, ["bfloat16"])
    rounding = summarise("rounding", [_moments_row("s", "r1", cand=0.101, ref=0.1),
                                      _moments_row("t", "ttt", cand=0.118, ref=0.1)], clean, ["bfloat16"])
    old = summarise("old", [_row("s", "bfloat16", "PASS", "o1"), _row("t", "bfloat16", "PASS", "o2")], clean,
                    ["bfloat16"])
    killed = summarise("killed", [dict(_row("s", "bfloat16", "FAIL", "k1"), checks=["logprob"])], clean,
                       ["bfloat16"])
    assert drowned["bfloat16"]["excess_kills_at"] == {"1.4": False, "1.3": True, "1.25": True, "1.2": True,
                                                      "1.1": True}
    assert not any(rounding["bfloat16"]["excess_kills_at"][f"{x:g}"] for x in (1.4, 1.3, 1.25, 1.2))
    assert rounding["bfloat16"]["excess_kills_at"]["1.1"] is True           # 1.18x on 2000 positions
    assert set(old["bfloat16"]["excess_kills_at"].values()) == {None}
    assert killed["bfloat16"]["excess_kills_at"] == {}
    text = table(clean, [drowned, rounding, old, killed], {}, ["bfloat16"])
    assert "### Lower excess ratio limits, bfloat16 (weighed on these runs; the limit stays 1.5)" in text
    assert "Clean runs with the class moments: 2 of 2; survivors: 3." in text
    assert "| 1.4 | 0 | 0 | 1 | 25% |" in text                   # 1 killed of 4 live
    assert "| 1.3 | 0 | 1 | 1 | 50% |" in text
    assert "| 1.1 | 1 | 2 | 1 | 75% |" in text                   # the clean run at 1.18x fails there too
    section = text.split("### Lower excess ratio limits")[1]
    assert [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| 1")] == \
        [f"| {x:g}" for x in LOWER_LIMITS]
    # a repeat of seed 0 holds its numbers: its moments count where the first run's row has none (written before)
    repeat = [_row("s", "bfloat16", "PASS", "aaa"), dict(clean[0], repeat=True), _row("t", "bfloat16", "PASS", "t")]
    assert "Clean runs with the class moments: 1 of 2; survivors: 3." in table(repeat, [drowned, rounding, old,
                                                                                       killed], {}, ["bfloat16"])
    # rows without moments (an earlier measurement's) give no such table
    assert "Lower excess ratio limits" not in table([_row("s", "bfloat16", "PASS", "aaa")], [old], {}, ["bfloat16"])


@pytest.mark.gpu
def test_a_workers_16_bit_row_carries_the_class_moments_and_its_mean_delta(tmp_path):
    """What the lower-limit table and a survivor's effect are computed from, as a real worker writes it: at the
    run's own limit the moments give the row's paired z and ratio. (bf16 on a GPU: the Triton interpreter runs
    float32 only.)"""
    import json

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the vendored engine in bf16)")

    from harness.compare import EXCESS_RATIO, paired_z_at
    from mutants.scale import MOMENTS, main

    results = tmp_path / "bf16.jsonl"
    assert main(["--worker", "--checkpoint", "fixtures/tiny-bamba", "--scenarios", "batching-together",
                 "--dtypes", "bfloat16", "--device", "cuda", "--results", str(results)]) == 0
    row = json.loads(results.read_text().splitlines()[0])
    assert row["verdict"] == "PASS", row
    assert row["excess_moments"] and set(row["excess_moments"]) == set(row["excess"])
    assert row["excess_atol"] is not None and 0 < row["mean_delta"] <= row["max_delta"]
    for name, values in row["excess_moments"].items():
        entry = dict(zip(MOMENTS, values))
        assert entry["candidate_mean"] / entry["reference_mean"] == pytest.approx(row["excess"][name])
        assert entry["positions"] == row["excess_positions"][name]
        assert paired_z_at(entry, EXCESS_RATIO, row["excess_atol"]) == pytest.approx(row["excess_z"][name])
    assert 0 < row["k_to_pass"] <= 2.0


def _k_row(scenario, digest, verdict="PASS", *, k_to_pass=None, checks=(), dtype="bfloat16"):
    row = _row(scenario, dtype, verdict, digest, checks=checks)
    return row if k_to_pass is None else dict(row, k_to_pass=k_to_pass)


def test_a_larger_k_is_weighed_on_each_runs_k_to_pass():
    """fails_at_k: a logprob or token failure stays where the run needed more than that k; one k does not widen
    (excess, shape, an engine that raised) stays at any k; a passing run passes; an older row is not known."""
    from mutants.scale import fails_at_k

    assert fails_at_k(_k_row("s", "a", "FAIL", k_to_pass=2.7, checks=["logprob"]), 2.5) is True
    assert fails_at_k(_k_row("s", "a", "FAIL", k_to_pass=2.7, checks=["token"]), 3.0) is False
    assert fails_at_k(_k_row("s", "a", "FAIL", k_to_pass=2.1, checks=["excess", "logprob"]), 4.0) is True
    assert fails_at_k(_k_row("s", "a", "FAIL", k_to_pass=0.5, checks=["shape"]), 4.0) is True
    assert fails_at_k(dict(_k_row("s", "a", "ERROR"), checks=["error"]), 4.0) is True
    assert fails_at_k(_k_row("s", "a", k_to_pass=1.2), 2.5) is False
    assert fails_at_k(_k_row("s", "a"), 2.5) is False                       # passed: passes at any larger k
    # an older row failed by logprob alone under the max rule: (max |Δ| - atol) over E = (budget - atol) / 2
    old = dict(_k_row("s", "a", "FAIL", checks=["logprob"]), max_delta=0.3 + 1e-5 - 1e-9, budget=0.2 + 1e-5)
    assert fails_at_k(old, 2.5) is True and fails_at_k(old, 3.0) is False
    assert fails_at_k(dict(old, max_delta=0.3 + 1e-5 + 1e-9), 3.0) is True
    both = dict(old, checks=["logprob", "token"])                                   # a token margin unknown:
    assert fails_at_k(both, 2.5) is True and fails_at_k(both, 3.0) is None         # a lower bound only
    assert fails_at_k(dict(old, checks=["token"]), 2.5) is None
    # a first failure that is a token's: its printed margin is a lower bound (E = 0.1 here)
    token = dict(old, checks=["token"], first_failure="s: request 'r' position 3 (generated step 1): oracle token 1 "
                 "(logprob -1.0), candidate token 2 (oracle logprob of it -1.41): margin 0.41 > budget 0.2, "
                 "not a near-tie")
    assert fails_at_k(token, 4.0) is True and fails_at_k(token, 4.1) is None
    assert fails_at_k(dict(token, checks=["logprob", "token"]), 4.1) is None
    unlisted = dict(token, first_failure="s: request 'r' position 3 (generated step 2): oracle token 1 (logprob "
                    "-2.18), candidate token 5: not among the oracle's 256 most likely tokens (the last at logprob "
                    "-7.71): margin >= 5.53 > budget 5.02, not a near-tie")
    assert fails_at_k(unlisted, 1e9) is True                   # the judge cannot call it a near-tie at any k
    assert fails_at_k(dict(old, budget_floor=0.05), 2.5) is None                   # the quantile rule's
    assert fails_at_k(dict(old, routing_allowance={"positions": 1, "largest": 0.4}), 2.5) is None
    assert fails_at_k(dict(old, dtype="float64"), 2.5) is True                     # fp64's atol, 1e-10
    # a row judged by two rules is weighed by the max rule's verdict and k_to_pass
    ruled = dict(_k_row("s", "a", "FAIL", k_to_pass=9.0, checks=["logprob"]),
                 rules={"quantile": dict(verdict="FAIL", checks=["logprob"], k_to_pass=9.0),
                        "max": dict(verdict="FAIL", checks=["token"], k_to_pass=2.6)})
    assert fails_at_k(ruled, 2.5) is True and fails_at_k(ruled, 3.0) is False


def test_the_table_weighs_a_larger_k_by_clean_failures_and_kills_kept():
    from mutants.scale import LARGER_K

    clean = [_k_row("s", "aaa", k_to_pass=1.1), _k_row("t", "ttt", k_to_pass=1.4),
             _k_row("s", "bbb", "FAIL", k_to_pass=2.8, checks=["logprob"]) | {"seed": 1}]
    far = summarise("far", [_k_row("s", "f1", "FAIL", k_to_pass=40.0, checks=["logprob"])], clean, ["bfloat16"])
    near = summarise("near", [_k_row("s", "n1", "FAIL", k_to_pass=2.6, checks=["token"])], clean, ["bfloat16"])
    near_all = summarise("near-all", [_k_row("s", "m1", "FAIL", k_to_pass=2.6, checks=["logprob"]),
                                      _k_row("t", "m2", k_to_pass=1.9)], clean, ["bfloat16"])
    excess = summarise("excess", [_k_row("s", "e1", "FAIL", k_to_pass=1.0, checks=["excess"])], clean,
                       ["bfloat16"])
    old = summarise("old", [_k_row("s", "o1", "FAIL", checks=["logprob", "token"])], clean, ["bfloat16"])
    survivor = summarise("survivor", [_k_row("s", "v1", k_to_pass=1.5), _k_row("t", "v2", k_to_pass=1.0)], clean,
                         ["bfloat16"])
    assert far["bfloat16"]["kills_at_k"] == {"2.5": True, "3": True, "4": True}
    # killed in one scenario, the other not run: past its k_to_pass the other might have failed
    assert near["bfloat16"]["kills_at_k"] == {"2.5": True, "3": None, "4": None}
    assert near_all["bfloat16"]["kills_at_k"] == {"2.5": True, "3": False, "4": False}
    assert excess["bfloat16"]["kills_at_k"] == {"2.5": True, "3": True, "4": True}
    assert set(old["bfloat16"]["kills_at_k"].values()) == {None}
    assert survivor["bfloat16"]["kills_at_k"] == {}
    text = table(clean, [far, near, near_all, excess, old, survivor], {}, ["bfloat16"])
    assert "### Larger k, max rule, bfloat16 (weighed on these runs)" in text
    assert "Clean runs: 3 of 3 known; kills: 5." in text
    assert "| 2.5 | 1 | 4 | 0 | 1 | 67% |" in text           # of 6 live: far, near, near-all, excess kept
    assert "| 3 | 0 | 2 | 1 | 2 | 33% |" in text
    section = text.split("### Larger k")[1]
    assert [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| ") and "---" not in line
            and not line.startswith("| k ")] == [f"| {k:g}" for k in LARGER_K]
    # rows without k_to_pass (an earlier measurement's) give no such table
    assert "### Larger k" not in table([_row("s", "bfloat16", "PASS", "aaa")], [old], {}, ["bfloat16"])


@pytest.mark.parametrize("every", [False, True])
def test_every_scenario_resumes_a_killed_mutants_other_scenarios(every, tmp_path, monkeypatch):
    """A mutant's worker stops at its first kill; --every-scenario judges it in every scenario (what a larger k is
    weighed on), and with --resume runs a killed mutant's file again for the scenarios it lacks."""
    import json
    from types import SimpleNamespace

    import harness.runner
    import mutants.run
    from mutants import scale

    calls = []
    monkeypatch.setattr(harness.runner, "restamp_cache", lambda cache, checkpoint: None)   # a fake cache
    monkeypatch.setattr(scale, "_run_worker", _passing_worker(
        note=lambda results, kwargs: calls.append((results.name, kwargs.get("stop_at_kill")))))
    monkeypatch.setattr(mutants.run, "copy_tree", lambda root, tree, **kw: tree.mkdir(parents=True))
    args, out = _fake_measurement(tmp_path, jobs=1, resume=True, scenarios="s,t", every_scenario=every)
    clean = [_row(s, "bfloat16", "PASS", s * 3) for s in "st"]
    for name in ("clean-seed0.jsonl", scale.REPEAT):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in clean) + json.dumps(scale.DONE) + "\n")
    (out / "oracle-cache.pt").write_bytes(b"cache")
    (out / "mutant-m.jsonl").write_text(json.dumps(_row("s", "bfloat16", "FAIL", "k", checks=["logprob"])) + "\n"
                                        + json.dumps(scale.DONE) + "\n")
    scale._measure(args, out, [SimpleNamespace(name="m", apply=lambda tree: None)], [])
    assert calls == ([("mutant-m.jsonl", False)] if every else [])
