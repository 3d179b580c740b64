"""Tables of run.sh's runs: the max budget's verdicts, and the excess test at lower ratio limits (from each class's
moments, harness.compare.paired_z_at): per limit, the scenario runs and position classes it would fail, how many
classes are over it and the largest paired z among those. With --rows FILE, one JSON row per scenario run (its
verdict, largest |Δ| over its budget, first failure) and per judged class are written there.
Usage: PYTHONPATH=. python analyze.py OUTDIR [--rows FILE] (from the repository root)"""

import argparse
import json
from pathlib import Path

from harness.compare import excess_verdict_at
from mutants.scale import LOWER_LIMITS

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--rows")
a = p.parse_args()
runs, rows = [], []
for report in sorted(Path(a.out).glob("seed*/report.json"), key=lambda f: int(f.parent.name[4:])):
    seed = int(report.parent.name[4:])
    for s in json.loads(report.read_text())["scenarios"]:
        if s["verdict"] == "SKIP":
            continue
        runs.append((seed, s))
        rows.append({"seed": seed, "scenario": s["scenario"], "verdict": s["verdict"],
                     "max_abs_delta": s["max_abs_delta"], "reference_error": s["reference_error"],
                     "budget": s["budget"], "over_budget": s["max_abs_delta"] / s["budget"],
                     "positions": sum(len(q["positions"]) for q in s["requests"]),
                     "failures": [f["message"] for f in s["failures"][:3]]})
        for name, c in (s.get("excess") or {}).get("classes", {}).items():
            if c["judged"]:
                rows.append({"seed": seed, "scenario": s["scenario"], "class": name, "atol": s["excess"]["atol"],
                             **{k: c[k] for k in ("positions", "candidate_mean", "reference_mean", "ratio",
                                                  "paired_z", "candidate_var", "reference_var", "covariance")}})
if a.rows:
    Path(a.rows).write_text("".join(json.dumps(r) + "\n" for r in rows))
failed = [(seed, s) for seed, s in runs if s["verdict"] != "PASS"]
worst = max(runs, key=lambda r: r[1]["max_abs_delta"] / r[1]["budget"])
print(f"{len(runs)} scenario runs ({len({seed for seed, _ in runs})} seeds); failed: {len(failed)}"
      + "".join(f"\n- seed {seed} {s['scenario']}: {s['failures'][0]['message']}" for seed, s in failed)
      + f"\nlargest |Δ| over the max budget: {worst[1]['max_abs_delta'] / worst[1]['budget']:.3f} (seed {worst[0]} "
        f"{worst[1]['scenario']})")
classes = [r for r in rows if "class" in r]
if classes:
    print(f"\n{len(classes)} judged classes; largest ratio {max(c['ratio'] for c in classes):.3f}\n")
    print("| excess ratio limit | runs failed | classes failed | classes over the limit | largest paired z of those |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for x in (1.5, *LOWER_LIMITS):
        over, bad = [], set()
        for c in classes:
            over_ratio, fails, z = excess_verdict_at(c, x, c["atol"])
            if over_ratio:
                over.append((z, c))
            if fails:
                bad.add((c["seed"], c["scenario"], c["class"]))
        top = max(over, key=lambda t: t[0], default=None)
        where = "-" if top is None else (f"{top[0]:.2f} (seed {top[1]['seed']} {top[1]['scenario']} {top[1]['class']}, "
                                         f"{top[1]['positions']} positions, {top[1]['ratio']:.2f}x)")
        print(f"| {x:g} | {len({(s, sc) for s, sc, _ in bad})} | {len(bad)} | {len(over)} | {where} |")
