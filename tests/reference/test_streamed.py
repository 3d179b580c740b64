"""The layer-streamed oracle (reference/model.py, LazyWeights in reference/checkpoint.py): the same bits as the
resident one, one layer's weights at a time, on the bundled tiny models and on zoo entries of both families."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness import zoo
from harness.cli import UsageError, main, parse_size
from harness.compare import results_digest
from harness.engine import Request
from harness.runner import Oracle
from reference.checkpoint import CheckpointError, LazyWeights, expected_shapes, key_names
from reference.config import ModelConfig
from reference.model import BambaReference, host_copies_fit

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
TINY = FIXTURES / "tiny-bamba"
ZOO = ("conv-width3-all-biases", "tied-embeddings-vocab300", "granite-moe8-top1-nope-groups2")


@pytest.fixture(scope="module", params=["tiny-bamba", "tiny-granite", *ZOO])
def checkpoint(request, tmp_path_factory):
    if request.param.startswith("tiny-"):
        return FIXTURES / request.param
    return zoo.write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _pieces(cfg: ModelConfig, seed: int) -> list[list[torch.Tensor]]:
    """Two calls: three sequences (one of a single token), then the next pieces of two of them."""
    gen = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=gen)       # noqa: E731
    return [[ids(2 * cfg.mamba_chunk_size + 3), ids(1), ids(cfg.mamba_chunk_size - 1)], [ids(5), ids(1)]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_streamed_gives_the_resident_bits(checkpoint, dtype, device):
    resident = BambaReference.from_pretrained(checkpoint, dtype=dtype, device=device)
    streamed = BambaReference.from_pretrained(checkpoint, dtype=dtype, device=device, streamed=True)
    assert streamed.streamed and not resident.streamed
    first, second = ([t.to(device) for t in call] for call in _pieces(resident.cfg, seed=3))
    outputs = []
    for model in (resident, streamed):
        logits, states = model.forward_batch(first, [model.initial_state() for _ in first])
        more, after = model.forward_batch(second, [states[0], states[2]])          # the piece-wise API
        outputs.append((logits + more, states + after))
    (logits_r, states_r), (logits_s, states_s) = outputs
    for a, b in zip(logits_r, logits_s):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    for a, b in zip(states_r, states_s):
        assert a.length == b.length
        for field in ("conv", "ssm", "keys", "values"):
            got, want = getattr(b, field), getattr(a, field)
            assert got.keys() == want.keys() and all(torch.equal(got[i], want[i]) for i in want), field
    tokens, rows = streamed.greedy(first[2][:7], 4)
    assert (tokens, rows.tolist()) == (lambda t, r: (t, r.tolist()))(*resident.greedy(first[2][:7], 4))
    # on a GPU the streamed model copies each layer from page-locked host copies of the stored tensors
    assert streamed.w.store.host_copies == (device == "cuda")
    assert all(t.is_pinned() for t in streamed.w.store._copies.values()) if device == "cuda" else True


def test_host_copies_give_the_files_bytes_and_read_each_tensor_once(monkeypatch, tmp_path):
    for path in (TINY, zoo.write_checkpoint("tied-embeddings-vocab300", tmp_path)):
        cfg = ModelConfig.from_json(path / "config.json")
        plain, copies = LazyWeights(path, cfg), LazyWeights(path, cfg, host_copies=True)
        reads = []
        read = LazyWeights._read
        monkeypatch.setattr(LazyWeights, "_read", lambda self, key: reads.append(key) or read(self, key))
        for _ in range(2):
            for key in plain.keys():
                a, b = plain.load(key), copies.load(key)
                assert a.dtype == b.dtype and torch.equal(a, b), key
        stored = [k for k in plain.keys() if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
        as_stored = ["model.embed_tokens.weight" if k not in stored else k for k in plain.keys()]  # the tied head
        assert sorted(reads) == sorted(2 * as_stored + stored)      # the copies read once per stored tensor
        assert copies.host_copy_bytes == copies.stored_bytes == sum(
            plain.load(k).numel() * plain.load(k).element_size() for k in stored)
        assert plain.host_copy_bytes == 0
        monkeypatch.undo()


def test_streamed_from_host_copies_gives_the_resident_bits():
    cfg = ModelConfig.from_json(TINY / "config.json")
    resident = BambaReference.from_pretrained(TINY)
    copies = BambaReference(cfg, LazyWeights(TINY, cfg, host_copies=True))
    assert copies.streamed and not BambaReference.from_pretrained(TINY, streamed=True).w.store.host_copies  # CPU
    for call in _pieces(cfg, seed=5):
        want, _ = resident.forward_batch(call, [resident.initial_state() for _ in call])
        got, _ = copies.forward_batch(call, [copies.initial_state() for _ in call])     # the second: from copies
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_host_copies_only_where_they_fit_half_the_available_memory(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemAvailable:    40000000 kB\n")
    assert host_copies_fit(20_000_000 * 1024, str(meminfo))
    assert not host_copies_fit(20_000_001 * 1024, str(meminfo))
    meminfo.write_text("MemTotal:       131072000 kB\n")
    assert not host_copies_fit(1, str(meminfo)) and not host_copies_fit(1, str(tmp_path / "absent"))


def test_one_layers_weights_at_a_time_and_only_those():
    cfg = ModelConfig.from_json(TINY / "config.json")
    streamed = BambaReference.from_pretrained(TINY, streamed=True)
    resident = BambaReference.from_pretrained(TINY)
    shapes = expected_shapes(cfg)
    nbytes = lambda keys: sum(torch.Size(shapes[k]).numel() * 8 for k in keys)     # noqa: E731
    names = key_names(cfg)
    scopes = [["model.embed_tokens.weight"], [names["final_norm"], "lm_head.weight"]] + [
        [k for k in shapes if k.startswith(f"model.layers.{i}.")] for i in range(cfg.num_hidden_layers)]
    streamed.forward_batch([torch.tensor([1, 2, 3])], [streamed.initial_state()])
    assert streamed.peak_weight_bytes == max(nbytes(s) for s in scopes)
    assert resident.peak_weight_bytes == nbytes(shapes) > 2 * streamed.peak_weight_bytes
    with pytest.raises(KeyError, match="not among the weights loaded"):
        streamed.w["model.layers.0.input_layernorm.weight"]                        # outside any layer's scope


def test_lazy_weights_check_the_headers_like_the_loader(tmp_path):
    cfg = ModelConfig.from_json(TINY / "config.json")
    lazy = LazyWeights(TINY, cfg)
    assert set(lazy.keys()) == set(expected_shapes(cfg))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((TINY / "config.json").read_text())
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(TINY / "model.safetensors"))
    tensors.pop("model.layers.0.input_layernorm.weight")
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.0.input_layernorm.weight: missing"):
        LazyWeights(broken, cfg)


def _requests(cfg) -> list[Request]:
    gen = torch.Generator().manual_seed(5)
    return [Request(f"r{i}", torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist(), new, top_k=5)
            for i, (n, new) in enumerate([(20, 4), (1, 3), (37, 2)])]


def test_the_oracle_under_a_cap_streams_and_gives_the_same_results_and_budget():
    cfg = ModelConfig.from_json(TINY / "config.json")
    requests = _requests(cfg)
    resident, capped = Oracle(TINY), Oracle(TINY, memory_limit=1 << 20)
    assert (resident.weights_mode(), capped.weights_mode(), capped.weights_mode(torch.bfloat16)) == \
        ("resident", "streamed", "streamed")
    assert Oracle(TINY, memory_limit=1 << 40).weights_mode() == "resident"
    try:
        for a, b in zip(resident.results(requests), capped.results(requests)):
            assert a.output_ids == b.output_ids
            for field in ("prompt_logprobs", "prompt_top_ids", "prompt_top_logprobs", "output_logprobs",
                          "output_top_ids", "output_top_logprobs", "output_near_ids", "output_near_logprobs"):
                assert torch.equal(getattr(a, field), getattr(b, field)), field    # near-tie lists included
        assert resident.budget(requests, torch.float32) == capped.budget(requests, torch.float32)   # the twin
        described = capped.describe()
        assert described["memory_limit_bytes"] == 1 << 20
        models = {m["dtype"]: m for m in described["models"]}
        assert models["float64"]["weights"] == models["float32"]["weights"] == "streamed"
        assert 0 < models["float64"]["peak_weight_bytes"] < models["float64"]["weight_bytes"] / 2
        assert models["float64"]["host_copy_bytes"] == 0            # on the CPU the files are read at each pass
        assert "host_copy_bytes" not in resident.describe()["models"][0]
        assert resident.describe()["models"][0]["weights"] == "resident"
    finally:
        resident.close()
        capped.close()
    with pytest.raises(ValueError, match="memory_limit"):
        Oracle(TINY, memory_limit=0)


@pytest.mark.parametrize("text, expected", [("16GiB", 16 << 30), ("16G", 16 << 30), ("16GB", 16 * 10**9),
                                            ("500MiB", 500 << 20), ("1e9", 10**9), ("1048576", 1 << 20)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "16 GiBs", "-3GiB", "0", "lots"])
def test_a_bad_size_is_a_usage_error(text):
    with pytest.raises(UsageError, match="--oracle-memory"):
        parse_size(text)


def test_compare_reports_the_streamed_oracle(tmp_path, capsys):
    """Streamed under a cap, resident without: both reports say which ran, and every scenario's baseline_digest (the
    oracle's numbers) and budget are the same: what a user compares on a GPU (docs/scale.md)."""
    documents = {}
    for name, cap in (("streamed", ["--oracle-memory", "1MiB"]), ("resident", [])):
        out = tmp_path / name
        code = main(["compare", "--engine", "reference", "--dtype", "float32", "--checkpoint", str(TINY),
                     "--scenarios", "batching-alone,chunked_prefill-budget17-Q16", *cap, "--out", str(out)])
        captured = capsys.readouterr()
        assert code == 0, captured.out
        assert ("oracle: float64 layer-streamed under --oracle-memory" in captured.err) == (name == "streamed")
        documents[name] = json.loads((out / "report.json").read_text())
    oracle = documents["streamed"]["oracle"]
    assert oracle["memory_limit_bytes"] == 1 << 20
    assert {m["weights"] for m in oracle["models"]} == {"streamed"}
    assert {m["weights"] for m in documents["resident"]["oracle"]["models"]} == {"resident"}
    numbers = {name: [(s["scenario"], s["baseline_digest"], s["budget"], s["reference_error"])
                      for s in doc["scenarios"]] for name, doc in documents.items()}
    assert len(numbers["streamed"]) == 2 and numbers["streamed"] == numbers["resident"]


def test_the_baseline_digest_sees_one_bit():
    cfg = ModelConfig.from_json(TINY / "config.json")
    oracle = Oracle(TINY)
    try:
        results = oracle.results(_requests(cfg))
    finally:
        oracle.close()
    digest = results_digest(results)
    assert results_digest([replace(r) for r in results]) == digest
    nudged = results[2].prompt_logprobs.clone()
    nudged.view(torch.int64)[7] ^= 1                                  # the last bit of one logprob
    assert results_digest([*results[:2], replace(results[2], prompt_logprobs=nudged)]) != digest
    assert results_digest([*results[:2], replace(results[2], output_ids=[*results[2].output_ids[:-1], 0])]) != digest
    assert results_digest(results[::-1]) != digest
