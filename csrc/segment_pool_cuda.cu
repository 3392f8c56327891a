// CUDA twin of the segment pooling op (see segment_pool.h and dice_fast/ops/spec.py).
//
// pool_chunks(mean) is memory-bound: it reads hidden (total_tokens, H) exactly once.
// * Work unit = one warp task: a range of R consecutive token rows x one column tile of 32 lanes x
//   VEC elements (16-byte loads: 8 bf16/fp16 or 4 fp32 per lane; 1 element per lane when H or the
//   row stride is not a multiple of that). Ranges tile the token stream regardless of chunk
//   boundaries, so the launch needs only host-known sizes (no sync on cu_seqlens) and every task is
//   the same size whatever the chunk lengths (1 token or 8192 tokens, few or many chunks).
// * A warp walks its rows in order (UNROLL independent 16-byte loads in flight per lane), keeps a
//   float32 accumulator per element, and flushes it at every chunk boundary: a chunk that lies
//   wholly inside the range is written out directly (sum / length); the at most two partial chunk
//   pieces at the range's ends go to a float32 workspace (slot 0: the piece that starts at the range
//   start, slot 1: the piece that ends at the range end).
// * pool_mean_fixup: one warp per (chunk, column tile) adds, in range order, the partial sums of
//   the chunks that span several ranges and divides by the length; it also writes the zero rows of
//   empty chunks. No atomics: results are deterministic run to run.
// * R is the largest power of two in [32, 2048] that still gives >= 16 warp tasks per SM, so the
//   workspace traffic stays small (<= 1 partial row per R rows read) and the GPU stays full.
// cls / last copy one row per chunk. aggregate_documents runs four small kernels (chunk norms,
// per-document coefficients incl. top-k ranks and softmax weights, the weighted sum / max over a
// document's chunks split across 8 warps and reduced in a fixed order, the final L2 normalisation).
// All offsets are clamped on the device so malformed cu_seqlens / cu_doc_chunks cannot read or
// write out of bounds (their values are otherwise the caller's contract: no host sync here).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "segment_pool.h"

namespace dice_fast {
namespace {

constexpr int kWarpSize = 32;
constexpr int kPoolThreads = 256;  // 8 warps per block, each an independent task
constexpr int kPoolWarps = kPoolThreads / kWarpSize;
constexpr int kUnroll = 8;         // rows in flight per lane in pool_mean
constexpr float kEpsF = 1e-12f;

// element tags: the storage type and how to widen it to float
struct F32 { using raw = float; };
struct BF16 { using raw = uint16_t; };
struct F16 { using raw = uint16_t; };

__device__ __forceinline__ float widen(F32, float v) { return v; }
__device__ __forceinline__ float widen(BF16, uint16_t v) { return __uint_as_float(static_cast<uint32_t>(v) << 16); }
__device__ __forceinline__ float widen(F16, uint16_t v) { return __half2float(__ushort_as_half(v)); }

// v[0:VEC] = float(p[0:VEC]); one 16-byte load when VEC * sizeof(raw) == 16 (p 16-byte aligned).
template <typename Tag, int VEC>
__device__ __forceinline__ void load_vec(const typename Tag::raw* __restrict__ p, float (&v)[VEC]) {
  if constexpr (VEC == 1) {
    v[0] = widen(Tag{}, __ldg(p));
  } else {
    static_assert(VEC * sizeof(typename Tag::raw) == 16, "vector loads are 16 bytes");
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (std::is_same_v<Tag, F32>) {
        v[k] = __uint_as_float(w[k]);
      } else if constexpr (std::is_same_v<Tag, BF16>) {  // little endian: element 2k is the low half
        v[2 * k] = __uint_as_float(w[k] << 16);
        v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
      } else {
        v[2 * k] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[k] & 0xffffu)));
        v[2 * k + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[k] >> 16)));
      }
    }
  }
}

// p[0:VEC] = v (16-byte stores when VEC is a multiple of 4; p then 16-byte aligned)
template <int VEC>
__device__ __forceinline__ void store_vec(float* __restrict__ p, const float (&v)[VEC]) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int k = 0; k < VEC; k += 4) *reinterpret_cast<float4*>(p + k) = make_float4(v[k], v[k + 1], v[k + 2], v[k + 3]);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) p[k] = v[k];
  }
}

// acc[0:VEC] += p[0:VEC] (float32; 16-byte loads when VEC is a multiple of 4)
template <int VEC>
__device__ __forceinline__ void add_vec(float (&acc)[VEC], const float* __restrict__ p) {
  constexpr int kW = VEC % 4 == 0 ? 4 : 1;
#pragma unroll
  for (int k0 = 0; k0 < VEC; k0 += kW) {
    float v[kW];
    load_vec<F32, kW>(p + k0, v);
#pragma unroll
    for (int k = 0; k < kW; ++k) acc[k0 + k] += v[k];
  }
}

// rows [0, end_rows) of hidden belong to chunks: min(total_tokens, cu[n_chunks]) (clamped, never negative)
__device__ __forceinline__ int64_t covered_rows(const int32_t* __restrict__ cu, int64_t n_chunks, int64_t n_rows) {
  const int64_t last = cu[n_chunks];
  return last < 0 ? 0 : (last < n_rows ? last : n_rows);
}

// chunk c's rows [a, b), clamped to [0, end_rows) with a <= b
__device__ __forceinline__ void chunk_rows(const int32_t* __restrict__ cu, int64_t c, int64_t end_rows, int64_t& a,
                                           int64_t& b) {
  a = min(max(static_cast<int64_t>(cu[c]), int64_t{0}), end_rows);
  b = min(max(static_cast<int64_t>(cu[c + 1]), a), end_rows);
}

// ------------------------------------------------------------------------------------------------
// pool_chunks
// ------------------------------------------------------------------------------------------------
template <typename Tag, int VEC>
__global__ void __launch_bounds__(kPoolThreads)
    pool_mean_kernel(const typename Tag::raw* __restrict__ hidden, int64_t ld, const int32_t* __restrict__ cu,
                     int64_t n_chunks, int64_t n_rows, int64_t H, int64_t R, int64_t n_ranges, int64_t n_tiles,
                     float* __restrict__ out, float* __restrict__ partial) {
  using Raw = typename Tag::raw;
  constexpr unsigned kFull = 0xffffffffu;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kPoolWarps + threadIdx.x / kWarpSize;
  if (task >= n_ranges * n_tiles) return;  // whole warp
  // neighbouring warps take neighbouring column tiles of the same rows (DRAM page locality)
  const int64_t range = task / n_tiles;
  const int64_t col = ((task % n_tiles) * kWarpSize + lane) * VEC;
  const bool active = col < H;  // H % VEC == 0, so an active lane's whole vector is in range

  const int64_t end_rows = covered_rows(cu, n_chunks, n_rows);
  const int64_t row_begin = range * R;
  const int64_t row_end = min(row_begin + R, end_rows);
  if (row_begin >= row_end) return;  // whole warp

  // The chunk holding row_begin: the last c with cu[c] <= row_begin (cu non-decreasing, cu[0] = 0).
  // 32-ary search: each step the lanes probe 32 evenly spaced offsets (about 4 dependent loads for a
  // million chunks instead of 20). Memory-safe (and terminating) for malformed offsets too.
  int64_t lo = 0, hi = n_chunks;
  while (hi - lo > 1) {
    const int64_t step = (hi - lo + kWarpSize - 1) / kWarpSize;
    const int64_t idx = lo + lane * step;
    const unsigned ok = __ballot_sync(kFull, idx < hi && cu[idx] <= row_begin);
    const int64_t last = ok ? (kWarpSize - 1 - __clz(ok)) : 0;
    lo = lo + last * step;
    hi = min(hi, lo + step);
  }

  // The walk: bnd holds cu[base + lane] for the 32 offsets from base, broadcast by shuffles, so a
  // run of short chunks costs one load per 31 chunks.
  int64_t base = lo;
  int32_t bnd = cu[min(base + lane, n_chunks)];
  int64_t r = row_begin;
  for (int64_t c = lo; c < n_chunks && r < row_end; ++c) {  // warp-uniform loop
    if (c + 1 - base >= kWarpSize) {
      base = c;
      bnd = cu[min(base + lane, n_chunks)];
    }
    const int64_t ra = __shfl_sync(kFull, bnd, static_cast<int>(c - base));
    const int64_t rb = __shfl_sync(kFull, bnd, static_cast<int>(c + 1 - base));
    const int64_t a = min(max(ra, int64_t{0}), end_rows);  // clamped like chunk_rows()
    const int64_t b = min(max(rb, a), end_rows);
    if (b <= r) continue;  // empty chunk: its zero row is written by the fixup kernel
    const int64_t e = min(b, row_end);
    if (active) {
      float acc[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
      const Raw* p = hidden + r * ld + col;
      int64_t t = r;
      for (; t + kUnroll <= e; t += kUnroll, p += kUnroll * ld) {
        float v[kUnroll][VEC];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) load_vec<Tag, VEC>(p + u * ld, v[u]);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[k] += v[u][k];
      }
      for (; t < e; ++t, p += ld) {
        float v[VEC];
        load_vec<Tag, VEC>(p, v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] += v[k];
      }
      if (a >= row_begin && b <= row_end) {  // the whole chunk is in this range: final value
        const float len = static_cast<float>(b - a);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = acc[k] / len;
        store_vec<VEC>(out + c * H + col, acc);
      } else {  // a piece of a chunk that spans ranges
        const int64_t slot = (r == row_begin) ? 0 : 1;
        store_vec<VEC>(partial + (range * 2 + slot) * H + col, acc);
      }
    }
    r = e;
  }
}

template <int VEC>
__global__ void __launch_bounds__(kPoolThreads)
    pool_mean_fixup_kernel(const int32_t* __restrict__ cu, int64_t n_chunks, int64_t n_rows, int64_t H, int64_t R,
                           int64_t n_tiles, const float* __restrict__ partial, float* __restrict__ out) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kPoolWarps + threadIdx.x / kWarpSize;
  if (task >= n_chunks * n_tiles) return;
  const int64_t c = task / n_tiles;
  const int64_t col = ((task % n_tiles) * kWarpSize + lane) * VEC;
  if (col >= H) return;
  int64_t a, b;
  chunk_rows(cu, c, covered_rows(cu, n_chunks, n_rows), a, b);
  float acc[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
  if (b <= a) {  // empty chunk (outside the contract): zero vector
    store_vec<VEC>(out + c * H + col, acc);
    return;
  }
  const int64_t ra = a / R, rb = (b - 1) / R;
  if (ra == rb) return;  // written by pool_mean_kernel
  add_vec<VEC>(acc, partial + (ra * 2 + (a == ra * R ? 0 : 1)) * H + col);
  for (int64_t q = ra + 1; q <= rb; ++q) add_vec<VEC>(acc, partial + (q * 2) * H + col);
  const float len = static_cast<float>(b - a);
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = acc[k] / len;
  store_vec<VEC>(out + c * H + col, acc);
}

template <typename Tag, int VEC>
__global__ void __launch_bounds__(kPoolThreads)
    pool_row_kernel(const typename Tag::raw* __restrict__ hidden, int64_t ld, const int32_t* __restrict__ cu,
                    int64_t n_chunks, int64_t n_rows, int64_t H, int64_t n_tiles, bool last, float* __restrict__ out) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kPoolWarps + threadIdx.x / kWarpSize;
  if (task >= n_chunks * n_tiles) return;
  const int64_t c = task / n_tiles;
  const int64_t col = ((task % n_tiles) * kWarpSize + lane) * VEC;
  if (col >= H) return;
  int64_t a, b;
  chunk_rows(cu, c, covered_rows(cu, n_chunks, n_rows), a, b);
  float v[VEC];
  if (b <= a) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = 0.f;
  } else {
    load_vec<Tag, VEC>(hidden + (last ? b - 1 : a) * ld + col, v);
  }
  store_vec<VEC>(out + c * H + col, v);
}

int sm_count(int device) {
  static int cache[64] = {0};
  if (device < 0 || device >= 64) return 132;
  if (cache[device] == 0) {
    int v = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
    cache[device] = v > 0 ? v : 1;
  }
  return cache[device];
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline unsigned int blocks_for(int64_t warp_tasks) {
  const int64_t blocks = ceil_div(warp_tasks, kPoolWarps);
  TORCH_CHECK(blocks <= INT32_MAX, "dice_fast_C: input too large for one launch");
  return static_cast<unsigned int>(blocks);
}

template <typename Tag, int VEC>
void launch_pool(const at::Tensor& hidden, const at::Tensor& cu_seqlens, Pooling pooling, at::Tensor& out) {
  using Raw = typename Tag::raw;
  const Raw* x = reinterpret_cast<const Raw*>(hidden.const_data_ptr());
  const int64_t ld = hidden.stride(0), T = hidden.size(0), H = hidden.size(1);
  const int64_t n = cu_seqlens.size(0) - 1;
  const int32_t* cu = cu_seqlens.const_data_ptr<int32_t>();
  float* o = out.mutable_data_ptr<float>();
  const int64_t n_tiles = ceil_div(H, int64_t{kWarpSize} * VEC);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  if (pooling != Pooling::kMean) {
    pool_row_kernel<Tag, VEC><<<blocks_for(n * n_tiles), kPoolThreads, 0, stream>>>(
        x, ld, cu, n, T, H, n_tiles, pooling == Pooling::kLast, o);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }

  // rows per warp task: the largest power of two in [32, 2048] leaving >= 16 tasks per SM
  const int64_t target = int64_t{16} * sm_count(hidden.get_device());
  int64_t R = 2048;
  while (R > 32 && ceil_div(T, R) * n_tiles < target) R /= 2;
  const int64_t n_ranges = ceil_div(T, R);
  at::Tensor partial = at::empty({std::max<int64_t>(n_ranges, 1) * 2, H}, out.options());
  float* ws = partial.mutable_data_ptr<float>();
  if (n_ranges > 0) {
    pool_mean_kernel<Tag, VEC><<<blocks_for(n_ranges * n_tiles), kPoolThreads, 0, stream>>>(
        x, ld, cu, n, T, H, R, n_ranges, n_tiles, o, ws);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  pool_mean_fixup_kernel<VEC><<<blocks_for(n * n_tiles), kPoolThreads, 0, stream>>>(cu, n, T, H, R, n_tiles, ws, o);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Tag>
void dispatch_vec(const at::Tensor& hidden, const at::Tensor& cu_seqlens, Pooling pooling, at::Tensor& out) {
  constexpr int kVec = 16 / sizeof(typename Tag::raw);
  const bool aligned = hidden.size(1) % kVec == 0 && hidden.stride(0) % kVec == 0 &&
                       reinterpret_cast<uintptr_t>(hidden.const_data_ptr()) % 16 == 0;
  if (aligned) launch_pool<Tag, kVec>(hidden, cu_seqlens, pooling, out);
  else launch_pool<Tag, 1>(hidden, cu_seqlens, pooling, out);
}

// ------------------------------------------------------------------------------------------------
// aggregate_documents
// ------------------------------------------------------------------------------------------------
constexpr int kDocThreads = 128;   // coefficient / normalisation blocks
constexpr int kAccWarps = 8;       // warps splitting one document's chunks in the accumulation
constexpr int kAccUnroll = 4;      // chunks in flight per warp

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Deterministic block reductions (fixed shuffle tree). Every thread of the block must call them.
template <bool kMax>
__device__ float block_reduce(float v, float* smem /* >= 32 floats */) {
  const int lane = threadIdx.x % kWarpSize, wid = threadIdx.x / kWarpSize;
  const int nw = (blockDim.x + kWarpSize - 1) / kWarpSize;
  v = kMax ? warp_max(v) : warp_sum(v);
  if (lane == 0) smem[wid] = v;
  __syncthreads();
  if (wid == 0) {
    float w = lane < nw ? smem[lane] : (kMax ? -INFINITY : 0.f);
    w = kMax ? warp_max(w) : warp_sum(w);
    if (lane == 0) smem[32] = w;
  }
  __syncthreads();
  const float r = smem[32];
  __syncthreads();
  return r;
}

__device__ __forceinline__ void doc_chunks(const int64_t* __restrict__ cu_doc, int64_t d, int64_t n_chunks, int64_t& a,
                                           int64_t& b) {
  a = min(max(cu_doc[d], int64_t{0}), n_chunks);
  b = min(max(cu_doc[d + 1], a), n_chunks);
}

template <int VEC>
__global__ void __launch_bounds__(kPoolThreads)
    chunk_norms_kernel(const float* __restrict__ x, int64_t ld, int64_t n, int64_t H, float* __restrict__ norms) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kPoolWarps + threadIdx.x / kWarpSize;
  if (i >= n) return;  // whole warp
  const float* row = x + i * ld;
  float s = 0.f;
  for (int64_t j = int64_t{lane} * VEC; j < H; j += int64_t{kWarpSize} * VEC) {
    float v[VEC];
    load_vec<F32, VEC>(row + j, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) s = fmaf(v[k], v[k], s);
  }
  s = warp_sum(s);
  if (lane == 0) norms[i] = sqrtf(s);
}

// One block per document: coef[i] for its chunks (0 = not selected by topk_norm) and the divisor
// post[d] of the document's sum (as in the reference: mean = sum / n, weighted = sum / sum(w)).
// topk_norm / softmax_norm use the norms as pooled (before normalize_chunks), like the spec.
__global__ void __launch_bounds__(kDocThreads)
    doc_coef_kernel(const int64_t* __restrict__ cu_doc, int64_t n_chunks, const float* __restrict__ norms,
                    const float* __restrict__ weights, int agg, int64_t top_k, float temperature,
                    float* __restrict__ coef, float* __restrict__ post) {
  __shared__ float smem[33];
  int64_t a, b;
  doc_chunks(cu_doc, blockIdx.x, n_chunks, a, b);
  const int64_t n = b - a;
  float divisor = 1.f;
  switch (static_cast<Aggregation>(agg)) {
    case Aggregation::kMean:
      for (int64_t i = a + threadIdx.x; i < b; i += blockDim.x) coef[i] = 1.f;
      divisor = static_cast<float>(n);
      break;
    case Aggregation::kMax:
      for (int64_t i = a + threadIdx.x; i < b; i += blockDim.x) coef[i] = 1.f;
      break;
    case Aggregation::kWeightedMean: {
      float s = 0.f;
      for (int64_t i = a + threadIdx.x; i < b; i += blockDim.x) {
        coef[i] = weights[i];
        s += weights[i];
      }
      divisor = fmaxf(block_reduce<false>(s, smem), kEpsF);
      break;
    }
    case Aggregation::kTopkNorm: {
      const int64_t k = top_k < n ? top_k : n;
      for (int64_t i = a + threadIdx.x; i < b; i += blockDim.x) {
        float c = 1.f;
        if (k < n) {  // rank = chunks before i in (norm descending, index ascending); NaN counts as largest
          const float ei = isnan(norms[i]) ? INFINITY : norms[i];
          int64_t rank = 0;
          for (int64_t j = a; j < b && rank < k; ++j) {
            const float ej = isnan(norms[j]) ? INFINITY : norms[j];
            rank += (ej > ei || (ej == ei && j < i)) ? 1 : 0;
          }
          if (rank >= k) c = 0.f;
        }
        coef[i] = c;
      }
      divisor = static_cast<float>(k);
      break;
    }
    case Aggregation::kSoftmaxNorm: {
      float m = -INFINITY;
      for (int64_t i = a + threadIdx.x; i < b; i += blockDim.x) m = fmaxf(m, norms[i] / temperature);
      m = block_reduce<true>(m, smem);
      float z = 0.f;
      for (int64_t i = a + threadIdx.x; i < b; i += blockDim.x) z += expf(norms[i] / temperature - m);
      z = block_reduce<false>(z, smem);
      for (int64_t i = a + threadIdx.x; i < b; i += blockDim.x) coef[i] = expf(norms[i] / temperature - m) / z;
      break;
    }
  }
  if (threadIdx.x == 0) post[blockIdx.x] = n > 0 ? divisor : 1.f;
}

__device__ __forceinline__ float max_nan(float acc, float v) { return (v > acc || isnan(v)) ? v : acc; }

// grid (n_docs, column tiles); block (32, kAccWarps): warp y takes chunks a + y, a + y + kAccWarps, ...
// normalize_chunks divides each chunk by max(norm, eps) (like F.normalize) before weighting.
template <int VEC>
__global__ void __launch_bounds__(kWarpSize * kAccWarps)
    doc_accumulate_kernel(const float* __restrict__ x, int64_t ld, const int64_t* __restrict__ cu_doc,
                          int64_t n_chunks, const float* __restrict__ coef, const float* __restrict__ post,
                          const float* __restrict__ norms, int64_t H, bool is_max, bool skip_zero,
                          bool normalize_chunks, float* __restrict__ out) {
  __shared__ float red[kAccWarps][kWarpSize * VEC];
  const int64_t d = blockIdx.x;
  const int64_t col = (static_cast<int64_t>(blockIdx.y) * kWarpSize + threadIdx.x) * VEC;
  int64_t a, b;
  doc_chunks(cu_doc, d, n_chunks, a, b);
  float acc[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = is_max ? -INFINITY : 0.f;
  if (col < H) {
    for (int64_t i0 = a + threadIdx.y; i0 < b; i0 += int64_t{kAccWarps} * kAccUnroll) {
      float cc[kAccUnroll], dn[kAccUnroll];
      bool use[kAccUnroll];
      float v[kAccUnroll][VEC];
#pragma unroll
      for (int u = 0; u < kAccUnroll; ++u) {
        const int64_t i = i0 + int64_t{u} * kAccWarps;
        use[u] = i < b;
        cc[u] = use[u] ? coef[i] : 0.f;
        dn[u] = (use[u] && normalize_chunks) ? fmaxf(norms[i], kEpsF) : 1.f;
        use[u] = use[u] && !(skip_zero && cc[u] == 0.f);
      }
#pragma unroll
      for (int u = 0; u < kAccUnroll; ++u)
        if (use[u]) load_vec<F32, VEC>(x + (i0 + int64_t{u} * kAccWarps) * ld + col, v[u]);
#pragma unroll
      for (int u = 0; u < kAccUnroll; ++u) {
        if (!use[u]) continue;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float vk = normalize_chunks ? v[u][k] / dn[u] : v[u][k];
          acc[k] = is_max ? max_nan(acc[k], vk) : fmaf(cc[u], vk, acc[k]);
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) red[threadIdx.y][threadIdx.x * VEC + k] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0 && col < H) {
#pragma unroll
    for (int w = 1; w < kAccWarps; ++w)
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float v = red[w][threadIdx.x * VEC + k];
        acc[k] = is_max ? max_nan(acc[k], v) : acc[k] + v;
      }
    const float p = post[d];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = (b <= a) ? 0.f : (is_max ? acc[k] : acc[k] / p);  // empty doc: zeros
    store_vec<VEC>(out + d * H + col, acc);
  }
}

__global__ void __launch_bounds__(kDocThreads) normalize_rows_kernel(float* __restrict__ out, int64_t H) {
  __shared__ float smem[33];
  float* row = out + static_cast<int64_t>(blockIdx.x) * H;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) s = fmaf(row[j], row[j], s);
  const float den = fmaxf(sqrtf(block_reduce<false>(s, smem)), kEpsF);
  for (int64_t j = threadIdx.x; j < H; j += blockDim.x) row[j] = row[j] / den;
}

}  // namespace

at::Tensor pool_chunks_cuda(const at::Tensor& hidden_in, const at::Tensor& cu_seqlens_in, c10::string_view pooling_s) {
  const Pooling pooling = check_pool_chunks_args(hidden_in, cu_seqlens_in, pooling_s);
  TORCH_CHECK(hidden_in.is_cuda(), "dice_fast_C::pool_chunks (CUDA): hidden must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(hidden_in.device());
  const at::Tensor hidden = hidden_in.stride(1) == 1 ? hidden_in : hidden_in.contiguous();
  const at::Tensor cu_seqlens = cu_seqlens_in.contiguous();
  const int64_t n = cu_seqlens.size(0) - 1, H = hidden.size(1);
  at::Tensor out = at::empty({n, H}, hidden.options().dtype(at::kFloat));
  if (n == 0 || H == 0) return out;
  switch (hidden.scalar_type()) {
    case at::kFloat: dispatch_vec<F32>(hidden, cu_seqlens, pooling, out); break;
    case at::kBFloat16: dispatch_vec<BF16>(hidden, cu_seqlens, pooling, out); break;
    case at::kHalf: dispatch_vec<F16>(hidden, cu_seqlens, pooling, out); break;
    default: TORCH_CHECK(false, "dice_fast_C::pool_chunks: unsupported dtype ", hidden.scalar_type());
  }
  return out;
}

at::Tensor aggregate_documents_cuda(const at::Tensor& chunks_in, const at::Tensor& cu_doc_chunks_in,
                                    const std::optional<at::Tensor>& chunk_weights, c10::string_view aggregation_s,
                                    int64_t top_k, double temperature, bool normalize_chunks, bool normalize) {
  const Aggregation agg =
      check_aggregate_args(chunks_in, cu_doc_chunks_in, chunk_weights, aggregation_s, top_k, temperature);
  TORCH_CHECK(chunks_in.is_cuda(), "dice_fast_C::aggregate_documents (CUDA): chunks must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(chunks_in.device());
  const at::Tensor chunks = chunks_in.stride(1) == 1 ? chunks_in : chunks_in.contiguous();
  const at::Tensor cu_doc = cu_doc_chunks_in.contiguous();
  const int64_t N = chunks.size(0), H = chunks.size(1), D = cu_doc.size(0) - 1, ld = chunks.stride(0);
  at::Tensor out = at::empty({D, H}, chunks.options());
  if (D == 0 || H == 0) return out;
  TORCH_CHECK(D <= INT32_MAX, "dice_fast_C::aggregate_documents: too many documents for one launch");

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float* x = chunks.const_data_ptr<float>();
  const int64_t* cu = cu_doc.const_data_ptr<int64_t>();
  const bool vec4 = H % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;

  const bool need_norms = normalize_chunks || agg == Aggregation::kTopkNorm || agg == Aggregation::kSoftmaxNorm;
  at::Tensor norms = at::empty({std::max<int64_t>(N, 1)}, chunks.options());
  at::Tensor coef = at::empty({std::max<int64_t>(N, 1)}, chunks.options());
  at::Tensor post = at::empty({D}, chunks.options());
  if (need_norms && N > 0) {
    const unsigned int blocks = blocks_for(N);
    if (vec4) chunk_norms_kernel<4><<<blocks, kPoolThreads, 0, stream>>>(x, ld, N, H, norms.mutable_data_ptr<float>());
    else chunk_norms_kernel<1><<<blocks, kPoolThreads, 0, stream>>>(x, ld, N, H, norms.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  at::Tensor w;
  if (agg == Aggregation::kWeightedMean) w = chunk_weights->contiguous();
  doc_coef_kernel<<<static_cast<unsigned int>(D), kDocThreads, 0, stream>>>(
      cu, N, norms.const_data_ptr<float>(), w.defined() ? w.const_data_ptr<float>() : nullptr, static_cast<int>(agg),
      top_k, static_cast<float>(temperature), coef.mutable_data_ptr<float>(), post.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const bool is_max = agg == Aggregation::kMax, skip_zero = agg == Aggregation::kTopkNorm;
  const dim3 block(kWarpSize, kAccWarps);
  const int vec = vec4 ? 4 : 1;
  const dim3 grid(static_cast<unsigned int>(D), static_cast<unsigned int>(ceil_div(H, int64_t{kWarpSize} * vec)));
  TORCH_CHECK(grid.y <= 65535, "dice_fast_C::aggregate_documents: hidden size too large (", H, ")");
  if (vec4) {
    doc_accumulate_kernel<4><<<grid, block, 0, stream>>>(x, ld, cu, N, coef.const_data_ptr<float>(),
                                                          post.const_data_ptr<float>(), norms.const_data_ptr<float>(), H,
                                                          is_max, skip_zero, normalize_chunks,
                                                          out.mutable_data_ptr<float>());
  } else {
    doc_accumulate_kernel<1><<<grid, block, 0, stream>>>(x, ld, cu, N, coef.const_data_ptr<float>(),
                                                          post.const_data_ptr<float>(), norms.const_data_ptr<float>(), H,
                                                          is_max, skip_zero, normalize_chunks,
                                                          out.mutable_data_ptr<float>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (normalize) {
    normalize_rows_kernel<<<static_cast<unsigned int>(D), kDocThreads, 0, stream>>>(out.mutable_data_ptr<float>(), H);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

}  // namespace dice_fast

TORCH_LIBRARY_IMPL(dice_fast_C, CUDA, m) {
  m.impl("pool_chunks", &dice_fast::pool_chunks_cuda);
  m.impl("aggregate_documents", &dice_fast::aggregate_documents_cuda);
}
