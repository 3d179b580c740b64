"""Finding: llama.cpp's converter (llama-cpp-python 0.3.36, llama.cpp 0c1e57098) loses partial RoPE.

Bamba rotates only the first R = head_dim · partial_rotary_factor dims of each attention head (0.5 by default: 16 of
32 on fixtures/tiny-bamba; GraniteMoeHybrid takes the factor from rope_parameters). convert_hf_to_gguf.py reads the
factor into its rope_parameters but never writes it: the rotary dimension count it writes is the whole head
(LlamaModel.set_gguf_parameters) unless the config has the non-standard `attn_rotary_emb`, and the Q/K rows it
permutes from Hugging Face's rotate-half layout to llama.cpp's interleaved pairs span the whole head too. So
llama.cpp rotates every dim of every head, and a Bamba checkpoint computes another model: on the tiny model, max
|Δ logprob| against the fp64 oracle 0.25-0.93 per scenario (flash attention off), top-1 agreement 91-97%. Writing
the rotary count alone (what a config.json with `attn_rotary_emb` gets) still leaves 0.24 on batching-together:
the rows past R are permuted all the same.

`apply` below is the converter patch that removes the error, applied only by this finding's test
(harness/adapters/llamacpp_convert.py --patch): write R as the rotary count, and permute only the first R rows of
each head. With it llama.cpp agrees with the oracle within the fp32 budget on every scenario; without it, it agrees
with an oracle given partial_rotary_factor = 1 instead.

Reproduce from the repository root (make llamacpp-venv; prints the three numbers, exit status 1 while the finding
holds):

    .venv/bin/python findings/llamacpp_partial_rope.py
"""

import sys
from pathlib import Path


def rotary_dims(hparams: dict) -> int:
    """R for a Bamba or GraniteMoeHybrid config.json, as the model defines it (BambaConfig's default factor 0.5,
    GraniteMoeHybridConfig's 1.0; rope_parameters first, then the top-level field)."""
    head_dim = hparams["hidden_size"] // hparams["num_attention_heads"]
    bamba = "BambaForCausalLM" in hparams.get("architectures", [])
    rope = hparams.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", hparams.get("partial_rotary_factor", 0.5 if bamba else 1.0))
    return int(head_dim * factor)


def apply(conversion) -> None:
    """The converter patch: partial RoPE kept (runs inside llama.cpp's converter, see the module docstring)."""
    import torch
    from conversion.granite import GraniteHybridModel
    from conversion.llama import LlamaModel

    rotary = {}
    init = GraniteHybridModel.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        rotary["dims"] = self.hparams["attn_rotary_emb"] = rotary_dims(self.hparams)

    def permute(weights, n_head, n_head_kv):
        if n_head_kv is not None and n_head != n_head_kv:
            n_head = n_head_kv
        head_dim = weights.shape[0] // n_head
        R = rotary.get("dims", head_dim)
        heads = weights.reshape(n_head, head_dim, *weights.shape[1:])                 # (heads, Dh, ...)
        rotated = (heads[:, :R].reshape(n_head, 2, R // 2, *weights.shape[1:])        # rotate-half pairs (i, i+R/2)
                   .swapaxes(1, 2).reshape(n_head, R, *weights.shape[1:]))             # -> interleaved (2i, 2i+1)
        return torch.cat([rotated, heads[:, R:]], dim=1).reshape(weights.shape)

    GraniteHybridModel.__init__ = __init__
    LlamaModel.permute = staticmethod(permute)


def apply_rotary_count_only(conversion) -> None:
    """Half of the patch: the rotary count written (as a config.json with the non-standard attn_rotary_emb gets),
    the permutation left over the whole head. Not enough: the rows beyond R are still permuted."""
    from conversion.granite import GraniteHybridModel

    init = GraniteHybridModel.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.hparams["attn_rotary_emb"] = rotary_dims(self.hparams)

    GraniteHybridModel.__init__ = __init__


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from harness.llamacpp_cases import FIXTURES, PRE_TOKENIZER, judge
    from harness.variants import variant_checkpoint

    tiny = FIXTURES / "tiny-bamba"
    plain = judge(tiny, **PRE_TOKENIZER)
    patched = judge(tiny, convert_patch=str(Path(__file__).resolve()), **PRE_TOKENIZER)
    count = judge(tiny, convert_patch=f"{Path(__file__).resolve()}::apply_rotary_count_only", **PRE_TOKENIZER)
    whole = judge(tiny, oracle_checkpoint=variant_checkpoint(tiny, partial_rotary_factor=1.0), **PRE_TOKENIZER)
    print("fixtures/tiny-bamba, batching-together, f32, flash attention off: max |Δ logprob|\n"
          f"  llama.cpp against the oracle:                          {plain.max_delta:.3g} (budget {plain.meta['budget']:.3g})\n"
          f"  llama.cpp, converter patched, against the oracle:      {patched.max_delta:.3g} (budget "
          f"{patched.meta['budget']:.3g})\n"
          f"  llama.cpp, rotary count alone written, against the oracle: {count.max_delta:.3g}\n"
          f"  llama.cpp against an oracle with partial_rotary_factor 1: {whole.max_delta:.3g} (budget "
          f"{whole.meta['budget']:.3g})")
    return 0 if plain.passed else 1


if __name__ == "__main__":
    sys.exit(main())
