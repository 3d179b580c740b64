"""Finding: llama.cpp cannot load a hybrid whose vocabulary is not a multiple of 8 (llama-cpp-python 0.3.36,
llama.cpp 0c1e57098).

For Bamba and GraniteMoeHybrid the converter rounds the vocabulary up to a multiple of 8 (pad_vocab_size_multiple,
a Mamba convention) in the token list it writes, but writes the embedding and output matrices as they are. llama.cpp
sizes the matrices by the token list and refuses the file: config-zoo granite-moe8-top1-nope-groups2 (97 tokens)
gives "check_tensor_dims: tensor 'token_embd.weight' has wrong shape; expected 64, 104, got 64, 97". Bamba-9B
(128,256) and Granite 4.0-H (100,352) are multiples of 8 and are not hit; every other vocabulary is.

`apply` is the converter patch that removes it (applied only in this finding's test): no padding. With it llama.cpp
loads the model and agrees with the oracle within the fp32 budget. Reproduce (make llamacpp-venv; exit status 1 while
the finding holds):

    .venv/bin/python findings/llamacpp_padded_vocabulary.py
"""

import sys
import tempfile
from pathlib import Path


def apply(conversion) -> None:
    """The converter patch: the token list as long as the matrices."""
    from conversion.granite import GraniteHybridModel
    from conversion.mamba import Mamba2Model

    def set_vocab(self):
        self.hparams["pad_vocab_size_multiple"] = 1
        Mamba2Model.set_vocab(self)

    GraniteHybridModel.set_vocab = set_vocab


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from harness.llamacpp_cases import judge, refusal, zoo_checkpoint

    model = zoo_checkpoint("granite-moe8-top1-nope-groups2", Path(tempfile.mkdtemp()) / "vocab97", round_vocab=False)
    said = refusal(model)
    patched = judge(model, convert_patch=str(Path(__file__).resolve()))
    print(f"config-zoo granite-moe8-top1-nope-groups2, vocabulary 97:\n  llama.cpp: {said or 'runs'}\n"
          f"  converter patched, batching-together, f32: max |Δ logprob| {patched.max_delta:.3g} "
          f"(budget {patched.meta['budget']:.3g})")
    return 1 if said else 0


if __name__ == "__main__":
    sys.exit(main())
