// Dense bf16 attention on Intel AMX: softmax(scale * Q K^T) V for runs of equal-length chunks.
//
// Why: on an AMX Xeon, torch's CPU flash attention runs bf16 with head size 32 through one small
// oneDNN gemm call per (query block, key block) and a softmax pass between them; at MiniLM's shapes
// (n x 12 heads x 256 tokens x 32) it is ~31% of the bf16 forward (benchmarks/RESULTS.md §19). Here
// a (chunk, head) is one task: K and V are packed once into AMX's tile layouts, then per block of 32
// query rows (16 at D = 64) the scores (rows x L, float32) are one row of tile products, the softmax
// runs on them in L1 in float32, and P (rounded to bf16, as torch's flash kernel does) times V is a
// second row of tile products; each output row is scaled by 1 / sum and rounded once to bf16.
//
// Semantics are SDPA's without mask, dropout or causality: q, k, v (n, H, L, D) bf16, any strides
// with the last one 1; D 32 or 64 (AMX's bf16 tile holds 32 of the reduction dim; MiniLM has 32,
// BERT-base and MPNet 64); L up to 1024; scale > 0. out (n, H, L, D) bf16, written in place (a view
// of the engine's packed output; it may not overlap itself or the inputs). Accumulation is float32
// everywhere; exp is a float32 polynomial (relative error 2.7e-6).
//
// Compiled into dice_fast_C for every machine; the AMX code only on x86-64 Linux with GCC 11+ or
// Clang 12+ (behind function target attributes, so the library builds for any vector ISA). At run
// time `amx_attention_supported` says whether this CPU and kernel (Linux's permission for the tile
// data) can run it, and the op refuses to run where not.
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <cstring>
#include <vector>

// AMX intrinsics and __builtin_cpu_supports("amx-bf16") need GCC 11 / Clang 12 or newer
#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define DICE_FAST_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace dice_fast {
namespace {

constexpr int64_t kMaxLen = 1024;
constexpr int64_t kMaxHead = 64;

#ifdef DICE_FAST_AMX
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

// Linux gives a process AMX's tile data only when asked (arch_prctl ARCH_REQ_XCOMP_PERM).
bool request_tile_permission() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool cpu_has_amx_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

bool amx_ready() {
  static const bool ready = cpu_has_amx_bf16() && request_tile_permission();
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// every tile 16 rows x 64 bytes: A (16 x 32 bf16), B (16 row-pairs x 16 columns of bf16 pairs), C (16 x 16 fp32)
// ldtilecfg / sttilecfg with the whole 64-byte configuration as the memory operand: GCC 12's
// _tile_loadconfig / _tile_storeconfig declare only its first 8 bytes, so the stores of the rows and
// column widths were dead to the optimizer and could be dropped (they were, once a helper was split
// out: tileloadd then raised SIGILL on an unconfigured palette)
AMX_TARGET inline void load_tile_config(const TileConfig& cfg) { __asm__ volatile("ldtilecfg %0" ::"m"(cfg)); }
AMX_TARGET inline void store_tile_config(TileConfig& cfg) { __asm__ volatile("sttilecfg %0" : "=m"(cfg)); }

AMX_TARGET void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  load_tile_config(cfg);
}

// this thread's tiles configured for the kernel while in scope (exceptions included). Another
// library's kernels (oneDNN, inductor) may keep the thread's tile configuration between their calls,
// so it is put back as found; tile data is never kept across calls, only the palette.
struct TileScope {
  TileConfig saved;
  AMX_TARGET TileScope() {
    store_tile_config(saved);
    configure_tiles();
  }
  AMX_TARGET ~TileScope() {
    if (saved.palette_id != 0)
      load_tile_config(saved);
    else
      _tile_release();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// 2^t for float32 lanes (t <= 0, or -inf / NaN in lanes the caller masks off): 2^n * 2^f with n the
// nearest integer and f in [-0.5, 0.5], 2^f by a degree-4 polynomial fitted for relative error on that
// interval (max 2.7e-6, under float32's 6e-8 x 45: far below the bf16 rounding of P, 2e-3)
AMX_TARGET inline __m512 exp2_ps(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.570102207362652e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591786280274391e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40247443318367e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931217908859253e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999992847442627e-1f));
  return _mm512_scalef_ps(p, n);
}

// one (chunk, head): q, k, v, o point at row 0 of the head, rows `*_row` elements apart
struct HeadTask {
  const c10::BFloat16* q;
  const c10::BFloat16* k;
  const c10::BFloat16* v;
  c10::BFloat16* o;
  int64_t q_row, k_row, v_row, o_row;
};

// per thread, reused across its tasks (sizes for the longest length and widest head)
struct Scratch {
  std::vector<uint32_t> kp;     // K as B tiles: [key block of 16][d step of 32][16 rows][16 dword pairs]
  std::vector<uint32_t> vp;     // V as B tiles: [key step of 32][d block of 16][16 rows][16 dword pairs]
  std::vector<float> scores;    // [rows][lk] float32 (rows: 32 query rows at D = 32, 16 at D = 64)
  std::vector<uint16_t> probs;  // [rows][lk] bf16 bits
  std::vector<float> acc;       // [4][16][16] float32: the output block's product tiles
  std::vector<uint16_t> qpad;   // [rows][D] bf16 bits: a last query block shorter than the others
};

// query rows [m0, m0 + rows) of a block of ``block`` rows as a tile source (base, row stride in bytes):
// the head's own rows when the block is full, else a copy in ``qpad`` with zero rows after them
std::pair<const char*, int64_t> query_block(const HeadTask& t, int64_t m0, int64_t rows, int64_t block, int64_t d,
                                            std::vector<uint16_t>& qpad) {
  if (rows == block) return {reinterpret_cast<const char*>(t.q + m0 * t.q_row), t.q_row * 2};
  std::fill(qpad.begin(), qpad.end(), uint16_t{0});
  for (int64_t i = 0; i < rows; ++i) std::memcpy(qpad.data() + i * d, t.q + (m0 + i) * t.q_row, d * 2);
  return {reinterpret_cast<const char*>(qpad.data()), d * 2};
}

// K's B tiles: tile (kb, ds), row r, column c = the bf16 pair K[16kb + c][32ds + 2r : 32ds + 2r + 2],
// one 16-lane gather per row (keys past len read as 0)
AMX_TARGET void pack_k(const HeadTask& t, int64_t len, int64_t dsteps, uint32_t* kp) {
  const __m512i keys = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(t.k_row * 2)));
  for (int64_t kb = 0; kb * 16 < len; ++kb) {
    const __mmask16 valid = static_cast<__mmask16>(len - kb * 16 >= 16 ? 0xFFFF : (1u << (len - kb * 16)) - 1u);
    const char* base = reinterpret_cast<const char*>(t.k + kb * 16 * t.k_row);
    for (int64_t ds = 0; ds < dsteps; ++ds) {
      uint32_t* tile = kp + (kb * dsteps + ds) * 256;
      for (int64_t r = 0; r < 16; ++r) {
        const __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, keys,
                                                           base + (32 * ds + 2 * r) * 2, 1);
        _mm512_storeu_si512(tile + r * 16, pairs);
      }
    }
  }
}

// V's B tiles: tile (ks, db), row r, column c = (V[32ks + 2r][16db + c], V[32ks + 2r + 1][16db + c]):
// two key rows interleaved by one permute per 16 columns (keys past len are 0)
AMX_TARGET void pack_v(const HeadTask& t, int64_t len, int64_t lk, int64_t dblocks, uint32_t* vp) {
  __m512i lo_idx, hi_idx;  // interleave columns 0-15 / 16-31 of two 32-column rows a (even), b (odd)
  {
    alignas(64) uint16_t lo[32], hi[32];
    for (int c = 0; c < 16; ++c) {
      lo[2 * c] = c, lo[2 * c + 1] = 32 + c;
      hi[2 * c] = 16 + c, hi[2 * c + 1] = 48 + c;
    }
    lo_idx = _mm512_load_si512(lo);
    hi_idx = _mm512_load_si512(hi);
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j = 0; j < lk; j += 2) {
    const int64_t ks = j / 32, r = (j % 32) / 2;
    for (int64_t half = 0; half < dblocks / 2; ++half) {  // 32 columns of each of the two rows
      const __m512i a = j < len ? _mm512_loadu_si512(t.v + j * t.v_row + 32 * half) : zero;
      const __m512i b = j + 1 < len ? _mm512_loadu_si512(t.v + (j + 1) * t.v_row + 32 * half) : zero;
      _mm512_storeu_si512(vp + (ks * dblocks + 2 * half) * 256 + r * 16, _mm512_permutex2var_epi16(a, lo_idx, b));
      _mm512_storeu_si512(vp + (ks * dblocks + 2 * half + 1) * 256 + r * 16, _mm512_permutex2var_epi16(a, hi_idx, b));
    }
  }
}

// softmax of ``nrows`` score rows (scale folded into the exponent): P rows as bf16, 0 past len up to lk (the
// pad block of the last 32-key step), and 1 / sum per row
AMX_TARGET void softmax_rows(float* scores, uint16_t* probs, int64_t nrows, int64_t len, int64_t lk, float scale,
                             float* inv_sum) {
  const int64_t full = len / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - full)) - 1u);
  const float c = scale * 1.44269504088896341f;  // exp(scale * x) = 2^(c x)
  const __m512 vc = _mm512_set1_ps(c);
  for (int64_t i = 0; i < nrows; ++i) {
    const float* srow = scores + i * lk;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < full; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(srow + j));
    if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_loadu_ps(srow + full));
    const __m512 shift = _mm512_set1_ps(-c * _mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    uint16_t* prow = probs + i * lk;
    int64_t j = 0;
    for (; j + 32 <= full; j += 32) {  // two vectors rounded to bf16 by one instruction
      const __m512 e0 = exp2_ps(_mm512_fmadd_ps(_mm512_loadu_ps(srow + j), vc, shift));
      const __m512 e1 = exp2_ps(_mm512_fmadd_ps(_mm512_loadu_ps(srow + j + 16), vc, shift));
      sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
      _mm512_storeu_si512(prow + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    for (; j < full; j += 16) {
      const __m512 e = exp2_ps(_mm512_fmadd_ps(_mm512_loadu_ps(srow + j), vc, shift));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (tail) {
      const __m512 e = _mm512_maskz_mov_ps(tail, exp2_ps(_mm512_fmadd_ps(_mm512_loadu_ps(srow + full), vc, shift)));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + full), (__m256i)_mm512_cvtneps_pbh(e));
    }
    inv_sum[i] = 1.0f / _mm512_reduce_add_ps(sum);
    if (lk - (full + (tail ? 16 : 0)) == 16) std::fill_n(prow + lk - 16, 16, uint16_t{0});
  }
}

// tiles: 0-1 Q's d steps (then P's key step), 2-3 B operands (K or V), 4-7 products
// one head's set-up, whatever its width ``d``: K and V packed into their tiles, the scratch sized for
// query blocks of ``block_rows``; returns (key blocks of 16, keys padded to the P V reduction step of 32)
AMX_TARGET std::pair<int64_t, int64_t> prepare_head(const HeadTask& t, int64_t len, int64_t d, int64_t block_rows,
                                                    Scratch& s) {
  const int64_t key_blocks = (len + 15) / 16;
  const int64_t lk = (len + 31) / 32 * 32;
  s.kp.resize(key_blocks * (d / 32) * 256);
  s.vp.resize(lk / 32 * (d / 16) * 256);
  pack_k(t, len, d / 32, s.kp.data());
  pack_v(t, len, lk, d / 16, s.vp.data());
  s.scores.resize(block_rows * lk);
  s.probs.resize(block_rows * lk);
  s.acc.resize(4 * 256);
  s.qpad.resize(block_rows * d);
  return {key_blocks, lk};
}

// the output block: product tiles 4-7 into acc (as [row half][d block][16][16] float32, ``dblocks`` d
// blocks per half), times 1 / sum, two d blocks rounded to bf16 per instruction, into rows m0.. of out
AMX_TARGET void store_output(const HeadTask& t, int64_t m0, int64_t rows, int64_t dblocks, const float* inv_sum,
                             float* acc) {
  _tile_stored(4, acc, 64);
  _tile_stored(5, acc + 256, 64);
  _tile_stored(6, acc + 512, 64);
  _tile_stored(7, acc + 768, 64);
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 inv = _mm512_set1_ps(inv_sum[i]);
    const float* row = acc + (i / 16) * dblocks * 256 + (i % 16) * 16;
    c10::BFloat16* orow = t.o + (m0 + i) * t.o_row;
    for (int64_t db = 0; db < dblocks; db += 2) {
      const __m512 lo = _mm512_mul_ps(_mm512_loadu_ps(row + db * 256), inv);
      const __m512 hi = _mm512_mul_ps(_mm512_loadu_ps(row + (db + 1) * 256), inv);
      _mm512_storeu_si512(orow + db * 16, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// tile C += Q (tiles 0-1, two d steps) times K's key block KB, through B tile B
#define DF_QK_BLOCK(C, B, KB)                                  \
  do {                                                         \
    _tile_loadd(B, s.kp.data() + (KB) * 2 * 256, 64);         \
    _tile_dpbf16ps(C, 0, B);                                   \
    _tile_loadd(B, s.kp.data() + ((KB) * 2 + 1) * 256, 64);   \
    _tile_dpbf16ps(C, 1, B);                                   \
  } while (0)

// D = 64: blocks of 16 query rows; Q takes tiles 0-1 (two d steps), the four d blocks of the output
// accumulate in tiles 4-7 (four independent chains)
AMX_TARGET void attend_head_d64(const HeadTask& t, int64_t len, float scale, Scratch& s) {
  const auto [key_blocks, lk] = prepare_head(t, len, 64, 16, s);
  float inv_sum[16];

  for (int64_t m0 = 0; m0 < len; m0 += 16) {
    const int64_t rows = std::min<int64_t>(16, len - m0);
    const auto [qb, qstride] = query_block(t, m0, rows, 16, 64, s.qpad);
    _tile_loadd(0, qb, qstride);
    _tile_loadd(1, qb + 64, qstride);
    // scores = Q K^T, four key blocks at a time into tiles 4-7
    int64_t kb = 0;
    for (; kb + 4 <= key_blocks; kb += 4) {
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      DF_QK_BLOCK(4, 2, kb);
      DF_QK_BLOCK(5, 3, kb + 1);
      DF_QK_BLOCK(6, 2, kb + 2);
      DF_QK_BLOCK(7, 3, kb + 3);
      _tile_stored(4, s.scores.data() + kb * 16, lk * 4);
      _tile_stored(5, s.scores.data() + (kb + 1) * 16, lk * 4);
      _tile_stored(6, s.scores.data() + (kb + 2) * 16, lk * 4);
      _tile_stored(7, s.scores.data() + (kb + 3) * 16, lk * 4);
    }
    for (; kb < key_blocks; ++kb) {
      _tile_zero(4);
      DF_QK_BLOCK(4, 2, kb);
      _tile_stored(4, s.scores.data() + kb * 16, lk * 4);
    }
    softmax_rows(s.scores.data(), s.probs.data(), 16, len, lk, scale, inv_sum);
    // out = P V: each key step's P into tile 0, V's tiles alternating 2 / 3, d blocks accumulate in 4-7
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (int64_t ks = 0; ks < lk / 32; ++ks) {
      const uint32_t* vt = s.vp.data() + ks * 4 * 256;
      _tile_loadd(0, s.probs.data() + ks * 32, lk * 2);
      _tile_loadd(2, vt, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_loadd(3, vt + 256, 64);
      _tile_dpbf16ps(5, 0, 3);
      _tile_loadd(2, vt + 512, 64);
      _tile_dpbf16ps(6, 0, 2);
      _tile_loadd(3, vt + 768, 64);
      _tile_dpbf16ps(7, 0, 3);
    }
    store_output(t, m0, rows, 4, inv_sum, s.acc.data());
  }
}
#undef DF_QK_BLOCK

// D = 32: blocks of 32 query rows (tiles 0-1), so every K or V tile loaded feeds two products, and the
// four products in flight (tiles 4-7) are independent chains: 16-row blocks left the AMX unit waiting
// on one accumulation chain per d block (perf: the P V loop was ~18% of the kernel, stalled on it)
AMX_TARGET void attend_head_d32(const HeadTask& t, int64_t len, float scale, Scratch& s) {
  const auto [key_blocks, lk] = prepare_head(t, len, 32, 32, s);
  float* lower = s.scores.data() + 16 * lk;  // score rows 16-31
  float inv_sum[32];

  for (int64_t m0 = 0; m0 < len; m0 += 32) {
    const int64_t rows = std::min<int64_t>(32, len - m0);
    const auto [qb, qstride] = query_block(t, m0, rows, 32, 32, s.qpad);
    _tile_loadd(0, qb, qstride);
    _tile_loadd(1, qb + 16 * qstride, qstride);
    // scores = Q K^T: two key blocks at a time, each against both row halves
    int64_t kb = 0;
    for (; kb + 2 <= key_blocks; kb += 2) {
      _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
      _tile_loadd(2, s.kp.data() + kb * 256, 64);
      _tile_loadd(3, s.kp.data() + (kb + 1) * 256, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 1, 2);
      _tile_dpbf16ps(6, 0, 3);
      _tile_dpbf16ps(7, 1, 3);
      _tile_stored(4, s.scores.data() + kb * 16, lk * 4);
      _tile_stored(5, lower + kb * 16, lk * 4);
      _tile_stored(6, s.scores.data() + (kb + 1) * 16, lk * 4);
      _tile_stored(7, lower + (kb + 1) * 16, lk * 4);
    }
    if (kb < key_blocks) {
      _tile_zero(4); _tile_zero(5);
      _tile_loadd(2, s.kp.data() + kb * 256, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 1, 2);
      _tile_stored(4, s.scores.data() + kb * 16, lk * 4);
      _tile_stored(5, lower + kb * 16, lk * 4);
    }
    softmax_rows(s.scores.data(), s.probs.data(), 32, len, lk, scale, inv_sum);
    // out = P V: P's row halves in tiles 0-1, V's two d blocks in 2-3, products (half, d block) in 4-7
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (int64_t ks = 0; ks < lk / 32; ++ks) {
      const uint32_t* vt = s.vp.data() + ks * 2 * 256;
      _tile_loadd(0, s.probs.data() + ks * 32, lk * 2);
      _tile_loadd(1, s.probs.data() + 16 * lk + ks * 32, lk * 2);
      _tile_loadd(2, vt, 64);
      _tile_loadd(3, vt + 256, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 0, 3);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
    store_output(t, m0, rows, 2, inv_sum, s.acc.data());
  }
}

// the tasks [begin, end) of one thread: tiles configured once, released at the end
AMX_TARGET void attend_tasks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                             float scale, int64_t begin, int64_t end) {
  const int64_t heads = q.size(1), len = q.size(2), d = q.size(3);
  const auto* qd = q.const_data_ptr<c10::BFloat16>();
  const auto* kd = k.const_data_ptr<c10::BFloat16>();
  const auto* vd = v.const_data_ptr<c10::BFloat16>();
  auto* od = out.data_ptr<c10::BFloat16>();
  TileScope tiles;
  Scratch scratch;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / heads, h = task % heads;
    HeadTask t{qd + b * q.stride(0) + h * q.stride(1), kd + b * k.stride(0) + h * k.stride(1),
               vd + b * v.stride(0) + h * v.stride(1), od + b * out.stride(0) + h * out.stride(1),
               q.stride(2), k.stride(2), v.stride(2), out.stride(2)};
    if (d == 32)
      attend_head_d32(t, len, scale, scratch);
    else
      attend_head_d64(t, len, scale, scratch);
  }
}
#endif  // DICE_FAST_AMX

void check_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, double scale) {
  // the softmax subtracts scale * max(x): right for a positive scale only
  TORCH_CHECK(scale > 0 && std::isfinite(scale), "amx_attention: scale must be positive and finite, got ", scale);
  const std::pair<const char*, const at::Tensor*> named[] = {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}};
  for (const auto& [name, t] : named) {
    TORCH_CHECK(t->dim() == 4, "amx_attention: ", name, " must be (n, heads, length, head_dim), got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "amx_attention: ", name, " must be bfloat16, got ", t->scalar_type());
    TORCH_CHECK(t->device().is_cpu(), "amx_attention: ", name, " must be on the CPU, got ", t->device());
    TORCH_CHECK(t->sizes() == q.sizes(), "amx_attention: ", name, " has shape ", t->sizes(), ", q has ", q.sizes());
    TORCH_CHECK(t->stride(3) == 1, "amx_attention: ", name, "'s head_dim must be contiguous (stride 1), got ", t->strides());
  }
  const int64_t len = q.size(2), d = q.size(3);
  TORCH_CHECK(d == 32 || d == kMaxHead, "amx_attention: head_dim must be 32 or 64, got ", d);
  TORCH_CHECK(len <= kMaxLen, "amx_attention: length must be at most ", kMaxLen, ", got ", len);
  // K's rows are gathered with 32-bit byte offsets of up to 15 rows
  TORCH_CHECK(k.stride(2) < (int64_t{1} << 26), "amx_attention: k's row stride must be under 2^26 elements, got ",
              k.stride(2));
  // out's rows are written by several threads: none may share memory with another or with an input
  at::assert_no_internal_overlap(out);
  for (const at::Tensor* input : {&q, &k, &v}) at::assert_no_partial_overlap(out, *input);
}

bool amx_attention_supported() {
#ifdef DICE_FAST_AMX
  return amx_ready();
#else
  return false;
#endif
}

void amx_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor out, double scale) {
  check_args(q, k, v, out, scale);
  TORCH_CHECK(amx_attention_supported(),
              "amx_attention: this CPU (or the OS's permission for AMX tile data) cannot run AMX bf16 tiles");
#ifdef DICE_FAST_AMX
  const int64_t tasks = q.size(0) * q.size(1);
  if (tasks == 0 || q.size(2) == 0) return;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    attend_tasks(q, k, v, out, static_cast<float>(scale), begin, end);
  });
#endif
}

}  // namespace
}  // namespace dice_fast

// Not one of spec.SCHEMAS's pooling ops (those have Triton and PyTorch twins): the CPU attention
// kernel of `dice_fast.cpu_attention`, defined here with its only implementation.
TORCH_LIBRARY_FRAGMENT(dice_fast_C, m) {
  m.def("amx_attention_supported() -> bool", &dice_fast::amx_attention_supported);
  m.def("amx_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(dice_fast_C, CPU, m) {
  m.impl("amx_attention", &dice_fast::amx_attention);
}
