"""Measure the atol a dtype needs: how far an engine exceeds k · (the reference's own error) against the oracle.

    python -m harness.measure_atol --engine transformers --dtype float32 CHECKPOINT [CHECKPOINT ...]

For every checkpoint it runs the given scenarios with atol = 0 and prints, per scenario, the excess
max |candidate − oracle| − k · E over every compared position, the reference error E and the largest |Δ|. The atol
written into compare.ATOL must be at least the largest excess seen (compare.py says which runs set it).
"""

from __future__ import annotations

import argparse

from reference.config import ModelConfig

from .cli import prepare_environment
from .compare import DEFAULT_K
from .runner import Oracle, ScenarioSkipped, check_scenario
from .scenarios import PromptSource, build_scenarios, select_scenarios


def atol_excess(engine: str, checkpoint, *, dtype: str, device: str = "cpu", scenarios: str = "batching-together",
                k: float = DEFAULT_K, seed: int = 0) -> dict[str, tuple[float, float, float]]:
    """scenario id -> (max |Δ| − k·E, E, max |Δ|) of `engine` on `checkpoint` (atol = 0); skipped ones left out."""
    cfg = ModelConfig.from_json(checkpoint)
    source = PromptSource(cfg.vocab_size, seed=seed)
    oracle = Oracle(checkpoint, device=device)
    out = {}
    for scenario in select_scenarios(build_scenarios(cfg), scenarios):
        try:
            report = check_scenario(engine, scenario, oracle=oracle, source=source, dtype=dtype, device=device, k=k,
                                    atol=0.0)
        except ScenarioSkipped:
            continue
        out[scenario.id] = (report.max_delta - report.meta["budget"], report.meta["reference_error"],
                            report.max_delta)
    oracle.close()
    return out


def main(argv: list[str] | None = None) -> None:
    prepare_environment()
    parser = argparse.ArgumentParser(prog="python -m harness.measure_atol", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--engine", default="transformers")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--scenarios", default="batching-together,cudagraph-off")
    parser.add_argument("--k", type=float, default=DEFAULT_K)
    args = parser.parse_args(argv)
    for checkpoint in args.checkpoints:
        found = atol_excess(args.engine, checkpoint, dtype=args.dtype, device=args.device, scenarios=args.scenarios,
                            k=args.k)
        for scenario, (excess, ref_error, delta) in found.items():
            print(f"{checkpoint}  {scenario:28s} excess {excess:.3g}  E {ref_error:.3g}  max |Δ| {delta:.3g}")


if __name__ == "__main__":
    main()
