"""The harness: one interface for every engine (engine.py, adapters/), the scenario matrix (scenarios.py), the
judgement of a candidate against the fp64 oracle (compare.py, runner.py) and the `bamba-harness` command (cli.py)."""
