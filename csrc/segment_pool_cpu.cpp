// CPU twin of the segment pooling op (see segment_pool.h and dice_fast/ops/spec.py).
//
// Design
// * Inner loops run over the hidden dim with at::vec::Vectorized<float> (the build picks the widest
//   instruction set this CPU has: AVX512 / AVX2 / the portable default; see dice_fast/ops/native.py).
//   bf16 / fp16 rows are widened to float32 in registers: hidden is read exactly once, never copied.
// * Accumulation is float32. pool_chunks(mean) adds a chunk's rows one by one, in order, into a
//   float32 row accumulator that stays in L1/L2 (a whole row up to kMaxBlock floats: splitting
//   rows into narrower column blocks cost up to 2x here at H = 4096); the summation order
//   depends only on the chunk, so a chunk gives bit-identical results whichever batch or thread
//   it lands in.
// * Work is split with at::parallel_for over (chunk, column block) or (document, column block)
//   items; column blocks shrink when there are too few chunks/documents to occupy every thread
//   (e.g. one 8192-token chunk), and the grain keeps tiny inputs single-threaded.
// * Offsets are checked here (cheap on the host): out-of-range or decreasing cu_seqlens /
//   cu_doc_chunks raise instead of reading out of bounds.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "segment_pool.h"

namespace dice_fast {
namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kF = fVec::size();  // floats per vector register
constexpr int64_t kStep = 2 * kF;     // elements handled per inner-loop step (one bf16/fp16 register)
constexpr int64_t kMaxBlock = 8192;   // widest column block (32 KiB of float32 accumulator)
constexpr int64_t kMinBlock = 256;    // smallest column block when splitting columns across threads
constexpr int64_t kGrainElems = 32768;  // ~elements read per parallel task before threads pay off

static_assert(at::vec::Vectorized<at::BFloat16>::size() == kStep, "bf16 vector must widen to two float vectors");
static_assert(at::vec::Vectorized<at::Half>::size() == kStep, "fp16 vector must widen to two float vectors");
static_assert(kMinBlock % kStep == 0 && kMaxBlock % kStep == 0, "column blocks must be whole vector steps");

// Load kStep consecutive elements as two float vectors.
inline void load2(const float* p, fVec& lo, fVec& hi) {
  lo = fVec::loadu(p);
  hi = fVec::loadu(p + kF);
}
inline void load2(const at::BFloat16* p, fVec& lo, fVec& hi) { at::vec::load_to_float(p, lo, hi); }
inline void load2(const at::Half* p, fVec& lo, fVec& hi) { at::vec::load_to_float(p, lo, hi); }

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_f(at::Half v) { return static_cast<float>(v); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Column block width for n_items rows of work over H columns: as wide as possible (<= kMaxBlock),
// narrower when there are too few items to give every thread some work.
inline int64_t column_block(int64_t n_items, int64_t H) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t bw = std::min<int64_t>(kMaxBlock, ceil_div(H, kStep) * kStep);
  while (bw > kMinBlock && n_items * ceil_div(H, bw) < 4 * threads) bw = ceil_div(bw / 2, kStep) * kStep;
  return std::max<int64_t>(bw, kStep);
}

inline int64_t grain_for(int64_t elems_per_item) {
  return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, elems_per_item));
}

// acc[0:w] = sum of rows r0..r1-1 of x[:, 0:w] (row stride ld), float32, rows added in order.
// One row per pass over acc (acc stays in L1): walking several rows at once was 2x slower here
// (AMD EPYC, 131072 x 384 fp32: 1 row/pass 20-25 ms = the plain streaming sum, 4 rows/pass 34-55 ms),
// the interleaved streams defeat the hardware prefetcher.
template <typename T>
void sum_rows(const T* x, int64_t ld, int64_t r0, int64_t r1, int64_t w, float* acc) {
  std::fill(acc, acc + w, 0.f);
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * ld;
    int64_t j = 0;
    for (; j + kStep <= w; j += kStep) {
      fVec lo, hi;
      load2(xr + j, lo, hi);
      (fVec::loadu(acc + j) + lo).store(acc + j);
      (fVec::loadu(acc + j + kF) + hi).store(acc + j + kF);
    }
    for (; j < w; ++j) acc[j] += to_f(xr[j]);
  }
}

// out[0:w] = float(x[0:w])
template <typename T>
void convert_row(const T* x, int64_t w, float* out) {
  int64_t j = 0;
  for (; j + kStep <= w; j += kStep) {
    fVec lo, hi;
    load2(x + j, lo, hi);
    lo.store(out + j);
    hi.store(out + j + kF);
  }
  for (; j < w; ++j) out[j] = to_f(x[j]);
}

// x[0:w] /= d
void divide_row(float* x, int64_t w, float d) {
  const fVec dv(d);
  int64_t j = 0;
  for (; j + kF <= w; j += kF) (fVec::loadu(x + j) / dv).store(x + j);
  for (; j < w; ++j) x[j] = x[j] / d;
}

// sum(x[0:w]^2) with float32 vector lanes, reduced in double in a fixed order (deterministic per row).
double sum_squares(const float* x, int64_t w) {
  fVec a0(0.f), a1(0.f);
  int64_t j = 0;
  for (; j + kStep <= w; j += kStep) {
    const fVec l = fVec::loadu(x + j), h = fVec::loadu(x + j + kF);
    a0 = at::vec::fmadd(l, l, a0);
    a1 = at::vec::fmadd(h, h, a1);
  }
  float lanes[kF];
  (a0 + a1).store(lanes);
  double s = 0.0;
  for (int64_t t = 0; t < kF; ++t) s += lanes[t];
  for (; j < w; ++j) s += static_cast<double>(x[j]) * x[j];
  return s;
}

template <typename T>
void pool_chunks_kernel(const at::Tensor& hidden, const int32_t* cu, int64_t n_chunks, Pooling pooling,
                        at::Tensor& out) {
  const T* x = hidden.const_data_ptr<T>();
  const int64_t ld = hidden.stride(0);
  const int64_t H = hidden.size(1);
  float* o = out.mutable_data_ptr<float>();

  if (pooling != Pooling::kMean) {
    at::parallel_for(0, n_chunks, grain_for(H), [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t a = cu[c], b = cu[c + 1];
        float* oc = o + c * H;
        if (a == b) {  // empty chunk (outside the contract): zero vector
          std::fill(oc, oc + H, 0.f);
          continue;
        }
        convert_row(x + (pooling == Pooling::kCls ? a : b - 1) * ld, H, oc);
      }
    });
    return;
  }

  const int64_t total = cu[n_chunks];
  const int64_t bw = column_block(n_chunks, H);
  const int64_t nb = ceil_div(H, bw);
  const int64_t avg_rows = std::max<int64_t>(1, total / std::max<int64_t>(1, n_chunks));
  at::parallel_for(0, n_chunks * nb, grain_for(avg_rows * std::min(bw, H)), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / nb;
      const int64_t j0 = (item % nb) * bw;
      const int64_t w = std::min(bw, H - j0);
      const int64_t a = cu[c], b = cu[c + 1];
      float* oc = o + c * H + j0;
      sum_rows(x + j0, ld, a, b, w, oc);
      if (b > a) divide_row(oc, w, static_cast<float>(b - a));
    }
  });
}

}  // namespace

at::Tensor pool_chunks_cpu(const at::Tensor& hidden_in, const at::Tensor& cu_seqlens_in, c10::string_view pooling_s) {
  const Pooling pooling = check_pool_chunks_args(hidden_in, cu_seqlens_in, pooling_s);
  TORCH_CHECK(hidden_in.device().is_cpu(), "dice_fast_C::pool_chunks (CPU): hidden must be a CPU tensor");
  const at::Tensor hidden = hidden_in.stride(1) == 1 ? hidden_in : hidden_in.contiguous();
  const at::Tensor cu_seqlens = cu_seqlens_in.contiguous();
  const int64_t n_chunks = cu_seqlens.size(0) - 1;
  const int64_t T = hidden.size(0), H = hidden.size(1);
  const int32_t* cu = cu_seqlens.const_data_ptr<int32_t>();

  TORCH_CHECK(cu[0] == 0, "dice_fast_C::pool_chunks: cu_seqlens[0] must be 0, got ", cu[0]);
  for (int64_t c = 0; c < n_chunks; ++c) {
    TORCH_CHECK(cu[c + 1] >= cu[c], "dice_fast_C::pool_chunks: cu_seqlens must be non-decreasing, got cu_seqlens[",
                c, "] = ", cu[c], " > cu_seqlens[", c + 1, "] = ", cu[c + 1]);
  }
  TORCH_CHECK(cu[n_chunks] <= T, "dice_fast_C::pool_chunks: cu_seqlens[-1] = ", cu[n_chunks],
              " exceeds the number of token rows in hidden (", T, ")");

  at::Tensor out = at::empty({n_chunks, H}, hidden.options().dtype(at::kFloat));
  if (n_chunks == 0 || H == 0) return out;
  switch (hidden.scalar_type()) {
    case at::kFloat: pool_chunks_kernel<float>(hidden, cu, n_chunks, pooling, out); break;
    case at::kBFloat16: pool_chunks_kernel<at::BFloat16>(hidden, cu, n_chunks, pooling, out); break;
    case at::kHalf: pool_chunks_kernel<at::Half>(hidden, cu, n_chunks, pooling, out); break;
    default: TORCH_CHECK(false, "dice_fast_C::pool_chunks: unsupported dtype ", hidden.scalar_type());
  }
  return out;
}

at::Tensor aggregate_documents_cpu(const at::Tensor& chunks_in, const at::Tensor& cu_doc_chunks_in,
                                   const std::optional<at::Tensor>& chunk_weights, c10::string_view aggregation_s,
                                   int64_t top_k, double temperature, bool normalize_chunks, bool normalize) {
  const Aggregation agg =
      check_aggregate_args(chunks_in, cu_doc_chunks_in, chunk_weights, aggregation_s, top_k, temperature);
  TORCH_CHECK(chunks_in.device().is_cpu(), "dice_fast_C::aggregate_documents (CPU): chunks must be a CPU tensor");
  const at::Tensor chunks = chunks_in.stride(1) == 1 ? chunks_in : chunks_in.contiguous();
  const at::Tensor cu_t = cu_doc_chunks_in.contiguous();
  const int64_t N = chunks.size(0), H = chunks.size(1), D = cu_t.size(0) - 1;
  const int64_t ld = chunks.stride(0);
  const int64_t* cu = cu_t.const_data_ptr<int64_t>();

  TORCH_CHECK(cu[0] == 0, "dice_fast_C::aggregate_documents: cu_doc_chunks[0] must be 0, got ", cu[0]);
  for (int64_t d = 0; d < D; ++d) {
    TORCH_CHECK(cu[d + 1] >= cu[d], "dice_fast_C::aggregate_documents: cu_doc_chunks must be non-decreasing, got ",
                "cu_doc_chunks[", d, "] = ", cu[d], " > cu_doc_chunks[", d + 1, "] = ", cu[d + 1]);
  }
  TORCH_CHECK(cu[D] <= N, "dice_fast_C::aggregate_documents: cu_doc_chunks[-1] = ", cu[D],
              " exceeds the number of chunks (", N, ")");

  at::Tensor out = at::empty({D, H}, chunks.options());
  if (D == 0 || H == 0) return out;
  const float* x = chunks.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  const int64_t used = cu[D];  // chunks past cu[-1] belong to no document

  // 1. chunk norms as pooled (before normalize_chunks): the salience signal of topk_norm /
  //    softmax_norm, and the divisor of normalize_chunks
  const bool need_norms = normalize_chunks || agg == Aggregation::kTopkNorm || agg == Aggregation::kSoftmaxNorm;
  std::vector<double> norm(need_norms ? used : 0);
  std::vector<float> den(normalize_chunks ? used : 0);  // chunk i is aggregated as x_i / den[i]
  if (need_norms) {
    at::parallel_for(0, used, grain_for(H), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        norm[i] = std::sqrt(sum_squares(x + i * ld, H));
        if (normalize_chunks) den[i] = static_cast<float>(std::max(norm[i], kNormEps));
      }
    });
  }

  // 2. per-document selection (the chunks that contribute, in chunk order) and their weights
  at::Tensor wts_t;  // contiguous weights, kept alive for the pointer below
  if (agg == Aggregation::kWeightedMean) wts_t = chunk_weights->contiguous();
  const float* wts = wts_t.defined() ? wts_t.const_data_ptr<float>() : nullptr;
  std::vector<int64_t> sel(used);
  std::vector<float> coef(used, 0.f);
  std::vector<int64_t> count(D, 0);
  std::vector<float> post(D, 1.f);  // the document's sum is divided by post[d] (as the reference does)
  at::parallel_for(0, D, 16, [&](int64_t begin, int64_t end) {
    for (int64_t d = begin; d < end; ++d) {
      const int64_t a = cu[d], b = cu[d + 1], n = b - a;
      if (n == 0) continue;
      for (int64_t i = a; i < b; ++i) sel[i] = i;
      count[d] = n;
      switch (agg) {
        case Aggregation::kMean:
          std::fill(coef.begin() + a, coef.begin() + b, 1.f);
          post[d] = static_cast<float>(n);
          break;
        case Aggregation::kWeightedMean: {
          double wsum = 0.0;
          for (int64_t i = a; i < b; ++i) wsum += wts[i];
          for (int64_t i = a; i < b; ++i) coef[i] = wts[i];
          post[d] = static_cast<float>(std::max(wsum, kNormEps));
          break;
        }
        case Aggregation::kMax:
          std::fill(coef.begin() + a, coef.begin() + b, 1.f);
          break;
        case Aggregation::kTopkNorm: {
          const int64_t k = std::min<int64_t>(top_k, n);
          if (k < n) {
            // largest norm first, ties to the earlier chunk (NaN sorts as the largest, like torch.sort)
            auto key = [&](int64_t i) { return std::isnan(norm[i]) ? INFINITY : norm[i]; };
            std::partial_sort(sel.begin() + a, sel.begin() + a + k, sel.begin() + b, [&](int64_t i, int64_t j) {
              const double ki = key(i), kj = key(j);
              return ki > kj || (ki == kj && i < j);
            });
            std::sort(sel.begin() + a, sel.begin() + a + k);  // sum in chunk order
          }
          count[d] = k;
          for (int64_t t = a; t < a + k; ++t) coef[sel[t]] = 1.f;
          post[d] = static_cast<float>(k);
          break;
        }
        case Aggregation::kSoftmaxNorm: {
          double m = -INFINITY;
          for (int64_t i = a; i < b; ++i) m = std::max(m, norm[i] / temperature);
          double z = 0.0;
          for (int64_t i = a; i < b; ++i) z += std::exp(norm[i] / temperature - m);
          for (int64_t i = a; i < b; ++i) coef[i] = static_cast<float>(std::exp(norm[i] / temperature - m) / z);
          break;
        }
      }
    }
  });

  // 3. out[d] = sum_t coef * chunk / post (or the element-wise max of the chunks), float32, column blocks.
  //    normalize_chunks divides (like F.normalize) rather than multiplying by a reciprocal, so that
  //    e.g. opposite chunks cancel exactly as in the reference.
  const int64_t bw = column_block(D, H);
  const int64_t nb = ceil_div(H, bw);
  const int64_t avg_rows = std::max<int64_t>(1, used / D);
  const bool is_max = agg == Aggregation::kMax;
  at::parallel_for(0, D * nb, grain_for(avg_rows * std::min(bw, H)), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t d = item / nb;
      const int64_t j0 = (item % nb) * bw;
      const int64_t w = std::min(bw, H - j0);
      float* od = o + d * H + j0;
      const int64_t a = cu[d], k = count[d];
      if (k == 0) {
        std::fill(od, od + w, 0.f);
        continue;
      }
      for (int64_t t = 0; t < k; ++t) {
        const int64_t i = sel[a + t];
        const float c = coef[i], dn = normalize_chunks ? den[i] : 1.f;
        const float* xi = x + i * ld + j0;
        const fVec cv(c), dv(dn);
        auto load = [&](int64_t j) { return normalize_chunks ? fVec::loadu(xi + j) / dv : fVec::loadu(xi + j); };
        auto get = [&](int64_t j) { return normalize_chunks ? xi[j] / dn : xi[j]; };
        int64_t j = 0;
        if (is_max) {
          if (t == 0) {
            for (; j + kF <= w; j += kF) load(j).store(od + j);
            for (; j < w; ++j) od[j] = get(j);
          } else {
            for (; j + kF <= w; j += kF) at::vec::maximum(fVec::loadu(od + j), load(j)).store(od + j);
            for (; j < w; ++j) {
              const float v = get(j);
              od[j] = (v > od[j] || std::isnan(v)) ? v : od[j];
            }
          }
        } else if (t == 0) {
          for (; j + kF <= w; j += kF) (cv * load(j)).store(od + j);
          for (; j < w; ++j) od[j] = c * get(j);
        } else {
          for (; j + kF <= w; j += kF) at::vec::fmadd(cv, load(j), fVec::loadu(od + j)).store(od + j);
          for (; j < w; ++j) od[j] = std::fma(c, get(j), od[j]);
        }
      }
      if (post[d] != 1.f) divide_row(od, w, post[d]);
    }
  });

  // 4. final L2 normalisation: divide by max(norm, 1e-12)
  if (normalize) {
    at::parallel_for(0, D, grain_for(H), [&](int64_t begin, int64_t end) {
      for (int64_t d = begin; d < end; ++d) {
        float* od = o + d * H;
        const double den = std::max(std::sqrt(sum_squares(od, H)), kNormEps);
        divide_row(od, H, static_cast<float>(den));
      }
    });
  }
  return out;
}

}  // namespace dice_fast

TORCH_LIBRARY_IMPL(dice_fast_C, CPU, m) {
  m.impl("pool_chunks", &dice_fast::pool_chunks_cpu);
  m.impl("aggregate_documents", &dice_fast::aggregate_documents_cpu);
}
