"""Vectorised PyTorch pooling (`dice_fast.ops.torch_pool`, impl "torch") vs the float64 references.

The same grids as the Triton and C++ tests: random chunk lengths including 1, chunks longer than any
block or slab, empty chunks / documents (outside the contract: zeros, like the reference), huge
hidden sizes, batches split anywhere. Runs on the CPU (and on CUDA when there is one: ``gpu``).

Tolerances: the reference reads the *same* (possibly bf16 / fp16) input and computes in float64, so
the only error left is float32 accumulation: every dtype is held to the float32 tolerance;
`test_pool_low_precision_input_rounding` checks a bf16 / fp16 input against the float32-input
reference with the per-dtype `TOLERANCES` (that error is the input's rounding).
"""

from __future__ import annotations

import pytest
import torch

from dice_fast.ops import torch_pool as tpo
from dice_fast.ops.spec import AGGREGATIONS, POOLINGS, aggregate_documents_ref, pool_chunks_ref
import pool_data
from helpers import TOLERANCES, assert_close

F32_TOL = TOLERANCES[torch.float32]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = ("f32", "bf16", "f16")
pool, aggregate = tpo.pool_chunks_torch, tpo.aggregate_documents_torch


_gen, _cu, _hidden, _lengths = pool_data.gen, pool_data.cu, pool_data.hidden, pool_data.lengths


def _docs(doc_lens, H: int, seed: int, device="cpu"):
    g = _gen(seed)
    n = sum(doc_lens)
    # norms vary from chunk to chunk (the salience signal of topk_norm / softmax_norm)
    chunks = torch.randn(n, H, generator=g) * (0.2 + 2.0 * torch.rand(n, 1, generator=g))
    weights = torch.rand(n, generator=g) * 10.0
    return chunks.to(device), _cu(doc_lens, torch.int64, device), weights.to(device)


# --------------------------------------------------------------------------------------------
# token -> chunk
# --------------------------------------------------------------------------------------------
# 1-token chunks, lengths around vector widths, a 130- and a 300-token chunk
LENS = _lengths(24, 40, seed=3, extra=[1, 3, 1, 17, 64, 1, 130, 5, 1, 300, 1])


@pytest.mark.parametrize("H", [1, 7, 100, 384, 1000])
@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pool_chunks_matches_ref(dtype, pooling, H):
    cu = _cu(LENS)
    hidden = _hidden(sum(LENS), H, dtype, seed=H)
    out = pool(hidden, cu, pooling)
    assert out.shape == (len(LENS), H) and out.dtype == torch.float32
    assert_close(out, pool_chunks_ref(hidden, cu, pooling), *F32_TOL, what=f"{pooling} {dtype} H={H}")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=DTYPE_IDS[1:])
def test_pool_low_precision_input_rounding(dtype):
    cu = _cu(LENS)
    hidden = _hidden(sum(LENS), 100, torch.float32, seed=5)
    out = pool(hidden.to(dtype), cu, "mean")
    assert_close(out, pool_chunks_ref(hidden, cu, "mean"), *TOLERANCES[dtype], what=str(dtype))


@pytest.mark.parametrize("H", [3584, 4096, 8192])
def test_pool_large_hidden(H):
    lens = [1, 5, 2, 40]
    cu = _cu(lens)
    hidden = _hidden(sum(lens), H, torch.bfloat16, seed=H)
    for pooling in POOLINGS:
        assert_close(pool(hidden, cu, pooling), pool_chunks_ref(hidden, cu, pooling), *F32_TOL, what=f"{pooling} H={H}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pool_long_chunks_across_slabs(dtype):
    # an 8192-token chunk spans several slabs of low-precision rows widened to float32
    lens = [8192, 1, 300, tpo._slab_rows(200) + 1]
    cu = _cu(lens)
    hidden = _hidden(sum(lens), 200, dtype, seed=7)
    for pooling in POOLINGS:
        assert_close(pool(hidden, cu, pooling), pool_chunks_ref(hidden, cu, pooling), *F32_TOL, what=pooling)


def test_pool_many_one_token_chunks():
    lens = [1] * 3000 + [2, 1]
    cu = _cu(lens)
    hidden = _hidden(sum(lens), 24, torch.bfloat16, seed=8)
    for pooling in POOLINGS:
        out = pool(hidden, cu, pooling)
        assert_close(out, pool_chunks_ref(hidden, cu, pooling), *F32_TOL, what=pooling)
        assert torch.equal(out[:3000], hidden[:3000].float())  # a 1-token chunk is its token, exactly


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pool_split_into_two_batches_gives_same_chunks(dtype):
    # chunks straddle the slab boundary at several offsets; the split moves them to other offsets
    lens = _lengths(60, 90, seed=9, extra=[1, 200, tpo._slab_rows(384) - 3, 700])
    cu = _cu(lens)
    hidden = _hidden(sum(lens), 384, dtype, seed=10)
    whole = pool(hidden, cu, "mean")
    for cut in (1, 3, 17, len(lens) - 1):  # chunks [0, cut) in the first batch, the rest in the second
        t = int(cu[cut])
        first = pool(hidden[:t], _cu(lens[:cut]), "mean")
        second = pool(hidden[t:], _cu(lens[cut:]), "mean")
        # on the CPU a chunk's rows are added in order starting from zero: bit-identical in any batch
        assert torch.equal(torch.cat([first, second]), whole), f"cut after chunk {cut}"


def test_pool_strided_rows_and_trailing_tokens():
    lens = [3, 1, 50, 8]
    cu = _cu(lens)
    base = _hidden(sum(lens) + 5, 300, torch.float32, seed=11)  # 5 trailing rows in no chunk
    hidden = base[:, 10:110]  # row stride 300, unit column stride
    ref = pool_chunks_ref(hidden.contiguous(), cu, "mean")
    assert_close(pool(hidden, cu, "mean"), ref, *F32_TOL, what="row stride")
    t = hidden.contiguous().t().contiguous().t()  # non-unit column stride
    assert_close(pool(t, cu, "mean"), ref, *F32_TOL, what="column stride")
    for pooling in ("cls", "last"):
        assert_close(pool(hidden, cu, pooling), pool_chunks_ref(hidden, cu, pooling), *F32_TOL, what=pooling)


def test_pool_no_chunks_and_empty_chunks():
    cu0 = torch.zeros(1, dtype=torch.int32)
    for rows in (0, 5):
        for pooling in POOLINGS:
            out = pool(torch.randn(rows, 16), cu0, pooling)
            assert out.shape == (0, 16) and out.dtype == torch.float32
    # an empty chunk (outside the contract) pools to zeros, like the reference's mean
    cu = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    hidden = torch.randn(3, 8)
    assert_close(pool(hidden, cu, "mean"), pool_chunks_ref(hidden, cu, "mean"), *F32_TOL)
    for pooling in POOLINGS:
        out = pool(hidden, cu, pooling)
        assert torch.equal(out[1], torch.zeros(8)), pooling
        assert torch.equal(out[[0, 2]], pool_chunks_ref(hidden, cu, pooling)[[0, 2]]), pooling
    # only empty chunks, no token rows
    assert torch.equal(pool(torch.zeros(0, 4), torch.zeros(3, dtype=torch.int32), "last"), torch.zeros(2, 4))


def test_pool_rejects_bad_inputs():
    hidden = torch.randn(10, 4)
    with pytest.raises(ValueError, match="unknown pooling"):
        pool(hidden, _cu([10]), "max")
    with pytest.raises(ValueError, match="int32"):
        pool(hidden, _cu([10], torch.int64), "mean")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        pool(hidden.double(), _cu([10]), "mean")
    with pytest.raises(ValueError, match="2-D"):
        pool(hidden[0], _cu([4]), "mean")


# --------------------------------------------------------------------------------------------
# chunk -> document
# --------------------------------------------------------------------------------------------
DOC_LENS = [1, 4, 1, 9, 2, 30]


@pytest.mark.parametrize("H", [1, 7, 100, 384])
@pytest.mark.parametrize("nz", [False, True], ids=["nonorm", "norm"])
@pytest.mark.parametrize("nc", [False, True], ids=["raw", "normchunks"])
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_aggregate_matches_ref(agg, nc, nz, H):
    chunks, cu, w = _docs(DOC_LENS, H, seed=41 + H)
    args = (chunks, cu, w, agg, 3, 0.7, nc, nz)
    out = aggregate(*args)
    assert out.shape == (len(DOC_LENS), H) and out.dtype == torch.float32
    assert_close(out, aggregate_documents_ref(*args), *F32_TOL, what=f"{agg} nc={nc} nz={nz} H={H}")


@pytest.mark.parametrize("H", [4096, 8192])
def test_aggregate_large_hidden(H):
    chunks, cu, w = _docs([1, 3, 60], H, seed=H)
    for agg in AGGREGATIONS:
        args = (chunks, cu, w, agg, 5, 0.5, agg == "max", True)
        assert_close(aggregate(*args), aggregate_documents_ref(*args), *F32_TOL, what=f"{agg} H={H}")


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_aggregate_300_chunk_document(agg):
    chunks, cu, w = _docs([300, 1, 7], 384, seed=43)
    for nc in (False, True):
        args = (chunks, cu, w, agg, 10, 0.5, nc, True)
        assert_close(aggregate(*args), aggregate_documents_ref(*args), *F32_TOL, what=f"{agg} nc={nc}")


@pytest.mark.parametrize("top_k", [1, 2, 7, 1000])
def test_topk_sizes(top_k):
    chunks, cu, w = _docs([1, 3, 7, 150], 24, seed=61)
    for nz in (False, True):
        args = (chunks, cu, w, "topk_norm", top_k, 1.0, False, nz)
        assert_close(aggregate(*args), aggregate_documents_ref(*args), *F32_TOL, what=f"top_k={top_k}")


def test_topk_more_than_chunks_is_mean():
    chunks, cu, _ = _docs([1, 2, 5], 33, seed=62)
    top = aggregate(chunks, cu, None, "topk_norm", 1000, 1.0, False, False)
    assert_close(top, aggregate(chunks, cu, None, "mean", 1, 1.0, False, False), *F32_TOL)


def test_topk_ties_go_to_earlier_chunk():
    # integer vectors: exact norms, so equal norms are exact ties; -v has v's norm bit for bit
    base = torch.tensor(
        [[3.0, 4.0, 0.0], [0.0, 3.0, 4.0], [1.0, 1.0, 1.0], [-3.0, -4.0, 0.0], [4.0, 0.0, 3.0], [0.0, 0.0, 5.0]]
    )
    # the same document twice, after a 1-chunk document: ranks are taken inside each document
    chunks = torch.cat([base[:1] * 2, base, base])
    cu = _cu([1, 6, 6], torch.int64)
    for k in range(1, 7):
        args = (chunks, cu, None, "topk_norm", k, 1.0, False, False)
        out = aggregate(*args)
        assert_close(out, aggregate_documents_ref(*args), *F32_TOL, what=f"ties k={k}")
        picked = sorted([0, 1, 3, 4, 5, 2][:k])  # norm 5 for chunks 0, 1, 3, 4, 5; sqrt(3) for chunk 2
        for d in (1, 2):
            assert_close(out[d], base[picked].mean(0), *F32_TOL, what=f"ties k={k} document {d}")
    # normalize_chunks: chunks are still ranked by their norms as pooled
    out = aggregate(base, _cu([6], torch.int64), None, "topk_norm", 3, 1.0, True, False)
    picked = base[[0, 1, 3]]
    assert_close(out[0], (picked / picked.norm(dim=1, keepdim=True)).mean(0), *F32_TOL, what="normalized ties")


@pytest.mark.parametrize("temperature", [0.05, 1.0, 25.0])
def test_softmax_temperatures(temperature):
    chunks, cu, w = _docs([1, 5, 40], 16, seed=71)
    for nc in (False, True):
        args = (chunks, cu, w, "softmax_norm", 1, temperature, nc, True)
        assert_close(aggregate(*args), aggregate_documents_ref(*args), *F32_TOL, what=f"T={temperature} nc={nc}")


def test_aggregate_zero_chunk_and_many_documents():
    chunks, cu, w = _docs(_lengths(60, 3, seed=81), 8, seed=82)
    chunks[5] = 0.0  # a zero chunk: normalize_chunks divides by eps, its norm is 0
    for agg in AGGREGATIONS:
        for nc in (False, True):
            args = (chunks, cu, w, agg, 2, 1.0, nc, True)
            assert_close(aggregate(*args), aggregate_documents_ref(*args), *F32_TOL, what=f"{agg} nc={nc}")


def test_aggregate_no_chunks_empty_documents_and_trailing_chunks():
    H = 12
    cu0 = torch.zeros(1, dtype=torch.int64)
    for agg in AGGREGATIONS:
        assert aggregate(torch.zeros(0, H), cu0, torch.zeros(0), agg, 1, 1.0, False, True).shape == (0, H)
    # documents without chunks (outside the contract) give zero vectors, like the reference;
    # chunks after the last document belong to none and are ignored, like the reference
    chunks, _, w = _docs([2, 1, 3], H, seed=1)
    for cu in ([0, 2, 2, 3], [0, 0, 2, 3], [0, 2, 3, 3], [0, 1, 3]):
        cu = torch.tensor(cu, dtype=torch.int64)
        for agg in AGGREGATIONS:
            for nc in (False, True):
                args = (chunks, cu, w, agg, 1, 1.0, nc, True)
                out = aggregate(*args)
                assert_close(out, aggregate_documents_ref(*args), *F32_TOL, what=f"{agg} nc={nc} cu={cu.tolist()}")
                empty = (cu[1:] == cu[:-1]).nonzero().flatten()
                assert torch.equal(out[empty], torch.zeros(len(empty), H))
    assert torch.equal(aggregate(torch.zeros(0, H), torch.zeros(3, dtype=torch.int64)), torch.zeros(2, H))


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_small_inputs_sum_on_the_calling_thread_to_the_same_bits(agg, monkeypatch):
    """Chunk vectors of at most SERIAL_ELEMENTS on the CPU are reduced on the calling thread, with no
    index_add_ / scatter_reduce_, whose OpenMP region's spinning threads would slow an OpenVINO forward
    after it (mean and max in numpy, the weighted ones by one segment_reduce): the same bits as the
    index_add_ / scatter_reduce_ of larger inputs, empty documents and trailing chunks included."""
    chunks, _, w = _docs([2, 1, 3, 5], 16, seed=7)
    calls = []
    for name in ("index_add_", "scatter_reduce_"):
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=getattr(torch.Tensor, name), _name=name, **k:
                            calls.append(_name) or _real(self, *a, **k))
    real = torch.segment_reduce
    monkeypatch.setattr(torch, "segment_reduce", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    for cu in ([0, 2, 3, 6, 11], [0, 2, 2, 3], [0, 0, 2, 3, 6], [0, 1, 3], [0, 11]):
        cu = torch.tensor(cu, dtype=torch.int64)
        for nc, normalize in ((False, True), (True, True), (False, False)):
            args = (chunks, cu, w, agg, 2, 0.7, nc, normalize)
            calls.clear()
            serial = aggregate(*args)
            ran = list(calls)
            with monkeypatch.context() as m:
                m.setattr(tpo, "SERIAL_ELEMENTS", -1)
                parallel = aggregate(*args)
            assert torch.equal(serial, parallel), (agg, nc, normalize, cu.tolist())
            # mean and max: numpy; the weighted ones: their coefficients (1-D), then one segment_reduce
            assert ran == [] if agg in ("mean", "max") else ran[-1] == "sum" and "sum" not in ran[:-1], ran
    assert "scatter_reduce_" in calls if agg == "max" else "index_add_" in calls  # the larger path ran too


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_documents_split_across_calls(agg):
    """Aggregating two groups of documents separately gives the same document vectors, bit for bit."""
    doc_lens = _lengths(30, 12, seed=91, extra=[1, 70])
    chunks, cu, w = _docs(doc_lens, 64, seed=92)
    args = (agg, 3, 0.7, True, True)
    whole = aggregate(chunks, cu, w, *args)
    for cut in (1, 13, len(doc_lens) - 1):
        c = int(cu[cut])
        a = aggregate(chunks[:c], cu[: cut + 1], w[:c], *args)
        b = aggregate(chunks[c:], cu[cut:] - c, w[c:], *args)
        assert torch.equal(torch.cat([a, b]), whole), f"{agg}: cut after document {cut}"


def test_aggregate_rejects_bad_inputs():
    chunks, cu, w = _docs([2, 3], 8, seed=2)
    with pytest.raises(ValueError, match="needs chunk_weights"):
        aggregate(chunks, cu, None, "weighted_mean")
    with pytest.raises(ValueError, match="top_k"):
        aggregate(chunks, cu, None, "topk_norm", 0)
    with pytest.raises(ValueError, match="temperature"):
        aggregate(chunks, cu, None, "softmax_norm", 1, 0.0)
    with pytest.raises(ValueError, match="float32"):
        aggregate(chunks.double(), cu)
    with pytest.raises(ValueError, match="int64"):
        aggregate(chunks, cu.int())


def test_segment_pool_end_to_end():
    from dice_fast.ops import segment_pool

    lens = _lengths(30, 20, seed=93, extra=[280])
    cu = _cu(lens)
    hidden = _hidden(sum(lens), 48, torch.bfloat16, seed=94)
    cu_doc = _cu([1, 10, 19, 1], torch.int64)
    weights = (cu[1:] - cu[:-1]).to(torch.float32)
    for pooling, agg in [("mean", "mean"), ("cls", "topk_norm"), ("last", "weighted_mean"), ("mean", "max")]:
        c_t, d_t = segment_pool(hidden, cu, cu_doc, weights, pooling, agg, top_k=4, impl="torch")
        c_r = pool_chunks_ref(hidden, cu, pooling)
        assert_close(c_t, c_r, *F32_TOL, what=f"chunks {pooling}")
        assert_close(d_t, aggregate_documents_ref(c_r, cu_doc, weights, agg, 4), *F32_TOL, what=f"{pooling}/{agg}")


# --------------------------------------------------------------------------------------------
# CUDA (the same code, other kernels: index_add_ adds with atomics there, so no bit-identity)
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("H", [7, 384, 4096])
def test_cuda_matches_ref(H):
    lens = _lengths(300, 700, seed=20, extra=[1, 1, 8192, 3, 1])
    cu = _cu(lens, device="cuda")
    for dtype in DTYPES:
        hidden = _hidden(sum(lens), H, dtype, seed=H, device="cuda")
        for pooling in POOLINGS:
            out = pool(hidden, cu, pooling)
            assert out.device.type == "cuda"
            assert_close(out, pool_chunks_ref(hidden, cu, pooling), *F32_TOL, what=f"cuda {pooling} {dtype} H={H}")
    chunks, cu_doc, w = _docs([1, 4, 300, 1, 7, 0, 70], H, seed=41, device="cuda")
    for agg in AGGREGATIONS:
        for nc in (False, True):
            args = (chunks, cu_doc, w, agg, 3, 0.7, nc, True)
            assert_close(aggregate(*args), aggregate_documents_ref(*args), *F32_TOL, what=f"cuda {agg} nc={nc} H={H}")


def test_document_normalisation_clamps_at_1e_12_not_more():
    """A document vector of small but non-zero norm (1e-6) is still scaled to unit length
    (spec: divide by max(norm, 1e-12))."""
    import torch
    from dice_fast.ops.spec import aggregate_documents_ref
    from dice_fast.ops.torch_pool import aggregate_documents_torch

    torch.manual_seed(0)
    chunks = torch.randn(5, 8, dtype=torch.float32) * 1e-6
    cu = torch.tensor([0, 2, 5], dtype=torch.int64)
    for agg in ("mean", "max"):
        got = aggregate_documents_torch(chunks, cu, None, agg)
        torch.testing.assert_close(got.norm(dim=1), torch.ones(2), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, aggregate_documents_ref(chunks, cu, None, agg), rtol=1e-5, atol=1e-6)


def test_softmax_norm_survives_large_norms_over_a_small_temperature():
    """softmax_norm weights with norm / temperature ~ 1e4 (exp overflows without the segment max)."""
    import torch
    from dice_fast.ops.spec import aggregate_documents_ref
    from dice_fast.ops.torch_pool import aggregate_documents_torch

    torch.manual_seed(0)
    chunks = torch.randn(6, 8, dtype=torch.float32) * 300
    cu = torch.tensor([0, 3, 6], dtype=torch.int64)
    got = aggregate_documents_torch(chunks, cu, None, "softmax_norm", temperature=0.1)
    assert torch.isfinite(got).all()
    want = aggregate_documents_ref(chunks, cu, None, "softmax_norm", temperature=0.1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
