"""The system under test: our Triton kernels (vendored.ops) and the engine built on them (vendored.engine).
Imports nothing from reference/ or harness/."""
