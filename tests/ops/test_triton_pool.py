"""Triton segment pooling vs the float64 references of `dice_fast.ops.spec`.

On machines without a GPU the kernels run in the Triton interpreter (conftest sets
TRITON_INTERPRET=1), which is slow: sizes here are small, and the multi-piece paths (chunks longer
than one piece, tile programs, the finalize kernel) are also driven with a tiny `LaunchConfig` so
that they are reached with few rows. Tests marked ``gpu`` need CUDA.

Tolerances: the reference reads the *same* (possibly bf16 / fp16) input and computes in float64,
so the only error left is the kernels' float32 accumulation: every dtype is held to the float32
tolerance. `test_pool_bf16_input_rounding` separately checks a low-precision input against the
float32-input reference with the per-dtype `TOLERANCES` (that error is the input's rounding).
"""

from __future__ import annotations

import pytest
import torch

from dice_fast.ops import triton_pool as tp
from dice_fast.ops.spec import AGGREGATIONS, POOLINGS, aggregate_documents_ref, pool_chunks_ref
import pool_data
from helpers import TOLERANCES, assert_close

# whether `available()` tells the truth is tested in test_dispatch.py, where nothing is skipped
pytestmark = pytest.mark.skipif(not tp.available(), reason="triton unavailable (needs CUDA or TRITON_INTERPRET=1)")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32_TOL = TOLERANCES[torch.float32]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
AGGS = AGGREGATIONS
# a tiny configuration: pieces of 8 rows, 4 rows per step, 16 columns per program
TINY = tp.LaunchConfig(block_h=16, block_r=4, num_warps=1, piece=8)


_gen, _cu, _hidden, _lengths = pool_data.gen, pool_data.cu, pool_data.hidden, pool_data.lengths


@pytest.fixture(autouse=True)
def _helpers_build_on_the_test_device(monkeypatch):
    """The helpers' tensors land on ``DEVICE``: on a GPU machine (no interpreter) the kernels refuse
    CPU tensors, so every test of this module ran there only through its ``gpu``-marked ones."""
    monkeypatch.setattr(pool_data, "DEFAULT_DEVICE", DEVICE)


# --------------------------------------------------------------------------------------------
# token -> chunk
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("H", [1, 100, 384, 1000])
@pytest.mark.parametrize("pooling", POOLINGS)
def test_pool_chunks_matches_ref(dtype, H, pooling):
    # random lengths incl. 1-token chunks and one chunk longer than a piece (300 > 256 tokens)
    lens = _lengths(12, 20, seed=H, extra=[300, 1, 3])
    cu = _cu(lens)
    hidden = _hidden(sum(lens), H, dtype, seed=H + 1)
    out = tp.pool_chunks_triton(hidden, cu, pooling)
    assert out.dtype == torch.float32 and out.shape == (len(lens), H)
    assert_close(out, pool_chunks_ref(hidden, cu, pooling), *F32_TOL, what=f"{pooling} {dtype} H={H}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("H", [1, 17])
def test_pool_multi_piece_tiny_config(dtype, H):
    """Many chunks spanning several pieces, tile programs that find no piece, 1-token chunks."""
    lens = _lengths(20, 30, seed=7 + H, extra=[8, 9, 16, 17, 1, 64])
    cu = _cu(lens)
    hidden = _hidden(sum(lens), H, dtype, seed=8)
    out = tp._pool_chunks_launch(hidden, cu, "mean", cfg=TINY)
    assert_close(out, pool_chunks_ref(hidden, cu, "mean"), *F32_TOL, what=f"tiny-config mean {dtype}")


@pytest.mark.parametrize("H", [3584, 4096, 8192])
def test_pool_large_hidden(H):
    lens = [1, 5, 2]
    cu = _cu(lens)
    hidden = _hidden(sum(lens), H, torch.bfloat16, seed=H)
    for pooling in POOLINGS:
        assert_close(tp.pool_chunks_triton(hidden, cu, pooling), pool_chunks_ref(hidden, cu, pooling), *F32_TOL)


def test_pool_long_chunk_among_short_ones():
    """An 8192-token chunk between 1-token chunks: spread over 32 pieces of 256 tokens."""
    lens = [1, 8192, 1, 2, 1]
    cu = _cu(lens)
    hidden = _hidden(sum(lens), 4, torch.bfloat16, seed=3)
    assert_close(tp.pool_chunks_triton(hidden, cu, "mean"), pool_chunks_ref(hidden, cu, "mean"), *F32_TOL)


def test_pool_many_chunks():
    lens = _lengths(300, 3, seed=11)
    cu = _cu(lens)
    hidden = _hidden(sum(lens), 8, torch.float32, seed=12)
    for pooling in POOLINGS:
        assert_close(tp.pool_chunks_triton(hidden, cu, pooling), pool_chunks_ref(hidden, cu, pooling), *F32_TOL)


@pytest.mark.parametrize("total", [0, 5])
def test_pool_no_chunks(total):
    hidden = _hidden(total, 16, torch.bfloat16, seed=0)
    cu = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for pooling in POOLINGS:
        out = tp.pool_chunks_triton(hidden, cu, pooling)
        assert out.shape == (0, 16) and out.dtype == torch.float32


def test_pool_ignores_rows_after_last_chunk():
    lens = [3, 1, 4]
    cu = _cu(lens)
    hidden = _hidden(sum(lens) + 300, 24, torch.float32, seed=1)  # trailing padding rows
    for pooling in POOLINGS:
        assert_close(tp.pool_chunks_triton(hidden, cu, pooling), pool_chunks_ref(hidden, cu, pooling), *F32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[-1])
def test_pool_bf16_input_rounding(dtype):
    """Low-precision input vs the float32-input reference: within the dtype's tolerance."""
    lens = _lengths(10, 30, seed=5)
    cu = _cu(lens)
    h32 = _hidden(sum(lens), 64, torch.float32, seed=6)
    out = tp.pool_chunks_triton(h32.to(dtype), cu, "mean")
    assert_close(out, pool_chunks_ref(h32, cu, "mean"), *TOLERANCES[dtype], what=str(dtype))


@pytest.mark.parametrize("cfg", [None, TINY], ids=["default", "tiny"])
def test_documents_split_across_batches(cfg):
    """Pooling two halves of a token stream separately gives the same chunk vectors, bit for bit
    (pieces are placed relative to each chunk's start, so packing offsets do not matter)."""
    long = [300, 2, 270, 1] if cfg is None else [30, 2, 27, 1]  # longer than a piece
    lens = _lengths(20, 12, seed=21, extra=long)
    cu = _cu(lens, torch.int64).cpu()
    hidden = _hidden(int(cu[-1]), 16, torch.bfloat16, seed=22)
    full = tp._pool_chunks_launch(hidden, cu.to(torch.int32).to(DEVICE), "mean", cfg=cfg)
    for k in (1, 11, len(lens) - 1):  # split after chunk k
        cut = int(cu[k])
        a = tp._pool_chunks_launch(hidden[:cut].clone(), cu[: k + 1].to(torch.int32).to(DEVICE), "mean", cfg=cfg)
        b_cu = (cu[k:] - cut).to(torch.int32).to(DEVICE)
        b = tp._pool_chunks_launch(hidden[cut:].clone(), b_cu, "mean", cfg=cfg)
        assert torch.equal(torch.cat([a, b]), full), f"split after chunk {k}"


def test_pool_deterministic_and_strided_rows():
    lens = _lengths(15, 40, seed=31, extra=[520])
    cu = _cu(lens)
    wide = _hidden(sum(lens), 96, torch.float32, seed=32)
    hidden = wide[:, 16:80]  # rows 96 apart, columns contiguous: used without a copy
    ref = pool_chunks_ref(hidden, cu, "mean")
    a = tp.pool_chunks_triton(hidden, cu, "mean")
    assert torch.equal(a, tp.pool_chunks_triton(hidden, cu, "mean"))
    assert_close(a, ref, *F32_TOL)
    # non-unit column stride: copied to contiguous first
    t = hidden.t().contiguous().t()
    assert_close(tp.pool_chunks_triton(t, cu, "mean"), ref, *F32_TOL)


# --------------------------------------------------------------------------------------------
# chunk -> document
# --------------------------------------------------------------------------------------------
def _docs(doc_lens, H: int, seed: int):
    g = _gen(seed)
    n = sum(doc_lens)
    # norms vary from chunk to chunk (the salience signal of topk_norm / softmax_norm)
    chunks = torch.randn(n, H, generator=g) * (0.2 + 2.0 * torch.rand(n, 1, generator=g))
    weights = torch.rand(n, generator=g) * 10.0
    cu = _cu(doc_lens, torch.int64)
    return chunks.to(DEVICE), cu, weights.to(DEVICE)


def _agg_both(chunks, cu, weights, agg, top_k=3, temperature=0.7, nc=False, nz=True, cfg=None):
    args = (chunks, cu, weights, agg, top_k, temperature, nc, nz)
    if cfg is None:
        out = tp.aggregate_documents_triton(*args)
    else:
        out = tp._aggregate_launch(*args, cfg=cfg)
    return out, aggregate_documents_ref(*args)


# one document of 300 chunks (several pieces of 64 and of 128 chunks), 1-chunk documents
DOC_LENS = [1, 4, 300, 1, 7, 2, 70]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("nc", [False, True], ids=["raw", "normchunks"])
@pytest.mark.parametrize("nz", [False, True], ids=["nonorm", "norm"])
def test_aggregate_matches_ref(agg, nc, nz):
    chunks, cu, w = _docs(DOC_LENS, 100, seed=41)
    out, ref = _agg_both(chunks, cu, w, agg, nc=nc, nz=nz)
    assert out.shape == (len(DOC_LENS), 100) and out.dtype == torch.float32
    assert_close(out, ref, *F32_TOL, what=f"{agg} nc={nc} nz={nz}")


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("H", [1, 384, 1000])
def test_aggregate_hidden_sizes(agg, H):
    chunks, cu, w = _docs([1, 3, 9, 1], H, seed=H)
    out, ref = _agg_both(chunks, cu, w, agg, top_k=2, nz=H > 1)
    assert_close(out, ref, *F32_TOL, what=f"{agg} H={H}")


@pytest.mark.parametrize("agg", AGGS)
def test_aggregate_multi_piece_tiny_config(agg):
    chunks, cu, w = _docs([1, 8, 9, 30, 2, 17], 37, seed=51)
    for nc in (False, True):
        out, ref = _agg_both(chunks, cu, w, agg, top_k=5, nc=nc, cfg=TINY)
        assert_close(out, ref, *F32_TOL, what=f"tiny-config {agg} nc={nc}")


@pytest.mark.parametrize("top_k", [1, 2, 7, 1000])
def test_topk_sizes(top_k):
    chunks, cu, w = _docs([1, 3, 7, 150], 24, seed=61)
    for nz in (False, True):
        out, ref = _agg_both(chunks, cu, w, "topk_norm", top_k=top_k, nz=nz)
        assert_close(out, ref, *F32_TOL, what=f"top_k={top_k}")


def test_topk_ties_go_to_earlier_chunk():
    # integer vectors: exact float32 norms, so equal norms are exact ties
    base = torch.tensor([[3.0, 4.0, 0.0], [0.0, 3.0, 4.0], [4.0, 0.0, 3.0], [1.0, 1.0, 1.0], [0.0, 0.0, 5.0]])
    chunks = base.to(DEVICE)
    cu = _cu([5], torch.int64)
    for k in (1, 2, 3, 4):
        out, ref = _agg_both(chunks, cu, None, "topk_norm", top_k=k, nz=False)
        assert_close(out, ref, *F32_TOL, what=f"ties k={k}")
        picked = [0, 1, 2, 4][:k]  # norm 5 for chunks 0, 1, 2, 4 (in order), sqrt(3) for chunk 3
        assert_close(out[0], base[picked].mean(0), *F32_TOL, what=f"ties k={k} explicit")


@pytest.mark.parametrize("temperature", [0.05, 1.0, 25.0])
def test_softmax_temperatures(temperature):
    chunks, cu, w = _docs([1, 5, 40], 16, seed=71)
    for nc in (False, True):
        out, ref = _agg_both(chunks, cu, w, "softmax_norm", temperature=temperature, nc=nc)
        assert_close(out, ref, *F32_TOL, what=f"T={temperature} nc={nc}")


def test_aggregate_many_documents_and_zero_rows():
    chunks, cu, w = _docs(_lengths(40, 3, seed=81), 8, seed=82)
    chunks[5] = 0.0  # a zero chunk: normalize_chunks divides by eps, its norm is 0
    for agg in AGGS:
        out, ref = _agg_both(chunks, cu, w, agg, nc=True)
        assert_close(out, ref, *F32_TOL, what=agg)


def test_aggregate_empty():
    H = 12
    none = torch.zeros(0, H, device=DEVICE)
    cu0 = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    assert tp.aggregate_documents_triton(none, cu0).shape == (0, H)
    chunks, cu, w = _docs([2, 1], H, seed=1)
    out = tp.aggregate_documents_triton(chunks, cu[:1], None, "mean")
    assert out.shape == (0, H)


def test_segment_pool_end_to_end_matches_ref():
    lens = _lengths(30, 20, seed=91, extra=[280])
    cu = _cu(lens)
    hidden = _hidden(sum(lens), 48, torch.bfloat16, seed=92)
    cu_doc = _cu([1, 10, 19, 1], torch.int64)
    weights = (cu[1:] - cu[:-1]).to(torch.float32)
    from dice_fast.ops import segment_pool

    for pooling, agg in [("mean", "mean"), ("cls", "topk_norm"), ("last", "weighted_mean"), ("mean", "max")]:
        c_t, d_t = segment_pool(hidden, cu, cu_doc, weights, pooling, agg, top_k=4, impl="triton")
        c_r = pool_chunks_ref(hidden, cu, pooling)
        d_r = aggregate_documents_ref(c_r, cu_doc, weights, agg, 4)
        assert_close(c_t, c_r, *F32_TOL, what=f"chunks {pooling}")
        assert_close(d_t, d_r, *F32_TOL, what=f"docs {pooling}/{agg}")


# --------------------------------------------------------------------------------------------
# validation, registered ops, fake implementations
# --------------------------------------------------------------------------------------------
def test_validation_errors():
    hidden = _hidden(6, 8, torch.float32, seed=0)
    cu = _cu([2, 4])
    with pytest.raises(ValueError, match="int32"):
        tp.pool_chunks_triton(hidden, cu.to(torch.int64), "mean")
    with pytest.raises(ValueError, match="2-D"):
        tp.pool_chunks_triton(hidden.view(2, 3, 8), cu, "mean")
    with pytest.raises(ValueError, match="unknown pooling"):
        tp.pool_chunks_triton(hidden, cu, "max")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        tp.pool_chunks_triton(hidden.to(torch.float64), cu, "mean")
    # the registered op validates too (its launcher uses the same checks)
    with pytest.raises(ValueError, match="unknown pooling"):
        torch.ops.dice_fast.pool_chunks_triton(hidden, cu, "sum")

    chunks, cu_doc, w = _docs([2, 3], 8, seed=0)
    with pytest.raises(ValueError, match="unknown aggregation"):
        tp.aggregate_documents_triton(chunks, cu_doc, None, "median")
    with pytest.raises(ValueError, match="int64"):
        tp.aggregate_documents_triton(chunks, cu_doc.to(torch.int32))
    with pytest.raises(ValueError, match="needs chunk_weights"):
        tp.aggregate_documents_triton(chunks, cu_doc, None, "weighted_mean")
    with pytest.raises(ValueError, match="top_k"):
        tp.aggregate_documents_triton(chunks, cu_doc, None, "topk_norm", top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        tp.aggregate_documents_triton(chunks, cu_doc, None, "softmax_norm", temperature=0.0)
    with pytest.raises(ValueError, match="float32"):
        tp.aggregate_documents_triton(chunks.to(torch.bfloat16), cu_doc)


def test_registered_ops_and_dispatcher():
    from dice_fast.ops import aggregate_documents, pool_chunks

    lens = [3, 1, 5]
    cu = _cu(lens)
    hidden = _hidden(9, 20, torch.bfloat16, seed=2)
    via_op = torch.ops.dice_fast.pool_chunks_triton(hidden, cu, "mean")
    assert torch.equal(via_op, tp.pool_chunks_triton(hidden, cu, "mean"))
    assert torch.equal(via_op, pool_chunks(hidden, cu, "mean", impl="triton"))
    cu_doc = _cu([2, 1], torch.int64)
    docs = torch.ops.dice_fast.aggregate_documents_triton(via_op, cu_doc, None, "max", 1, 1.0, False, True)
    assert torch.equal(docs, aggregate_documents(via_op, cu_doc, aggregation="max", impl="triton"))
    assert_close(docs, aggregate_documents_ref(via_op, cu_doc, None, "max"), *F32_TOL)


def test_fake_impls_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        hidden = torch.empty(50, 33, dtype=torch.bfloat16)
        cu = torch.empty(8, dtype=torch.int32)
        out = torch.ops.dice_fast.pool_chunks_triton(hidden, cu, "last")
        assert out.shape == (7, 33) and out.dtype == torch.float32
        cu_doc = torch.empty(4, dtype=torch.int64)
        docs = torch.ops.dice_fast.aggregate_documents_triton(out, cu_doc, None, "topk_norm", 2, 1.0, True, True)
        assert docs.shape == (3, 33) and docs.dtype == torch.float32


def test_opcheck():
    lens = [2, 5, 1]
    cu = _cu(lens)
    hidden = _hidden(8, 16, torch.float32, seed=3)
    torch.library.opcheck(torch.ops.dice_fast.pool_chunks_triton.default, (hidden, cu, "mean"))
    chunks, cu_doc, w = _docs([1, 2], 16, seed=4)
    torch.library.opcheck(
        torch.ops.dice_fast.aggregate_documents_triton.default,
        (chunks, cu_doc, w, "weighted_mean", 1, 1.0, True, True),
    )


def test_torch_compile_traces_through_ops():
    lens = [2, 5, 1]
    cu = _cu(lens)
    cu_doc = _cu([1, 2], torch.int64)
    hidden = _hidden(8, 16, torch.bfloat16, seed=5)

    def fn(h, c, cd):
        chunks = tp.pool_chunks_triton(h, c, "mean")
        return tp.aggregate_documents_triton(chunks * 2.0, cd, None, "softmax_norm", 1, 0.5, False, True)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert_close(compiled(hidden, cu, cu_doc), fn(hidden, cu, cu_doc), *F32_TOL)


# --------------------------------------------------------------------------------------------
# GPU only, each with a CPU rehearsal of the same body
# --------------------------------------------------------------------------------------------
GPU_BATCH_WIDTHS = (384, 4096)
GPU_BATCH_DOCS = [1, 60, 3, 79, 1]  # 144 chunks


def gpu_batch_lengths(H: int) -> list[int]:
    """The GPU test's chunk lengths: 64K tokens, 1..8192 per chunk, 144 chunks."""
    return torch.randint(1, 512, (100,), generator=_gen(H)).tolist() + [8192, 1, 4096, 1] + [512] * 40


def realistic_batch(device, H: int, lens: list[int], doc_lens: list[int], check=assert_close) -> None:
    """All three poolings of bf16 token states (chunks across pieces), then all five aggregations of
    the chunk vectors, against the references (``check(got, want, rtol, atol, what=)``); every
    tensor on ``device``. benchmarks/preflight.py runs it to count the Triton variants it compiles."""
    assert sum(doc_lens) == len(lens)
    cu = _cu(lens, device=device)
    hidden = _hidden(sum(lens), H, torch.bfloat16, seed=H, device=device)
    for pooling in POOLINGS:
        check(tp.pool_chunks_triton(hidden, cu, pooling), pool_chunks_ref(hidden, cu, pooling), *F32_TOL,
              what=f"{pooling} H={H}")
    chunks = tp.pool_chunks_triton(hidden, cu, "mean")
    cu_doc = _cu(doc_lens, torch.int64, device=device)
    weights = torch.rand(len(lens), generator=_gen(H + 1)).to(device)
    for agg in AGGS:
        out, ref = _agg_both(chunks, cu_doc, weights, agg, top_k=5, nc=agg == "max")
        check(out, ref, *F32_TOL, what=f"{agg} H={H}")


@pytest.mark.gpu
@pytest.mark.parametrize("H", GPU_BATCH_WIDTHS)
def test_gpu_realistic_batch(H):
    """A token-budget batch at realistic sizes: 64K tokens, chunk lengths 1..8192."""
    realistic_batch("cuda", H, gpu_batch_lengths(H), GPU_BATCH_DOCS)


def test_realistic_batch_rehearsal():
    """The GPU test's body on the CPU at small sizes (the interpreter is slow), with a forgotten
    ``device`` turned into meta tensors (`pool_data.forgotten_device_is_meta`): a tensor left off the
    test's device fails here as it would on the GPU."""
    lens = _lengths(8, 20, seed=3, extra=[270, 1, 2])  # one chunk longer than a 256-row piece
    with pool_data.forgotten_device_is_meta():
        realistic_batch("cpu", 24, lens, [1, 4, 3, 2, 1])


def test_rehearsal_catches_a_forgotten_device():
    with pool_data.forgotten_device_is_meta(), pytest.raises(ValueError, match="cu_seqlens is on meta"):
        tp.pool_chunks_triton(_hidden(4, 8, torch.bfloat16, seed=0, device="cpu"), _cu([1, 3]), "mean")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_second_device():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device="cuda:1")
    hidden = torch.randn(7, 64, device="cuda:1")
    assert_close(tp.pool_chunks_triton(hidden, cu, "mean"), pool_chunks_ref(hidden, cu, "mean"), *F32_TOL)
