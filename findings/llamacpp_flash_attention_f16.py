"""Finding: with flash attention, llama.cpp computes attention in f16 even with an f32 model and an f32 K/V cache
(llama-cpp-python 0.3.36, llama.cpp 0c1e57098).

llama_context_params.flash_attn_type defaults to auto, which turns flash attention on for the CPU. build_attn_mha
(src/llama-graph.cpp) then casts an f32 K and V to f16 before ggml_flash_attn_ext, and the CPU kernel converts Q to
K's type: an f32 GGUF run with `-ctk f32 -ctv f32` does its attention in f16 unless flash attention is turned off,
and nothing says so. fixtures/tiny-granite (published layer names), f32: max |Δ logprob| 2.6e-04 against a budget
of 1.5e-05 (17x) with flash attention on; 2.9e-06 with it off.

Reproduce (make llamacpp-venv; exit status 1 while the finding holds):

    .venv/bin/python findings/llamacpp_flash_attention_f16.py
"""

import sys
import tempfile
from pathlib import Path


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from harness.llamacpp_cases import FIXTURES, PRE_TOKENIZER, judge, published_granite

    model = published_granite(FIXTURES / "tiny-granite", Path(tempfile.mkdtemp()) / "tiny-granite")
    on = judge(model, flash_attn="on", kv_type="f32", **PRE_TOKENIZER)
    off = judge(model, flash_attn="off", kv_type="f32", **PRE_TOKENIZER)
    print("fixtures/tiny-granite, batching-together, f32 GGUF, f32 K/V cache: max |Δ logprob|\n"
          f"  flash attention on:  {on.max_delta:.3g} (budget {on.meta['budget']:.3g})\n"
          f"  flash attention off: {off.max_delta:.3g} (budget {off.meta['budget']:.3g})")
    return 0 if on.passed else 1


if __name__ == "__main__":
    sys.exit(main())
