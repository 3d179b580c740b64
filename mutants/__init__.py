"""The mutation suite: bugs that public engines shipped (docs/bug-classes.md) and classic kernel slips, each planted
in a scratch copy of `vendored/` (a few in the oracle or the judge) to show that the test suite fails on it.

`mutants/defs/*.toml` hold one mutant each (see mutants/mutant.py for the format); `python -m mutants.run` (`make
mutants`, `make mutants-gpu`) applies each to its own copy of the tree, runs the test selection it names and reports
which test caught it.
"""
