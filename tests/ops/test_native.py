"""C++ twins of the pooling op (csrc/, `dice_fast.ops.native`) vs the float64 references.

The CPU extension is built once per session (module fixture; skipped with the reason when no C++
compiler or ninja is found; a build that fails with a compiler present is an error). While it
builds, nvcc compiles csrc/segment_pool_cuda.cu to an object file in the background (when nvcc and
the c10/cuda headers exist), checked by `test_cuda_source_compiles_with_nvcc`. Tests marked ``gpu``
run the CUDA kernels (on a GPU machine the fixture builds them too).

Tolerances: the reference reads the *same* (possibly bf16 / fp16) input and computes in float64, so
the only error left is the kernels' float32 accumulation: every dtype is held to the float32
tolerance. `test_pool_low_precision_input_rounding` checks a bf16 / fp16 input against the
float32-input reference with the per-dtype `TOLERANCES` (that error is the input's rounding).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dice_fast.ops.spec import AGGREGATIONS, POOLINGS, SCHEMAS, aggregate_documents_ref, pool_chunks_ref
import pool_data
from helpers import TOLERANCES, assert_close

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
CU_SOURCE = CSRC / "segment_pool_cuda.cu"
F32_TOL = TOLERANCES[torch.float32]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = ("f32", "bf16", "f16")


# --------------------------------------------------------------------------------------------
# toolchain, background nvcc check, build fixture
# --------------------------------------------------------------------------------------------
def _toolchain_missing() -> str | None:
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r}) on PATH"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _nvcc_command(obj: Path) -> tuple[list[str] | None, str]:
    """The nvcc command that compiles the .cu like torch.utils.cpp_extension would, or (None, why not)."""
    nvcc = _find_nvcc()
    if nvcc is None:
        return None, "nvcc not found (CUDA_HOME, CUDA_PATH, /usr/local/cuda, PATH)"
    inc = Path(torch.__file__).resolve().parent / "include"
    # the CPU wheel ships the c10/cuda headers the .cu needs; older or trimmed wheels may not
    needed = ["c10/cuda/CUDAGuard.h", "c10/cuda/CUDAStream.h", "c10/cuda/CUDAException.h", "torch/library.h"]
    missing = [h for h in needed if not (inc / h).is_file()]
    if missing:
        return None, f"this torch wheel lacks headers the CUDA source needs: {', '.join(missing)}"
    cuda_inc = Path(nvcc).resolve().parents[1] / "include"
    if not (cuda_inc / "cuda_runtime.h").is_file():
        return None, f"the CUDA toolkit next to {nvcc} has no include/cuda_runtime.h"
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    cmd = [
        nvcc, "-c", str(CU_SOURCE), "-o", str(obj),
        "-I", str(CSRC), "-I", str(inc), "-I", str(inc / "torch" / "csrc" / "api" / "include"),
        *COMMON_NVCC_FLAGS,
        "-O3", "-std=c++20" if (major, minor) >= (2, 10) else "-std=c++17",
        "-gencode=arch=compute_90,code=sm_90",  # the lent GPU is an H200
        "-Xcompiler", "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]  # fmt: skip
    if not (inc / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").is_file():
        # The CPU wheel omits this generated one-liner (it only defines C10_CUDA_BUILD_SHARED_LIBS,
        # which matters for Windows DLL exports); c10's own switch skips including it.
        cmd.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    return cmd, ""


def _selects_gpu_tests(config) -> bool:
    """Whether ``-m`` asks for the GPU tests (``-m gpu``, not ``-m "not gpu"``)."""
    expr = config.getoption("-m") or ""
    return "gpu" in expr and "not gpu" not in expr


@pytest.fixture(scope="module")
def nvcc_job(tmp_path_factory, request):
    """Start compiling the .cu with nvcc in the background; (process, object path, log path) or (None, reason).
    Not under ``-m gpu``: there the extension's own build compiles the .cu (with CUDA) and the
    background job would only take a core from it inside the GPU check's time limit."""
    if _selects_gpu_tests(request.config):
        yield None, "under -m gpu the CUDA build of the extension compiles the .cu itself"
        return
    obj = tmp_path_factory.mktemp("nvcc") / "segment_pool_cuda.o"
    cmd, why = _nvcc_command(obj)
    if cmd is None:
        yield None, why
        return
    log = obj.with_suffix(".log")
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    yield (proc, obj, log), ""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def native(nvcc_job):
    """The built and loaded extension module (`dice_fast.ops.native`)."""
    from dice_fast.ops import native as nat

    if not nat.is_loaded():
        reason = _toolchain_missing()
        if reason:
            pytest.skip(f"cannot build the dice_fast C++ extension: {reason}")
        nat.build()
    assert nat.is_loaded()
    return nat


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------
_gen, _cu, _hidden, _lengths = pool_data.gen, pool_data.cu, pool_data.hidden, pool_data.lengths


def _docs(doc_lens, H: int, seed: int, device="cpu"):
    g = _gen(seed)
    n = sum(doc_lens)
    # norms vary from chunk to chunk (the salience signal of topk_norm / softmax_norm)
    chunks = torch.randn(n, H, generator=g) * (0.2 + 2.0 * torch.rand(n, 1, generator=g))
    weights = torch.rand(n, generator=g) * 10.0
    return chunks.to(device), _cu(doc_lens, torch.int64, device), weights.to(device)


# --------------------------------------------------------------------------------------------
# token -> chunk (CPU)
# --------------------------------------------------------------------------------------------
# 1-token chunks, lengths around any vector / block width, a 130-token chunk
LENS = _lengths(24, 40, seed=3, extra=[1, 3, 1, 17, 64, 1, 130, 5, 1, 1])


@pytest.mark.parametrize("H", [1, 7, 100, 384])
@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pool_chunks_matches_ref(native, dtype, pooling, H):
    cu = _cu(LENS)
    hidden = _hidden(sum(LENS), H, dtype, seed=H)
    out = native.pool_chunks_native(hidden, cu, pooling)
    assert out.shape == (len(LENS), H) and out.dtype == torch.float32
    assert_close(out, pool_chunks_ref(hidden, cu, pooling), *F32_TOL, what=f"{pooling} {dtype} H={H}")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=DTYPE_IDS[1:])
def test_pool_low_precision_input_rounding(native, dtype):
    cu = _cu(LENS)
    hidden = _hidden(sum(LENS), 100, torch.float32, seed=5)
    out = native.pool_chunks_native(hidden.to(dtype), cu, "mean")
    assert_close(out, pool_chunks_ref(hidden, cu, "mean"), *TOLERANCES[dtype], what=str(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pool_long_chunks_and_few_chunks(native, dtype):
    # one 8192-token chunk: the column dim is split so that every thread gets work
    lens = [8192, 1, 300]
    cu = _cu(lens)
    hidden = _hidden(sum(lens), 1000, dtype, seed=7)
    for pooling in POOLINGS:
        assert_close(native.pool_chunks_native(hidden, cu, pooling), pool_chunks_ref(hidden, cu, pooling), *F32_TOL,
                     what=pooling)  # fmt: skip
    one = _cu([8192])
    assert_close(native.pool_chunks_native(hidden[:8192], one), pool_chunks_ref(hidden[:8192], one), *F32_TOL)


def test_pool_many_one_token_chunks(native):
    lens = [1] * 3000 + [2, 1]
    cu = _cu(lens)
    hidden = _hidden(sum(lens), 24, torch.bfloat16, seed=8)
    for pooling in POOLINGS:
        out = native.pool_chunks_native(hidden, cu, pooling)
        assert_close(out, pool_chunks_ref(hidden, cu, pooling), *F32_TOL, what=pooling)
    assert torch.equal(out[:3000], hidden[:3000].float())  # a 1-token chunk is its token, exactly


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pool_split_into_two_batches_gives_same_chunks(native, dtype):
    lens = _lengths(40, 90, seed=9, extra=[1, 200])
    cu = _cu(lens)
    hidden = _hidden(sum(lens), 384, dtype, seed=10)
    whole = native.pool_chunks_native(hidden, cu, "mean")
    cut = 17  # chunks 0..16 in the first batch, the rest in the second
    t = int(cu[cut])
    first = native.pool_chunks_native(hidden[:t], _cu(lens[:cut]), "mean")
    second = native.pool_chunks_native(hidden[t:], _cu(lens[cut:]), "mean")
    # the summation order depends only on the chunk: bit-identical, whatever the batch
    assert torch.equal(torch.cat([first, second]), whole)


def test_pool_strided_rows_and_trailing_tokens(native):
    lens = [3, 1, 50, 8]
    cu = _cu(lens)
    base = _hidden(sum(lens) + 5, 300, torch.float32, seed=11)  # 5 trailing rows in no chunk
    hidden = base[:, 10:110]  # row stride 300, unit column stride
    ref = pool_chunks_ref(hidden.contiguous(), cu, "mean")
    assert_close(native.pool_chunks_native(hidden, cu, "mean"), ref, *F32_TOL, what="row stride")
    # non-unit column stride: copied to contiguous first
    t = hidden.contiguous().t().contiguous().t()
    assert_close(native.pool_chunks_native(t, cu, "mean"), ref, *F32_TOL, what="column stride")


def test_pool_no_chunks(native):
    cu0 = torch.zeros(1, dtype=torch.int32)
    for rows in (0, 5):
        for pooling in POOLINGS:
            out = native.pool_chunks_native(torch.randn(rows, 16), cu0, pooling)
            assert out.shape == (0, 16) and out.dtype == torch.float32
    # an empty chunk (outside the contract) pools to zeros, like the reference's mean
    cu = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    hidden = torch.randn(3, 8)
    out = native.pool_chunks_native(hidden, cu, "mean")
    assert_close(out, pool_chunks_ref(hidden, cu, "mean"), *F32_TOL)
    assert torch.equal(out[1], torch.zeros(8))


def test_pool_rejects_bad_inputs(native):
    hidden = torch.randn(10, 4)
    with pytest.raises(ValueError, match="unknown pooling"):
        native.pool_chunks_native(hidden, _cu([10]), "max")
    with pytest.raises(ValueError, match="int32"):
        native.pool_chunks_native(hidden, _cu([10], torch.int64), "mean")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        native.pool_chunks_native(hidden.double(), _cu([10]), "mean")
    # the C++ op checks too (called directly), and checks offsets on the CPU
    op = torch.ops.dice_fast_C.pool_chunks
    with pytest.raises(RuntimeError, match="cu_seqlens must be int32"):
        op(hidden, _cu([10], torch.int64), "mean")
    with pytest.raises(RuntimeError, match="hidden must be 2-D"):
        op(hidden[0], _cu([10]), "mean")
    with pytest.raises((RuntimeError, ValueError), match="unknown pooling"):
        op(hidden, _cu([10]), "sum")
    with pytest.raises(RuntimeError, match="exceeds the number of token rows"):
        op(hidden, _cu([6, 6]), "mean")
    with pytest.raises(RuntimeError, match="non-decreasing"):
        op(hidden, torch.tensor([0, 5, 3, 10], dtype=torch.int32), "mean")
    with pytest.raises(RuntimeError, match=r"cu_seqlens\[0\] must be 0"):
        op(hidden, torch.tensor([1, 5], dtype=torch.int32), "mean")


# --------------------------------------------------------------------------------------------
# chunk -> document (CPU)
# --------------------------------------------------------------------------------------------
DOC_LENS = [1, 4, 1, 9, 2, 30]


@pytest.mark.parametrize("H", [1, 7, 100, 384])
@pytest.mark.parametrize("nz", [False, True], ids=["nonorm", "norm"])
@pytest.mark.parametrize("nc", [False, True], ids=["raw", "normchunks"])
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_aggregate_matches_ref(native, agg, nc, nz, H):
    chunks, cu, w = _docs(DOC_LENS, H, seed=41 + H)
    args = (chunks, cu, w, agg, 3, 0.7, nc, nz)
    out = native.aggregate_documents_native(*args)
    assert out.shape == (len(DOC_LENS), H) and out.dtype == torch.float32
    assert_close(out, aggregate_documents_ref(*args), *F32_TOL, what=f"{agg} nc={nc} nz={nz} H={H}")


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_aggregate_300_chunk_document(native, agg):
    chunks, cu, w = _docs([300, 1, 7], 384, seed=43)
    for nc in (False, True):
        args = (chunks, cu, w, agg, 10, 0.5, nc, True)
        out = native.aggregate_documents_native(*args)
        assert_close(out, aggregate_documents_ref(*args), *F32_TOL, what=f"{agg} nc={nc}")


@pytest.mark.parametrize("top_k", [1, 2, 7, 1000])
def test_topk_sizes(native, top_k):
    chunks, cu, w = _docs([1, 3, 7, 150], 24, seed=61)
    for nz in (False, True):
        args = (chunks, cu, w, "topk_norm", top_k, 1.0, False, nz)
        assert_close(native.aggregate_documents_native(*args), aggregate_documents_ref(*args), *F32_TOL,
                     what=f"top_k={top_k}")  # fmt: skip


def test_topk_more_than_chunks_is_mean(native):
    chunks, cu, _ = _docs([1, 2, 5], 33, seed=62)
    top = native.aggregate_documents_native(chunks, cu, None, "topk_norm", 1000, 1.0, False, False)
    mean = native.aggregate_documents_native(chunks, cu, None, "mean", 1, 1.0, False, False)
    assert_close(top, mean, *F32_TOL)


def test_topk_ties_go_to_earlier_chunk(native):
    # integer vectors: exact float32 norms, so equal norms are exact ties; -v has v's norm bit for bit
    base = torch.tensor(
        [[3.0, 4.0, 0.0], [0.0, 3.0, 4.0], [1.0, 1.0, 1.0], [-3.0, -4.0, 0.0], [4.0, 0.0, 3.0], [0.0, 0.0, 5.0]]
    )
    cu = _cu([6], torch.int64)
    for k in range(1, 7):
        args = (base, cu, None, "topk_norm", k, 1.0, False, False)
        out = native.aggregate_documents_native(*args)
        assert_close(out, aggregate_documents_ref(*args), *F32_TOL, what=f"ties k={k}")
        picked = sorted([0, 1, 3, 4, 5, 2][:k])  # norm 5 for chunks 0, 1, 3, 4, 5; sqrt(3) for chunk 2
        assert_close(out[0], base[picked].mean(0), *F32_TOL, what=f"ties k={k} explicit")
    # normalize_chunks: chunks are still ranked by their norms as pooled
    out = native.aggregate_documents_native(base, cu, None, "topk_norm", 3, 1.0, True, False)
    picked = base[[0, 1, 3]]
    expected = (picked / picked.norm(dim=1, keepdim=True)).mean(0)
    assert_close(out[0], expected, *F32_TOL, what="normalized ties")


@pytest.mark.parametrize("temperature", [0.05, 1.0, 25.0])
def test_softmax_temperatures(native, temperature):
    chunks, cu, w = _docs([1, 5, 40], 16, seed=71)
    for nc in (False, True):
        args = (chunks, cu, w, "softmax_norm", 1, temperature, nc, True)
        assert_close(native.aggregate_documents_native(*args), aggregate_documents_ref(*args), *F32_TOL,
                     what=f"T={temperature} nc={nc}")  # fmt: skip


def test_aggregate_zero_chunk_and_many_documents(native):
    chunks, cu, w = _docs(_lengths(60, 3, seed=81), 8, seed=82)
    chunks[5] = 0.0  # a zero chunk: normalize_chunks divides by eps, its norm is 0
    cases = 0
    for agg in AGGREGATIONS:
        for nc in (False, True):
            args = (chunks, cu, w, agg, 2, 1.0, nc, True)
            out = native.aggregate_documents_native(*args)
            assert_close(out, aggregate_documents_ref(*args), *F32_TOL, what=f"{agg} nc={nc}")
            cases += 1
    assert cases == 2 * len(AGGREGATIONS)  # every case was compared, not only the last one


def test_aggregate_no_chunks_and_empty_documents(native):
    H = 12
    cu0 = torch.zeros(1, dtype=torch.int64)
    for agg in AGGREGATIONS:
        out = native.aggregate_documents_native(torch.zeros(0, H), cu0, torch.zeros(0), agg, 1, 1.0, False, True)
        assert out.shape == (0, H)
    # documents without chunks (outside the contract) give zero vectors, like the reference
    chunks, cu, w = _docs([2, 1], H, seed=1)
    cu_gap = torch.tensor([0, 2, 2, 3], dtype=torch.int64)
    for agg in AGGREGATIONS:
        args = (chunks, cu_gap, w, agg, 1, 1.0, False, True)
        out = native.aggregate_documents_native(*args)
        assert_close(out, aggregate_documents_ref(*args), *F32_TOL, what=agg)
        assert torch.equal(out[1], torch.zeros(H))
    empty_docs = native.aggregate_documents_native(torch.zeros(0, H), torch.zeros(3, dtype=torch.int64))
    assert torch.equal(empty_docs, torch.zeros(2, H))


def test_aggregate_rejects_bad_inputs(native):
    chunks, cu, w = _docs([2, 3], 8, seed=2)
    with pytest.raises(ValueError, match="needs chunk_weights"):
        native.aggregate_documents_native(chunks, cu, None, "weighted_mean")
    with pytest.raises(ValueError, match="top_k"):
        native.aggregate_documents_native(chunks, cu, None, "topk_norm", 0)
    with pytest.raises(ValueError, match="temperature"):
        native.aggregate_documents_native(chunks, cu, None, "softmax_norm", 1, 0.0)
    op = torch.ops.dice_fast_C.aggregate_documents
    with pytest.raises(RuntimeError, match="chunks must be float32"):
        op(chunks.double(), cu, None, "mean", 1, 1.0, False, True)
    with pytest.raises(RuntimeError, match="cu_doc_chunks must be int64"):
        op(chunks, cu.int(), None, "mean", 1, 1.0, False, True)
    with pytest.raises(RuntimeError, match="chunk_weights must be float32 of shape"):
        op(chunks, cu, w[:2], "weighted_mean", 1, 1.0, False, True)
    with pytest.raises(RuntimeError, match="exceeds the number of chunks"):
        op(chunks, torch.tensor([0, 9], dtype=torch.int64), None, "mean", 1, 1.0, False, True)
    with pytest.raises((RuntimeError, ValueError), match="top_k must be >= 1"):
        op(chunks, cu, None, "topk_norm", 0, 1.0, False, True)


# --------------------------------------------------------------------------------------------
# integration: dispatcher, Meta kernels, lazy import, clear messages
# --------------------------------------------------------------------------------------------
def test_dispatcher_uses_native_once_built(native):
    from dice_fast import ops

    assert ops.resolve_impl("auto", torch.device("cpu")) == "native"
    lens = [3, 1, 9]
    cu = _cu(lens)
    hidden = _hidden(sum(lens), 20, torch.bfloat16, seed=12)
    cu_doc = torch.tensor([0, 1, 3], dtype=torch.int64)
    chunks, docs = ops.segment_pool(hidden, cu, cu_doc, pooling="last", aggregation="max", impl="native")
    ref_chunks = pool_chunks_ref(hidden, cu, "last")
    assert_close(chunks, ref_chunks, *F32_TOL)
    assert_close(docs, aggregate_documents_ref(ref_chunks, cu_doc, None, "max"), *F32_TOL)


def test_loaded_schemas_are_the_spec(native):
    """The ops the C++ library registered have exactly the argument lists of `spec.SCHEMAS`."""
    for name, schema in SCHEMAS.items():
        loaded = getattr(torch.ops.dice_fast_C, name).default._schema
        assert str(loaded) == str(torch._C.parse_schema(f"dice_fast_C::{name}{schema}")), name
    # the schema's defaults work through the dispatcher
    hidden, cu = _hidden(5, 4, torch.float32, seed=1), _cu([2, 3])
    assert torch.equal(torch.ops.dice_fast_C.pool_chunks(hidden, cu), native.pool_chunks_native(hidden, cu, "mean"))
    chunks, cu_doc, _ = _docs([1, 2], 4, seed=2)
    assert torch.equal(
        torch.ops.dice_fast_C.aggregate_documents(chunks, cu_doc),
        native.aggregate_documents_native(chunks, cu_doc, None, "mean", 1, 1.0, False, True),
    )


def test_meta_kernels_give_shapes(native):
    hidden = torch.empty(50, 64, device="meta", dtype=torch.bfloat16)
    cu = torch.empty(8, device="meta", dtype=torch.int32)
    out = torch.ops.dice_fast_C.pool_chunks(hidden, cu, "mean")
    assert out.shape == (7, 64) and out.dtype == torch.float32 and out.device.type == "meta"
    docs = torch.ops.dice_fast_C.aggregate_documents(
        out, torch.empty(3, device="meta", dtype=torch.int64), None, "mean", 1, 1.0, False, True
    )
    assert docs.shape == (2, 64)


def test_import_builds_nothing_and_messages_are_clear(tmp_path):
    """In a fresh process: `import dice_fast` does not import native; importing native builds nothing;
    calling an op before build() and building without a compiler / CUDA fail with a how-to message."""
    script = textwrap.dedent(
        """
        import os, sys
        import dice_fast, dice_fast.ops
        assert "dice_fast.ops.native" not in sys.modules, "import dice_fast imported the native module"
        from dice_fast.ops import native
        import torch
        assert not native.is_loaded()
        assert not any(os.scandir(os.environ["TORCH_EXTENSIONS_DIR"])), "importing native wrote build files"
        try:
            native.pool_chunks_native(torch.zeros(2, 3), torch.tensor([0, 2], dtype=torch.int32))
        except RuntimeError as e:
            assert "build()" in str(e), e
        else:
            raise AssertionError("no error before build()")
        os.environ["CXX"] = "/nonexistent/c++"
        try:
            native.build()
        except RuntimeError as e:
            assert "C++ compiler" in str(e), e
        else:
            raise AssertionError("built without a compiler")
        del os.environ["CXX"]
        if torch.version.cuda is None:
            try:
                native.build(with_cuda=True)
            except RuntimeError as e:
                assert "CUDA build of torch" in str(e), e
            else:
                raise AssertionError("built CUDA kernels with a CPU torch")
        assert not native.is_loaded()
        print("ok")
        """
    )
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_cuda_source_compiles_with_nvcc(nvcc_job):
    job, why = nvcc_job
    if job is None:
        pytest.skip(why)
    proc, obj, log = job
    try:
        rc = proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("nvcc took more than 300 s")
    out = log.read_text(errors="replace")
    assert rc == 0, f"nvcc failed ({rc}):\n{out[-6000:]}"
    assert obj.is_file() and obj.stat().st_size > 0


# --------------------------------------------------------------------------------------------
# CUDA kernels (GPU machines only)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_native(native):
    if not native.has_cuda_kernels():
        pytest.skip("the extension was built without CUDA kernels")
    return native


@pytest.mark.gpu
@pytest.mark.parametrize("H", [7, 100, 384, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cuda_pool_chunks_matches_ref(cuda_native, dtype, H):
    # 1-token chunks, chunks that span several row ranges (up to 2048 rows each), a long tail
    lens = _lengths(300, 700, seed=20, extra=[1, 1, 8192, 3, 5000, 1]) + [1] * 100
    cu = _cu(lens, device="cuda")
    hidden = _hidden(sum(lens), H, dtype, seed=H, device="cuda")
    for pooling in POOLINGS:
        out = cuda_native.pool_chunks_native(hidden, cu, pooling)
        assert out.device.type == "cuda"
        assert_close(out, pool_chunks_ref(hidden, cu, pooling), *F32_TOL, what=f"cuda {pooling} {dtype} H={H}")
        assert torch.equal(out, cuda_native.pool_chunks_native(hidden, cu, pooling))  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("total", [1, 33, 2049, 100_000])
def test_cuda_pool_chunks_sizes(cuda_native, total):
    # small totals give short row ranges, large ones long ranges; odd sizes take the scalar path
    lens, T = [], 0
    for n in _lengths(total, 64, seed=total):
        if T >= total:
            break
        lens.append(n)
        T += n
    cu = _cu(lens, device="cuda")
    for dtype in DTYPES:
        base = _hidden(T, 129, dtype, seed=1, device="cuda")
        cases = {"aligned": base[:, :64].contiguous(), "odd H": base[:, :101].contiguous(), "odd offset": base[:, 1:97]}
        for what, hidden in cases.items():
            out = cuda_native.pool_chunks_native(hidden, cu, "mean")
            assert_close(out, pool_chunks_ref(hidden, cu, "mean"), *F32_TOL, what=f"{dtype} {what} total={total}")


@pytest.mark.gpu
def test_cuda_pool_no_chunks_and_empty_chunk(cuda_native):
    cu0 = torch.zeros(1, dtype=torch.int32, device="cuda")
    assert cuda_native.pool_chunks_native(torch.randn(4, 8, device="cuda"), cu0).shape == (0, 8)
    cu = torch.tensor([0, 2, 2, 3], dtype=torch.int32, device="cuda")
    hidden = torch.randn(3, 8, device="cuda")
    for pooling in POOLINGS:
        out = cuda_native.pool_chunks_native(hidden, cu, pooling)
        assert torch.equal(out[1], torch.zeros(8, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("H", [1, 7, 384, 4096])
def test_cuda_aggregate_matches_ref(cuda_native, agg, H):
    chunks, cu, w = _docs([1, 4, 300, 1, 7, 2, 70], H, seed=41, device="cuda")
    for nc in (False, True):
        for nz in (False, True):
            args = (chunks, cu, w, agg, 3, 0.7, nc, nz)
            out = cuda_native.aggregate_documents_native(*args)
            assert out.device.type == "cuda"
            assert_close(out, aggregate_documents_ref(*args), *F32_TOL, what=f"cuda {agg} nc={nc} nz={nz} H={H}")


@pytest.mark.gpu
def test_cuda_aggregate_ties_and_empty(cuda_native):
    base = torch.tensor(
        [[3.0, 4.0, 0.0], [0.0, 3.0, 4.0], [1.0, 1.0, 1.0], [-3.0, -4.0, 0.0], [4.0, 0.0, 3.0], [0.0, 0.0, 5.0]]
    ).cuda()
    cu = _cu([6], torch.int64, "cuda")
    for k in range(1, 7):
        args = (base, cu, None, "topk_norm", k, 1.0, False, False)
        assert_close(cuda_native.aggregate_documents_native(*args), aggregate_documents_ref(*args), *F32_TOL)
    H = 12
    cu0 = torch.zeros(1, dtype=torch.int64, device="cuda")
    assert cuda_native.aggregate_documents_native(torch.zeros(0, H, device="cuda"), cu0).shape == (0, H)
    chunks, _, w = _docs([2, 1], H, seed=1, device="cuda")
    cu_gap = torch.tensor([0, 2, 2, 3], dtype=torch.int64, device="cuda")
    for agg in AGGREGATIONS:
        args = (chunks, cu_gap, w, agg, 1, 1.0, False, True)
        assert_close(cuda_native.aggregate_documents_native(*args), aggregate_documents_ref(*args), *F32_TOL, what=agg)


def test_the_ninja_installed_beside_python_is_found_without_an_activated_environment(tmp_path, monkeypatch):
    """A virtual environment's python run by its path has its bin off PATH: torch found no ninja and the C++
    kernels were silently off, though pip had installed ninja with dice_fast."""
    from dice_fast.ops import native

    if shutil.which("ninja", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("no ninja beside this python")
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH without ninja
    assert shutil.which("ninja") is None
    native._reach_installed_ninja()
    assert shutil.which("ninja") is not None
    assert os.environ["PATH"].endswith(os.pathsep + str(tmp_path))  # put in front, nothing taken away


def test_the_command_line_can_ask_for_the_native_pooling(native, tmp_path):
    """`--pooling-impl native` was offered by every command and always refused ("call build() first"):
    a command line cannot call build(). Asked for by name, it is built (here: loaded from its cache), also
    past the lock file a killed build leaves (torch's builds waited on it without end)."""
    from pathlib import Path

    from dice_fast.corpus import load_embeddings

    (Path(native.build()).parent / "lock").write_text("")  # in the build folder, as a killed build leaves it

    docs = tmp_path / "d.txt"
    docs.write_text("the first document\nand a second, longer one with more words in it\n", encoding="utf-8")
    for impl in ("native", "torch"):
        done = subprocess.run([sys.executable, "-m", "dice_fast.cli", "encode", str(docs), "-o", str(tmp_path / f"{impl}.npy"),
                               "--pooling-impl", impl, "--chunk-size", "8", "-q"], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
    (_, a), (_, b) = load_embeddings(tmp_path / "native.npy"), load_embeddings(tmp_path / "torch.npy")
    assert_close(a, b, atol=1e-6, what="native vs torch pooling")


def test_a_csrc_folder_named_in_the_environment_is_the_one_built(tmp_path, monkeypatch):
    """``$DICE_FAST_CSRC`` naming a folder without the sources is refused, naming it (a mistyped path
    compiled the stock sources instead, silently); one with them is used."""
    from dice_fast.errors import OptionError
    from dice_fast.ops import native

    stock = native.csrc_dir()
    monkeypatch.setenv("DICE_FAST_CSRC", str(tmp_path / "no-such-csrc"))
    with pytest.raises(OptionError, match=r"DICE_FAST_CSRC=.*no-such-csrc.*lacks"):
        native.csrc_dir()
    copy = shutil.copytree(stock, tmp_path / "my-csrc")
    monkeypatch.setenv("DICE_FAST_CSRC", str(copy))
    assert native.csrc_dir() == copy
