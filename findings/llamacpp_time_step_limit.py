"""Finding: llama.cpp ignores time_step_limit (llama-cpp-python 0.3.36, llama.cpp 0c1e57098).

Bamba and GraniteMoeHybrid clamp Δ = softplus(dt + dt_bias) to `time_step_limit` before the SSM update. No line of
llama.cpp's converter reads the field and its Mamba-2 graph has no clamp, so a model with a limit computes with Δ
unclamped. Config-zoo entries with a limit of (0.15, 0.9), f32, flash attention off, each judged against the oracle
of the model llama.cpp otherwise computes (RoPE as llama.cpp applies it; findings partial-rope and
granite-rope-dropped), batching-together: dt-limit-both-bounds (Bamba) max |Δ logprob| 5.2,
granite-moe4-kv2-attention-first-dt-limit 0.97, against budgets of 2.8e-05 and 2.5e-05; the same runs judged against oracles without the limit are within budget. No
converter patch removes it: the clamp is missing from the graph, not from the file.

Reproduce (make llamacpp-venv; exit status 1 while the finding holds):

    .venv/bin/python findings/llamacpp_time_step_limit.py
"""

import sys
import tempfile
from pathlib import Path


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from harness.llamacpp_cases import judge, oracle_fields_for, zoo_checkpoint
    from harness.variants import variant_checkpoint
    from reference.config import ModelConfig

    held = False
    for name in ("dt-limit-both-bounds", "granite-moe4-kv2-attention-first-dt-limit"):
        model = zoo_checkpoint(name, Path(tempfile.mkdtemp()) / name)
        fields, _ = oracle_fields_for(ModelConfig.from_json(model))
        limited = judge(model, oracle_checkpoint=variant_checkpoint(
            model, **{k: v for k, v in fields.items() if k != "time_step_limit"}))
        unlimited = judge(model, oracle_checkpoint=variant_checkpoint(model, **fields))
        held |= not limited.passed
        print(f"config-zoo {name}, batching-together, f32, flash attention off: max |Δ logprob|\n"
              f"  against the oracle with time_step_limit (0.15, 0.9): {limited.max_delta:.3g} "
              f"(budget {limited.meta['budget']:.3g})\n"
              f"  against the oracle without it:                      {unlimited.max_delta:.3g}")
    return 1 if held else 0


if __name__ == "__main__":
    sys.exit(main())
