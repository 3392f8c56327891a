// LayerNorm over the last dimension of bf16 activations, on CPUs with AVX-512 bf16 conversions.
//
// Why: torch's CPU layer_norm for bf16 runs its AVX2 kernel (a Welford moments pass, then a normalise
// pass, each converting bf16 to float and back through 8-lane vectors); at MiniLM's width (384) the
// 13 LayerNorms are ~7 % of the bf16 forward on an AMX Xeon (benchmarks/RESULTS.md §21). Here a row is
// read three times from L1 with 16-lane AVX-512 (sum, centred sum of squares, normalise) and written
// once, rounded to bf16 by one instruction per 16 values.
//
// Semantics are F.layer_norm's over the last dimension: y = (x - mean) * rstd * weight + bias with the
// biased variance, rstd = 1 / sqrt(var + eps); mean and variance in float32 by two passes (no
// cancellation), each output rounded once to bf16 (round to nearest even; vcvtneps2bf16 flushes
// float32 denormals to zero, outputs below 1.2e-38 in magnitude). x (..., H) bf16 contiguous;
// weight (H,) and bias (H,) or None, each bf16 or float32, contiguous; any H >= 1 (a masked tail).
//
// Compiled into dice_fast_C for every machine; the AVX-512 code only on x86-64 with GCC 11+ or Clang 12+
// (behind function target attributes). At run time `layer_norm_bf16_supported` says whether this CPU
// has avx512f / bw / vl and avx512_bf16; the op refuses to run where not.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define DICE_FAST_AVX512_BF16 1
#include <immintrin.h>
#endif

namespace dice_fast {
namespace {

constexpr int64_t kGrainElems = 16384;  // elements per parallel task before a second thread pays off

#ifdef DICE_FAST_AVX512_BF16
#define LN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

// 16 values from p (lanes past ``mask`` read as 0): bf16 widened to float32, or float32 as they are
LN_TARGET inline __m512 load16(const void* p, bool bf16, int64_t j, __mmask16 mask) {
  if (!bf16) return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + j);
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + j);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

LN_TARGET inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

LN_TARGET void normalize_rows(const uint16_t* x, uint16_t* y, const void* w, const void* b, bool w_bf16, bool b_bf16,
                              int64_t h, float eps, int64_t r0, int64_t r1) {
  const float inv_h = 1.0f / static_cast<float>(h);
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* xr = x + r * h;
    uint16_t* yr = y + r * h;
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= h; j += 32) {
      s0 = _mm512_add_ps(s0, load16(xr, true, j, 0xFFFF));
      s1 = _mm512_add_ps(s1, load16(xr, true, j + 16, 0xFFFF));
    }
    for (; j < h; j += 16) s0 = _mm512_add_ps(s0, load16(xr, true, j, lanes(h - j)));
    const float mean = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * inv_h;
    const __m512 vmean = _mm512_set1_ps(mean);
    __m512 q0 = _mm512_setzero_ps(), q1 = _mm512_setzero_ps();
    for (j = 0; j + 32 <= h; j += 32) {
      const __m512 a = _mm512_sub_ps(load16(xr, true, j, 0xFFFF), vmean);
      const __m512 c = _mm512_sub_ps(load16(xr, true, j + 16, 0xFFFF), vmean);
      q0 = _mm512_fmadd_ps(a, a, q0);
      q1 = _mm512_fmadd_ps(c, c, q1);
    }
    for (; j < h; j += 16) {
      const __mmask16 m = lanes(h - j);
      const __m512 a = _mm512_maskz_sub_ps(m, load16(xr, true, j, m), vmean);
      q0 = _mm512_fmadd_ps(a, a, q0);
    }
    const float var = _mm512_reduce_add_ps(_mm512_add_ps(q0, q1)) * inv_h;
    const __m512 vrstd = _mm512_set1_ps(1.0f / std::sqrt(var + eps));
    for (j = 0; j < h; j += 16) {
      const __mmask16 m = lanes(h - j);
      __m512 v = _mm512_mul_ps(_mm512_sub_ps(load16(xr, true, j, m), vmean), vrstd);
      v = _mm512_fmadd_ps(v, load16(w, w_bf16, j, m), b ? load16(b, b_bf16, j, m) : _mm512_setzero_ps());
      _mm256_mask_storeu_epi16(yr + j, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}
#endif

bool layer_norm_bf16_supported() {
#ifdef DICE_FAST_AVX512_BF16
  static const bool ok = cpu_has_avx512_bf16();
  return ok;
#else
  return false;
#endif
}

void check_param(const at::Tensor& p, const char* name, int64_t h) {
  TORCH_CHECK(p.device().is_cpu() && p.dim() == 1 && p.size(0) == h && p.is_contiguous(), "layer_norm_bf16: ", name,
              " must be a contiguous CPU vector of the last dimension's size ", h, ", got shape ", p.sizes());
  TORCH_CHECK(p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kFloat, "layer_norm_bf16: ", name,
              " must be bfloat16 or float32, got ", p.scalar_type());
}

at::Tensor layer_norm_bf16(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.is_contiguous(),
              "layer_norm_bf16: x must be a contiguous bfloat16 CPU tensor of at least one dimension, got ",
              x.scalar_type(), " of shape ", x.sizes());
  const int64_t h = x.size(-1);
  TORCH_CHECK(h >= 1, "layer_norm_bf16: the last dimension of x is empty");
  check_param(weight, "weight", h);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) check_param(*bias, "bias", h);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "layer_norm_bf16: eps must be finite and >= 0, got ", eps);
  TORCH_CHECK(layer_norm_bf16_supported(), "layer_norm_bf16: this CPU (or compiler) has no AVX-512 bf16; use F.layer_norm");
  at::Tensor y = at::empty_like(x);
  const int64_t rows = x.numel() / h;
  if (rows == 0) return y;
#ifdef DICE_FAST_AVX512_BF16
  const auto* xd = reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>());
  auto* yd = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  const void* wd = weight.const_data_ptr();
  const void* bd = has_bias ? bias->const_data_ptr() : nullptr;
  const bool w_bf16 = weight.scalar_type() == at::kBFloat16;
  const bool b_bf16 = has_bias && bias->scalar_type() == at::kBFloat16;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElems / h), [&](int64_t r0, int64_t r1) {
    normalize_rows(xd, yd, wd, bd, w_bf16, b_bf16, h, e, r0, r1);
  });
#endif
  return y;
}

}  // namespace
}  // namespace dice_fast

TORCH_LIBRARY_FRAGMENT(dice_fast_C, m) {
  m.def("layer_norm_bf16_supported() -> bool", &dice_fast::layer_norm_bf16_supported);
  m.def("layer_norm_bf16(Tensor x, Tensor weight, Tensor? bias, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(dice_fast_C, CPU, m) {
  m.impl("layer_norm_bf16", &dice_fast::layer_norm_bf16);
}
