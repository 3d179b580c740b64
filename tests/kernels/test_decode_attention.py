"""decode_attention against its twin decode_attention_ref: every element of every row, contexts at every edge (a
padding row, one key, block, tile and split boundaries ±1, the full table width), grouped heads (1, 2, 4 query
heads a kv head), block sizes 1, 3 and 16, head dims of every model config, table entries past each context naming
NaN blocks and ids outside the cache (never read), a strided q and strided caches, int32 and int64 tables, the
output and the split partials starting as NaN (every element written, no partial read that its split did not
write), every bad input named. On the GPU (marked gpu): Bamba-9B's shapes in bf16, fp16 and fp32 at batch 1, 8 and
256, and one CUDA graph replayed for new contexts without recapture."""

from __future__ import annotations

import pytest
import torch

from reference.ops import decode_attention_ref
from tests.kernels.common import DEVICE, assert_three_way, gpu, needs_gpu
from vendored.ops import decode_attention as module
from vendored.ops._host import cdiv
from vendored.ops.decode_attention import decode_attention

K = 2.0
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-4}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]
NAN = float("nan")


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """The output and the partials start as NaN: an element the kernels forget to write, or a partial the combine
    reads that no split wrote, fails the comparison."""
    monkeypatch.setattr(module, "_empty", lambda shape, dtype, device: torch.full(shape, NAN, dtype=dtype,
                                                                                  device=device))


def make_case(lens: list[int], *, n_q_heads: int, n_kv_heads: int, head_dim: int, block_size: int, width: int,
              dtype: torch.dtype = torch.float32, table_dtype: torch.dtype = torch.int64, seed: int = 0,
              q_gain: float = 2.0, spare_blocks: int = 3):
    """Inputs of one call, on DEVICE: each row owns ceil(n / block_size) shuffled blocks of the cache and its keys
    and values fill the first n positions of them; everything else in the cache is NaN (spare blocks, the rest of a
    row's last block). Table entries past a row's blocks alternate between spare blocks (NaN), ids past the cache
    and negative ids. q is the first n_q_heads heads of a merged q/k/v output (a strided view, as the engine passes
    it), scaled by q_gain so that the softmax is not flat."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.Generator(device=DEVICE).manual_seed(seed)           # the keys and values drawn where they live
    owned = [cdiv(n, block_size) for n in lens]
    num_blocks = sum(owned) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.full((num_blocks * block_size, n_kv_heads, head_dim), NAN, device=DEVICE)
    v_cache = k_cache.clone()
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    too_large = 2 ** 31 - 1 if table_dtype == torch.int32 else 2 ** 40
    for row, n in enumerate(lens):
        blocks = [order.pop() for _ in range(owned[row])]
        positions = torch.arange(n)
        slots = torch.tensor(blocks, dtype=torch.int64)[positions // block_size] * block_size + positions % block_size
        slots = slots.to(DEVICE)
        k_cache[slots] = torch.randn(n, n_kv_heads, head_dim, generator=values, device=DEVICE)
        v_cache[slots] = torch.randn(n, n_kv_heads, head_dim, generator=values, device=DEVICE)
        stale = [order[j % len(order)] if j % 3 == 0 else (num_blocks + j if j % 3 == 1 else -1 - j)
                 for j in range(width - len(blocks))]
        stale = [too_large if j == 1 else s for j, s in enumerate(stale)]
        tables[row] = torch.tensor(blocks + stale, dtype=torch.int64)
    qkv = torch.randn(len(lens), n_q_heads + 2 * n_kv_heads, head_dim, generator=gen) * q_gain
    q = qkv.to(DEVICE, dtype)[:, :n_q_heads]
    return (q, k_cache.to(dtype), v_cache.to(dtype), tables.to(DEVICE, table_dtype),
            torch.tensor(lens, device=DEVICE))


def check(q, k_cache, v_cache, tables, lens, *, block_size: int, name: str = "out") -> torch.Tensor:
    """The kernel against the twin in fp64 and in q's dtype, every element; padding rows exactly zero."""
    scale = q.shape[2] ** -0.5
    out = decode_attention(q, k_cache, v_cache, tables, lens, block_size=block_size, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    ref64 = decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, lens,
                                 block_size=block_size, scale=scale)
    ref_low = decode_attention_ref(q, k_cache, v_cache, tables, lens, block_size=block_size, scale=scale)
    assert_three_way(name, out, ref64, ref_low, k=K, atol=ATOL[q.dtype])
    padding = lens <= 0
    assert bool((out[padding] == 0).all()), "a padding row is not exactly zero"
    return out


def edge_contexts(block_size: int, width: int, block_n: int, keys_per_split: int) -> list[int]:
    """0, 1, block edges, tile edges ±1, split edges ±1, a context over several splits, the full table width."""
    full = width * block_size
    wanted = [0, 1, block_size, 2 * block_size, block_n - 1, block_n, block_n + 1, keys_per_split - 1,
              keys_per_split, keys_per_split + 1, 2 * keys_per_split + 5, full]
    return sorted({n for n in wanted if n <= full})


@pytest.mark.parametrize("n_q_heads, n_kv_heads, block_size, width", [
    (2, 2, 16, 6), (4, 2, 3, 32), (4, 1, 1, 96), (8, 2, 16, 6),
], ids=["group1-block16", "group2-block3", "group4-block1", "group4-block16"])
def test_contexts_at_every_edge(n_q_heads, n_kv_heads, block_size, width):
    """Each context of edge_contexts as a row of one call: tiles, splits and the combine all cross their edges."""
    guess = module._launch(12, n_kv_heads, width * block_size, torch.device(DEVICE))
    lens = edge_contexts(block_size, width, guess.block_n, guess.keys_per_split)
    launch = module._launch(len(lens), n_kv_heads, width * block_size, torch.device(DEVICE))
    assert launch == guess, f"the edges were taken from {guess}, the call launches {launch}"
    if DEVICE == "cpu":       # what the interpreter's launch must give for this test to cover what it says
        assert launch.splits >= 3 and launch.keys_per_split >= 2 * launch.block_n, launch
    case = make_case(lens, n_q_heads=n_q_heads, n_kv_heads=n_kv_heads, head_dim=32, block_size=block_size,
                     width=width, seed=block_size)
    check(*case, block_size=block_size)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=[gpu, needs_gpu])],
                         ids=["fp32", "bf16"])
def test_batch_invariant_rows_do_not_depend_on_the_batch_or_the_table_width(dtype):
    """batch_invariant=True: every row of a call the same bits as that row alone, as that row beside others in
    another order, and with a table twice as wide (more, dead, splits in the default launch); still the twin's
    values, every element. The default launch splits by the batch size: on the CPU the same rows alone and
    together take different splits there (checked), which is what the flag removes."""
    width, block_size = 12, 16
    lens = [0, 1, 17, 40, 95, 150, width * block_size]
    q, k_cache, v_cache, tables, ctx = make_case(lens, n_q_heads=4, n_kv_heads=2, head_dim=32, block_size=block_size,
                                                 width=width, dtype=dtype, seed=7)
    scale = 32 ** -0.5

    def call(rows, table_width=width):
        wide = torch.cat([tables[rows], tables[rows][:, :1].expand(-1, table_width - width)], 1)
        return decode_attention(q[rows], k_cache, v_cache, wide, ctx[rows], block_size=block_size, scale=scale,
                                batch_invariant=True)

    every = list(range(len(lens)))
    together = call(every)
    ref64 = decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, ctx,
                                 block_size=block_size, scale=scale)
    ref_low = decode_attention_ref(q, k_cache, v_cache, tables, ctx, block_size=block_size, scale=scale)
    assert_three_way("batch-invariant out", together, ref64, ref_low, k=K, atol=ATOL[dtype])
    shuffled = every[::-1]
    for row in every:
        assert torch.equal(call([row])[0], together[row]), f"row {row} alone"
    assert torch.equal(call(shuffled), together[shuffled]), "rows in another order"
    assert torch.equal(call(every, 2 * width), together), "a table twice as wide"
    if DEVICE == "cpu":   # the GPU's default launch takes one split for these few keys either way
        device = torch.device(DEVICE)
        assert module._launch(1, 2, width * block_size, device).splits != module._launch(
            len(lens), 2, width * block_size, device).splits


@pytest.mark.parametrize("head_dim", [8, 16, 32, 48, 64, 128])
def test_head_dims(head_dim):
    """The head dims of the repository's configs: 8 (tests/helpers.py), 16, 32, 48 (not a power of two: masked),
    64 and Bamba-9B's 128."""
    case = make_case([0, 5, 40], n_q_heads=2, n_kv_heads=1, head_dim=head_dim, block_size=16, width=3, seed=head_dim)
    check(*case, block_size=16)


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=DTYPE_IDS[1:])
def test_16bit_inputs(dtype):
    """bf16 and fp16 caches and queries: fp32 inside, one rounding at the end."""
    case = make_case([3, 0, 47, 33], n_q_heads=4, n_kv_heads=2, head_dim=32, block_size=16, width=3, dtype=dtype)
    check(*case, block_size=16)


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_stale_table_entries_are_never_read(table_dtype):
    """Entries past each context name NaN blocks, ids past the cache (2^31 - 1 in an int32 table) and negative
    ids, and the rest of each row's last block is NaN: every output is finite and equals the twin's (which never
    looks at them); int32 context lengths too."""
    q, k_cache, v_cache, tables, lens = make_case([5, 17, 0, 40, 2], n_q_heads=4, n_kv_heads=2, head_dim=16,
                                                  block_size=8, width=7, table_dtype=table_dtype, seed=3)
    lens = lens.to(table_dtype)
    out = check(q, k_cache, v_cache, tables, lens, block_size=8)
    assert torch.isfinite(out).all()


def test_large_scores():
    """Scores in the hundreds (q scaled by 40), where exp without the running max overflows fp32: the online
    softmax and the combine's rescaling of each split's partials keep it finite and exact."""
    case = make_case([70, 33, 96], n_q_heads=4, n_kv_heads=1, head_dim=32, block_size=16, width=6, q_gain=40.0,
                     seed=5)
    out = check(*case, block_size=16)
    assert torch.isfinite(out).all()


def test_strided_q_and_caches():
    """q a view of a merged q/k/v output, the caches two views of one (slots, 2, Hkv, Dh) tensor (non-unit strides
    everywhere but along head_dim), the table a column slice."""
    q, k_cache, v_cache, tables, lens = make_case([9, 0, 50], n_q_heads=4, n_kv_heads=2, head_dim=32,
                                                  block_size=16, width=4, seed=7)
    assert not q.is_contiguous()
    kv = torch.stack([k_cache, v_cache], dim=1)                               # (slots, 2, Hkv, Dh)
    wide = torch.full((tables.shape[0], 2 * tables.shape[1]), -7, dtype=tables.dtype, device=DEVICE)
    wide[:, ::2] = tables
    check(q, kv[:, 0], kv[:, 1], wide[:, ::2], lens, block_size=16)


def test_one_split_is_one_launch(monkeypatch):
    """A table of 32 keys: one split (the interpreter's launch), whose programs write the output themselves; the
    combine kernel is never launched."""
    launch = module._launch(3, 2, 32, torch.device(DEVICE))
    assert launch.splits == 1, launch

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the combine kernel was launched for a single split")

    monkeypatch.setattr(module, "_decode_combine_kernel", NoLaunch())
    case = make_case([0, 1, 32], n_q_heads=4, n_kv_heads=2, head_dim=32, block_size=16, width=2, seed=9)
    check(*case, block_size=16)


def test_contexts_past_the_table_and_negative():
    """A context longer than the table's M·block_size keys attends over those keys only (the table's row is never
    read past its end); a negative context is a padding row. Both as the twin takes them."""
    q, k_cache, v_cache, tables, lens = make_case([48, 0, 48], n_q_heads=2, n_kv_heads=1, head_dim=16,
                                                  block_size=16, width=3, seed=11)
    out = check(q, k_cache, v_cache, tables, torch.tensor([48 + 5, -3, 48], device=DEVICE), block_size=16)
    within = decode_attention(q, k_cache, v_cache, tables, lens, block_size=16, scale=16 ** -0.5)   # 48, 0, 48
    assert torch.equal(out, within), "a context past the table or a negative one is not the table's keys / zeros"


def test_a_key_outside_the_cache_makes_its_row_nan():
    """A table entry inside a context that names a block past the cache: that key is not read and the row is NaN
    (the cache holds no such key), every other row is unaffected."""
    q, k_cache, v_cache, tables, lens = make_case([20, 20, 5], n_q_heads=2, n_kv_heads=1, head_dim=16,
                                                  block_size=8, width=3, seed=13)
    tables[1, 1] = k_cache.shape[0] // 8 + 2                                  # key 8.. of row 1: no such block
    out = decode_attention(q, k_cache, v_cache, tables, lens, block_size=8, scale=0.25)
    assert bool(out[1].isnan().all()), "row 1 read a key outside the cache, or was not made NaN"
    keep = torch.tensor([0, 2], device=DEVICE)
    ref64 = decode_attention_ref(q.double()[keep], k_cache.double(), v_cache.double(), tables[keep], lens[keep],
                                 block_size=8, scale=0.25)
    ref_low = decode_attention_ref(q[keep], k_cache, v_cache, tables[keep], lens[keep], block_size=8, scale=0.25)
    assert_three_way("other rows", out[keep], ref64, ref_low, k=K, atol=ATOL[torch.float32])


def test_no_rows():
    q = torch.zeros(0, 4, 16, device=DEVICE)
    cache = torch.zeros(32, 2, 16, device=DEVICE)
    out = decode_attention(q, cache, cache, torch.zeros(0, 2, dtype=torch.long, device=DEVICE),
                           torch.zeros(0, dtype=torch.long, device=DEVICE), block_size=16, scale=0.25)
    assert out.shape == (0, 4, 16)


def test_launch_choices():
    """The grid depends on B, Hkv and the table's width only. GPU: 32-key tiles; at small batch enough splits for
    about two programs an SM of 132, none under 256 keys; at batch 256 one split (no combine). Every choice: splits
    of whole tiles that cover the table, none of them empty."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for rows, kv_heads, width_keys, device in [(1, 8, 4096, cuda), (8, 8, 4096, cuda), (256, 8, 4096, cuda),
                                               (1, 8, 65536, cuda), (1, 8, 16, cuda), (8, 8, 300, cuda),
                                               (3, 2, 96, cpu), (1, 1, 1000, cpu), (5, 1, 0, cpu)]:
        launch = module._launch(rows, kv_heads, width_keys, device)
        assert launch.keys_per_split % launch.block_n == 0, launch
        assert launch.splits * launch.keys_per_split >= width_keys, launch
        assert launch.splits == 1 or (launch.splits - 1) * launch.keys_per_split < width_keys, launch
    assert module._launch(1, 8, 4096, cuda) == module.DecodeLaunch(32, 256, 16, 4, 1)  # 128 programs, 256 keys each
    assert module._launch(8, 8, 4096, cuda).splits == 5                              # 320 programs
    assert module._launch(256, 8, 4096, cuda).splits == 1
    assert module._launch(1, 8, 65536, cuda).splits == 33                            # 264 programs


@pytest.mark.parametrize("bad, message", [
    (dict(q=torch.zeros(3, 64)), r"q.dim\(\): expected 3"),
    (dict(k_cache=torch.zeros(64, 32)), r"k_cache.dim\(\): expected 3"),
    (dict(v_cache=torch.zeros(4, 16, 2, 16)), r"v_cache.dim\(\): expected 3"),
    (dict(block_tables=torch.zeros(3, dtype=torch.long)), r"block_tables.dim\(\): expected 2"),
    (dict(context_lens=torch.zeros(3, 1, dtype=torch.long)), r"context_lens.dim\(\): expected 1"),
    (dict(q=torch.zeros(3, 4, 16, dtype=torch.float64)), r"q: expected dtype in"),
    (dict(k_cache=torch.zeros(64, 2, 16, dtype=torch.bfloat16)), r"k_cache: expected the dtype of q"),
    (dict(v_cache=torch.zeros(64, 2, 16, dtype=torch.float16)), r"v_cache: expected the dtype of q"),
    (dict(block_tables=torch.zeros(3, 4)), r"block_tables: expected dtype torch.int32 or torch.int64"),
    (dict(context_lens=torch.zeros(3, dtype=torch.int16)), r"context_lens: expected dtype torch.int32 or"),
    (dict(k_cache=torch.zeros(64, 2, 8)), r"k_cache.shape\[2\]: expected the head_dim of q, 16, got 8"),
    (dict(v_cache=torch.zeros(64, 1, 16)), r"v_cache.shape: expected the shape of k_cache"),
    (dict(q=torch.zeros(3, 4, 512), k_cache=torch.zeros(64, 2, 512), v_cache=torch.zeros(64, 2, 512)),
     r"q.shape\[2\] \(head_dim\): expected 1..256, got 512"),
    (dict(k_cache=torch.zeros(64, 3, 16), v_cache=torch.zeros(64, 3, 16)),
     r"k_cache.shape\[1\] \(kv heads\): expected a count dividing the q heads, 4, got 3"),
    (dict(block_tables=torch.zeros(2, 4, dtype=torch.long)), r"block_tables.shape\[0\]: expected the rows of q"),
    (dict(context_lens=torch.zeros(4, dtype=torch.long)), r"context_lens.shape: expected \(rows of q,\) = \(3,\)"),
    (dict(block_size=0), r"block_size: expected a positive int, got 0"),
    (dict(block_size=16.0), r"block_size: expected a positive int, got 16.0"),
    (dict(block_size=True), r"block_size: expected a positive int, got True"),
    (dict(block_size=5), r"k_cache.shape\[0\]: expected whole blocks, a multiple of block_size = 5, got 64"),
    (dict(scale=float("nan")), r"scale: expected a finite number, got nan"),
    (dict(scale=torch.tensor(0.5)), r"scale: expected a finite number"),
    (dict(q=[[0.0]]), r"q: expected a torch.Tensor, got list"),
], ids=["q-2d", "k-2d", "v-4d", "table-1d", "lens-2d", "fp64", "k-dtype", "v-dtype", "float-table", "int16-lens",
        "head-dim", "v-shape", "head-dim-512", "kv-heads", "table-rows", "lens-rows", "block-0", "block-float",
        "block-bool", "partial-block", "scale-nan", "scale-tensor", "q-list"])
def test_rejects_bad_input(bad, message):
    args = dict(q=torch.zeros(3, 4, 16), k_cache=torch.zeros(64, 2, 16), v_cache=torch.zeros(64, 2, 16),
                block_tables=torch.zeros(3, 4, dtype=torch.long), context_lens=torch.zeros(3, dtype=torch.long),
                block_size=16, scale=0.25)
    args.update(bad)
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) and k != "scale" else v for k, v in args.items()}
    with pytest.raises((ValueError, TypeError), match=message):
        decode_attention(args["q"], args["k_cache"], args["v_cache"], args["block_tables"], args["context_lens"],
                         block_size=args["block_size"], scale=args["scale"])


def test_rejects_inputs_on_another_device():
    if DEVICE == "cpu":
        cache = torch.zeros(64, 2, 16, device="meta")
        message = r"k_cache.device: expected the device of q, cpu, got meta"
    else:
        cache = torch.zeros(64, 2, 16)
        message = r"k_cache.device: expected the device of q, cuda"
    with pytest.raises(ValueError, match=message):
        decode_attention(torch.zeros(3, 4, 16, device=DEVICE), cache, torch.zeros(64, 2, 16, device=DEVICE),
                         torch.zeros(3, 4, dtype=torch.long, device=DEVICE),
                         torch.zeros(3, dtype=torch.long, device=DEVICE), block_size=16, scale=0.25)


# ---- GPU: Bamba-9B's shapes (32 q heads, 8 kv heads of 128, blocks of 16) ------------------------------------------

BAMBA = dict(n_q_heads=32, n_kv_heads=8, head_dim=128, block_size=16)


def bamba_contexts(rows: int, width: int, seed: int) -> list[int]:
    """A padding row, the edges of a 16-key block, of the GPU's 32-key tile and of a 256-key split, the full width,
    the rest random."""
    edges = [0, 1, 15, 16, 17, 31, 32, 33, 255, 256, 257, 1000, width * 16]
    gen = torch.Generator().manual_seed(seed)
    rest = torch.randint(1, width * 16 + 1, (rows,), generator=gen).tolist()
    return (edges + rest)[:rows] if rows >= len(edges) else [width * 16 - 3, 0, 65, 1000, 1, 257, 16, 64][:rows]


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows", [1, 8, pytest.param(256, marks=pytest.mark.xdist_group("large-gpu-memory"))])
def test_bamba_shapes(rows, dtype):                                    # 256 rows: 10-13 GB reserved (conftest.py)
    """Contexts up to 4096 keys (a table of 256 blocks of 16) at batch 1, 8 and 256: one split at 256 rows, several
    (and the combine) below."""
    width = 256
    lens = bamba_contexts(rows, width, seed=rows)
    case = make_case(lens, **BAMBA, width=width, dtype=dtype, seed=rows, q_gain=1.0)
    check(*case, block_size=16)


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_graph_replays_new_contexts(dtype):
    """One capture at batch 8, then replays after the contexts and tables change in place (one split live, several,
    padding rows, the full width): each replay equals an eager call on the same inputs bit for bit, and the twin
    within the three-way bound."""
    width, rows = 128, 8
    schedules = [[1, 0, 17, 64, 65, 300, 2048, 5], [2048, 2048, 0, 0, 1, 1, 700, 129],
                 [3, 900, 64, 1, 0, 2000, 16, 1500]]
    cases = [make_case(lens, **BAMBA, width=width, dtype=dtype, seed=i, q_gain=1.0, spare_blocks=130)
             for i, lens in enumerate(schedules)]
    # one cache big enough for every schedule: each case's own cache, padded to the largest
    n_slots = max(c[1].shape[0] for c in cases)

    def padded(t):
        return torch.cat([t, torch.full((n_slots - t.shape[0], *t.shape[1:]), NAN, dtype=t.dtype, device=t.device)])

    q_buf, k_buf, v_buf = cases[0][0].clone(), padded(cases[0][1]), padded(cases[0][2])
    tables_buf, lens_buf = cases[0][3].clone(), cases[0][4].clone()
    call = dict(block_size=16, scale=128 ** -0.5)
    decode_attention(q_buf, k_buf, v_buf, tables_buf, lens_buf, **call)                 # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_buf = decode_attention(q_buf, k_buf, v_buf, tables_buf, lens_buf, **call)
    for i, (q, k_cache, v_cache, tables, lens) in enumerate(cases):
        q_buf.copy_(q)
        k_buf.copy_(padded(k_cache))
        v_buf.copy_(padded(v_cache))
        tables_buf.copy_(tables)
        lens_buf.copy_(lens)
        graph.replay()
        replayed = out_buf.clone()
        eager = check(q_buf, k_buf, v_buf, tables_buf, lens_buf, block_size=16, name=f"schedule {i}")
        assert torch.equal(replayed, eager), f"schedule {i}: the replay differs from an eager call"
