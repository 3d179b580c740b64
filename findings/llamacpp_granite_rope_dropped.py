"""Finding: llama.cpp computes a GraniteMoeHybrid with RoPE as if it had none (llama-cpp-python 0.3.36, llama.cpp
0c1e57098).

GraniteMoeHybridConfig lets a model choose `position_embedding_type` "rope" (RoPE on its attention layers) or "nope".
The converter decides instead: it writes `rope_scaling.finetuned` (which llama.cpp's granite-hybrid graph reads as
its switch for RoPE) true only for BambaForCausalLM or a model without Mamba layers, so every hybrid
GraniteMoeHybrid runs without RoPE whatever its config says. Granite 4.0-H is published with NoPE, so it is not hit;
a GraniteMoeHybrid trained with RoPE is. Config-zoo granite-moe4-top2 (RoPE, whole head), f32, flash attention off,
batching-together: max |Δ logprob| 2.35 against a budget of 2.9e-05; judged against an oracle given
position_embedding_type "nope" it is within budget (4.3e-06), and so is the patched conversion (4.2e-06).

`apply` is the converter patch that removes it (applied only in this finding's test): write the switch from
position_embedding_type. Reproduce (make llamacpp-venv; exit status 1 while the finding holds):

    .venv/bin/python findings/llamacpp_granite_rope_dropped.py
"""

import sys
import tempfile
from pathlib import Path


def apply(conversion) -> None:
    """The converter patch: RoPE on when the config asks for it."""
    from conversion.granite import GraniteHybridModel

    write = GraniteHybridModel.set_gguf_parameters

    def set_gguf_parameters(self):
        write(self)
        if self.hparams.get("position_embedding_type") == "rope":
            self.gguf_writer.add_rope_scaling_finetuned(True)

    GraniteHybridModel.set_gguf_parameters = set_gguf_parameters


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from harness.llamacpp_cases import judge, zoo_checkpoint
    from harness.variants import variant_checkpoint

    model = zoo_checkpoint("granite-moe4-top2", Path(tempfile.mkdtemp()) / "granite-moe4-top2")
    plain = judge(model)
    patched = judge(model, convert_patch=str(Path(__file__).resolve()))
    nope = judge(model, oracle_checkpoint=variant_checkpoint(model, position_embedding_type="nope"))
    print("config-zoo granite-moe4-top2, batching-together, f32, flash attention off: max |Δ logprob|\n"
          f"  llama.cpp against the oracle:                      {plain.max_delta:.3g} (budget {plain.meta['budget']:.3g})\n"
          f"  llama.cpp, converter patched, against the oracle:  {patched.max_delta:.3g}\n"
          f"  llama.cpp against an oracle without RoPE (NoPE):   {nope.max_delta:.3g}")
    return 0 if plain.passed else 1


if __name__ == "__main__":
    sys.exit(main())
