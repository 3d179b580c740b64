"""The oracle against transformers' BambaForCausalLM and GraniteMoeHybridForCausalLM on the config zoo
(harness/zoo.py, both families): every config field that changes the math, away from its default, on checkpoints both
load from the same directory. For GraniteMoeHybrid that includes routed experts (top-1 and top-2) beside the shared
MLP, a dense model, NoPE, and every multiplier away from 1.

transformers runs in fp32, the oracle in fp64. Measured on the zoo (CPU, torch 2.13, transformers 5.17, the full
log-softmax at every position of a 30-token prompt of every entry): max |Δ logprob| = 2.6e-5, from transformers' fp32
arithmetic (its RoPE and scan run in fp32 even when asked for fp64). The bound, 1e-4, is 3.8x that and 100x below
what the bugs these tests exist for do on these weights (a tiled group map, a RoPE position off by one, a dropped
D term, a config field read from the wrong place each move some logprob by 1e-2 or more). The zoo's weights give
peaked logits (median top-1 probability 0.37-0.54 on 30-token prompts), so a wrong model cannot hide in a flat
distribution.

transformers' PyTorch path normalises the gated RMSNorm over the whole H·P width; Bamba (mamba_ssm's fused kernel,
vLLM, and the oracle by default) normalises each of the G groups separately. With G > 1 the two disagree, so the
oracle is run with gated_norm="full" to compare everything else, and a separate test pins the disagreement.
"""

import pytest
import torch

from harness import zoo
from reference.model import BambaReference
from tests.helpers import random_bamba_checkpoint

transformers = pytest.importorskip("transformers")

LOGPROB_BOUND = 1e-4
NEAR_TIE = 1e-3          # greedy tokens may differ only where the oracle's top-2 margin is below this
LENGTH_NAMES = ("T1", "T_W-1", "T_Q-1", "T_Q", "T_Q+1", "T_3Q+5")

# Pinned finding: transformers 5.17's BambaConfig overwrites partial_rotary_factor with 0.5 "for backward
# compatibility" unless the file has it inside rope_parameters, so a checkpoint that states it at the top level (the
# layout rope_theta is also accepted in) is served with half the head rotated. The oracle reads it where it is.
# A one-token prompt cannot show it (position 0 is not rotated), so the mark goes on the cases with positions > 0.
# Pinned finding: transformers 5.17's GraniteMoeHybrid RoPE always rotates the whole head (its default RoPE
# ignores rope_parameters.partial_rotary_factor); vLLM honours the factor, and so does the oracle, for both families.
TRANSFORMERS_DEVIATIONS = {
    "rope-top-level-rotary0.25": pytest.mark.xfail(
        strict=True, reason="transformers 5.17 BambaConfig ignores a top-level partial_rotary_factor (hard-coded "
                            "0.5); measured max |Δ logprob| 4.9 on this entry"),
    "granite-rotary0.5": pytest.mark.xfail(
        strict=True, reason="transformers 5.17 GraniteMoeHybrid rotates the whole head whatever "
                            "rope_parameters.partial_rotary_factor says; measured max |Δ logprob| 4.4 on this entry"),
}

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
           pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])]


def prompt_lengths(cfg) -> dict[str, int]:
    """1, W-1, Q-1, Q, Q+1 and 3Q+5 of the entry's conv width W and chunk size Q, by LENGTH_NAMES."""
    W, Q = cfg.mamba_d_conv, cfg.mamba_chunk_size
    return dict(zip(LENGTH_NAMES, (1, W - 1, Q - 1, Q, Q + 1, 3 * Q + 5)))


# The zoo entries this cross-check runs (tests/harness/test_zoo_coverage.py reads it, less TRANSFORMERS_DEVIATIONS).
TRANSFORMERS_ZOO = list(zoo.ZOO) + list(zoo.GRANITE_ZOO)


@pytest.fixture(scope="module", params=TRANSFORMERS_ZOO)
def checkpoint(request, tmp_path_factory):
    return request.param, zoo.write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _pair(path, device):
    ref = BambaReference.from_pretrained(path, dtype=torch.float64, device=device)
    norm = "grouped" if ref.cfg.mamba_n_groups == 1 else "full"
    ref = BambaReference.from_pretrained(path, dtype=torch.float64, device=device, gated_norm=norm)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    assert type(hf).__name__ == ("GraniteMoeHybridForCausalLM" if ref.cfg.granite else "BambaForCausalLM")
    return ref, hf


def _prompt(length, vocab, seed):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def _zoo_prompt(name, length, seed):
    """The entry's own prompts (with its pad token inside where it has one)."""
    return torch.tensor(zoo.prompt_source(name, seed=seed).tokens(length, 0))


def _hf_logprobs(hf, ids):
    """Every next-token distribution of transformers over ids, recomputed from scratch (no cache)."""
    with torch.no_grad():
        logits = hf(ids[None].to(hf.device), use_cache=False).logits[0].double()
    return torch.log_softmax(logits, dim=-1).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("length_name", LENGTH_NAMES)
def test_prompt_logprobs_match_transformers(checkpoint, length_name, device, request):
    name, path = checkpoint
    ref, hf = _pair(path, device)
    length = prompt_lengths(ref.cfg)[length_name]
    if name in TRANSFORMERS_DEVIATIONS and length > 1:
        request.applymarker(TRANSFORMERS_DEVIATIONS[name])
    ids = _zoo_prompt(name, length, seed=length)
    ours = torch.log_softmax(ref.forward(ids)[0], dim=-1)                 # (T, V) every next-token distribution
    theirs = _hf_logprobs(hf, ids)
    err = (ours.cpu() - theirs.cpu()).abs()
    worst = divmod(int(err.argmax()), err.shape[1])
    assert err.max() <= LOGPROB_BOUND, (
        f"{name}, T={length}: |Δ logprob| {err.max():.3g} > {LOGPROB_BOUND} at position {worst[0]}, token {worst[1]}")


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_decode_matches_transformers(checkpoint, device, request):
    """16 greedy steps of the oracle (carrying its state) against transformers recomputing the whole sequence."""
    name, path = checkpoint
    if name in TRANSFORMERS_DEVIATIONS:
        request.applymarker(TRANSFORMERS_DEVIATIONS[name])
    ref, hf = _pair(path, device)
    prompt = _zoo_prompt(name, ref.cfg.mamba_chunk_size + 3, seed=5)
    tokens, steps = ref.greedy(prompt, 16)
    sequence = prompt.tolist()
    for step, ours in enumerate(tokens):
        theirs_all = _hf_logprobs(hf, torch.tensor(sequence))[-1]
        err = (steps[step].cpu() - theirs_all).abs().max()
        assert err <= LOGPROB_BOUND, f"{name}: step {step} |Δ logprob| {err:.3g} > {LOGPROB_BOUND}"
        theirs = int(theirs_all.argmax())
        if ours != theirs:
            top2 = steps[step].topk(2).values
            margin = float(top2[0] - top2[1])
            assert margin < NEAR_TIE, (f"{name}: step {step} oracle chose {ours}, transformers {theirs}, but the "
                                       f"oracle's top-2 margin {margin:.3g} is no near-tie")
        sequence.append(ours)             # continue teacher-forced on the oracle's tokens


def test_transformers_cannot_generate_pure_mamba2(tmp_path):
    """Pinned finding: transformers 5.17 builds the attention mask from a cache with no attention layer and fails,
    so a pure-Mamba2 Bamba (attn_layer_indices = []) cannot decode with a cache there. The oracle can."""
    path = random_bamba_checkpoint(tmp_path, seed=11, attn_layer_indices=[])
    hf = transformers.BambaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="get_seq_length"):
        hf(torch.tensor([[1, 2, 3]]), use_cache=True)


def test_transformers_gated_norm_ignores_groups(tmp_path):
    """Pinned finding: with G > 1, transformers (PyTorch path) and Bamba's grouped gated norm disagree.

    Measured on this config: max |Δ logprob| = 12.6 over a 21-token prompt. If transformers starts normalising per
    group, this fails: then drop the gated_norm="full" special case above.
    """
    path = random_bamba_checkpoint(tmp_path, seed=11, mamba_n_groups=2)
    ref = BambaReference.from_pretrained(path)                          # grouped, as Bamba defines it
    hf = transformers.BambaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _prompt(21, ref.cfg.vocab_size, seed=1)
    err = (torch.log_softmax(ref.forward(ids)[0], -1) - _hf_logprobs(hf, ids)).abs().max()
    assert err > 1e-2
