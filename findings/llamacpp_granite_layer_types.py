"""Finding: a GraniteMoeHybrid checkpoint saved by transformers >= 5 converts to a GGUF that llama.cpp cannot load
(llama-cpp-python 0.3.36, llama.cpp 0c1e57098).

transformers 5 spells GraniteMoeHybrid's layer_types "linear_attention" / "full_attention" (it reads the published
"mamba" / "attention" and writes the new names when it saves). llama.cpp's converter counts a layer as attention
only when its type is "attention", so it takes every layer for a Mamba layer, writes a layer map without attention,
and llama.cpp refuses the file: fixtures/tiny-granite (saved by transformers 5.17) gives "check_tensor_dims: tensor
'blk.2.ssm_in.weight' not found". Any Granite 4.0-H fine-tuned and saved with transformers 5 is hit.

`apply` is the converter patch that removes it (applied only in this finding's test): read both spellings. With it
(or with the checkpoint in the published spelling) llama.cpp agrees with the oracle within the fp32 budget.
Reproduce (make llamacpp-venv; exit status 1 while the finding holds):

    .venv/bin/python findings/llamacpp_granite_layer_types.py
"""

import sys
from pathlib import Path

ATTENTION = ("attention", "full_attention")


def apply(conversion) -> None:
    """The converter patch: a layer is attention in either spelling."""
    from conversion.granite import GraniteHybridModel

    find = GraniteHybridModel.get_attn_layers

    def get_attn_layers(self):
        if layer_types := self.hparams.get("layer_types"):
            return [i for i, kind in enumerate(layer_types) if kind in ATTENTION]
        return find(self)

    GraniteHybridModel.get_attn_layers = get_attn_layers


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from harness.llamacpp_cases import FIXTURES, PRE_TOKENIZER, judge, refusal

    tiny = FIXTURES / "tiny-granite"
    said = refusal(tiny, **PRE_TOKENIZER)
    patched = judge(tiny, convert_patch=str(Path(__file__).resolve()), **PRE_TOKENIZER)
    print(f"fixtures/tiny-granite as transformers 5 saved it:\n  llama.cpp: {said or 'runs'}\n"
          f"  converter patched, batching-together, f32: max |Δ logprob| {patched.max_delta:.3g} "
          f"(budget {patched.meta['budget']:.3g})")
    return 1 if said else 0


if __name__ == "__main__":
    sys.exit(main())
