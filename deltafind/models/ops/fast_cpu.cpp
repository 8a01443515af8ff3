// Opt-in fast math ([device] math = "bf16", NOT bit-exact): prefill matmuls on AVX512-BF16's dot
// product (vdpbf16ps: two bf16 products added into each fp32 lane).
//
// Weights stay as stored. Each task takes a tile of 32 rows to bf16 once, packed pair-major in L2 (GGUF
// blocks: the exact decode, df_stored_dequant, then rounded; bf16 as stored; MXFP4 decoded straight to
// bf16, which holds its values exactly), and dots it with every token's activations, rounded to bf16
// once per call (round to nearest even). So for bf16 and MXFP4 weights only the activations round. Sums stay fp32: per (token, row) 16 lanes over the columns, then one
// fixed tree, so a row's result does not depend on the batch or the thread count.
// Built into the one kernel library by cpu_kernels.py; without AVX512-BF16, df_fast_ok() is 0 and
// deltafind stays on the exact kernels.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <functional>
#include <vector>

#include "cpu_pool.h"
#include "stored_blocks.h"

extern "C" int df_stored_dequant(int kind, const uint8_t* w, int64_t R, int64_t C, float* out, int threads);
extern "C" int64_t df_stored_row_bytes(int kind, int64_t cols);

namespace {

using df::pool;

// Weight rows [r0, r0 + n) of the matrix as bf16 pairs into out [n][C/2], `scratch` [n, C] fp32 free to use.
using Decode = std::function<void(int64_t r0, int64_t n, float* scratch, uint32_t* out)>;

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr int64_t kTile = 32;   // weight rows per task: two zmm of outputs; 32 x C bf16 (224 KB at C = 3584) in L2
constexpr int64_t kDecode = 16;  // rows decoded to fp32 at a time, rounded to bf16, packed by one transpose
constexpr int kTokens = 12;
constexpr int64_t kBF16 = 30;   // GGML's kind id of bf16 (stored_weight.py's KINDS)     // tokens per register block: 24 accumulators, two weight vectors

inline void round_bf16(const float* x, int64_t C, uint16_t* out) {
  for (int64_t c = 0; c < C; c += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + c + 16), _mm512_loadu_ps(x + c));
    _mm512_storeu_si512(out + c, reinterpret_cast<const __m512i&>(v));
  }
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<const __m512bh&>(v); }

// y[t, 0..n) for MT tokens and a packed tile: wp [C/2][32] of bf16 pairs (column pair k of rows 0..31),
// xb [T][C/2] bf16 pairs. Output r of token t sums in lane r % 16 of one register, pair after pair.
template <int MT>
void panel(const uint32_t* xb, int64_t pairs, const uint32_t* wp, float* y, int64_t ldy, int n) {
  __m512 a0[MT], a1[MT];
  for (int t = 0; t < MT; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    const __m512bh w0 = as_bh(_mm512_loadu_si512(wp + k * 32)), w1 = as_bh(_mm512_loadu_si512(wp + k * 32 + 16));
    for (int t = 0; t < MT; ++t) {
      const __m512bh b = as_bh(_mm512_set1_epi32(static_cast<int>(xb[t * pairs + k])));
      a0[t] = _mm512_dpbf16_ps(a0[t], b, w0);
      a1[t] = _mm512_dpbf16_ps(a1[t], b, w1);
    }
  }
  const __mmask16 m0 = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 m1 = n >= 32 ? 0xFFFF : n <= 16 ? 0 : static_cast<__mmask16>((1u << (n - 16)) - 1);
  for (int t = 0; t < MT; ++t) {
    _mm512_mask_storeu_ps(y + t * ldy, m0, a0[t]);
    _mm512_mask_storeu_ps(y + t * ldy + 16, m1, a1[t]);
  }
}

using Panel = void (*)(const uint32_t*, int64_t, const uint32_t*, float*, int64_t, int);
constexpr Panel kPanels[kTokens] = {panel<1>, panel<2>, panel<3>, panel<4>,  panel<5>,  panel<6>,
                                    panel<7>, panel<8>, panel<9>, panel<10>, panel<11>, panel<12>};

// r[i] (16 rows of 16 lanes) becomes its transpose: r[j] lane i = old r[i] lane j.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// y[:, col0 .. col0 + n) for rows [r0, r0 + n) (n <= kTile) of one matrix, decoded by `decode`, then
// rounded to bf16 and packed pair-major by 16 x 16 transposes; xb [T][C/2] bf16 pairs.
void tile(const Decode& decode, int64_t r0, int64_t n, const uint32_t* xb, int64_t T, int64_t C, float* y,
          int64_t ldy, int64_t col0) {
  const int64_t pairs = C / 2;  // a multiple of 16: every kind's rows are whole 32-weight groups
  thread_local std::vector<uint32_t> wp, bf;
  thread_local std::vector<float> rows;
  wp.resize(pairs * kTile);
  bf.resize(kDecode * pairs);
  rows.resize(kDecode * C);
  for (int64_t d = 0; d < kTile; d += kDecode) {  // rows past n pack as zeros
    const int64_t m = std::max<int64_t>(0, std::min(kDecode, n - d));
    if (m > 0) decode(r0 + d, m, rows.data(), bf.data());
    std::fill(bf.begin() + m * pairs, bf.end(), 0u);
    for (int64_t k = 0; k < pairs; k += 16) {
      __m512i v[16];
      for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_si512(bf.data() + i * pairs + k);
      transpose16(v);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(wp.data() + (k + j) * kTile + d, v[j]);
    }
  }
  for (int64_t t = 0; t < T; t += kTokens) {
    const int mt = static_cast<int>(std::min<int64_t>(kTokens, T - t));
    kPanels[mt - 1](xb + t * pairs, pairs, wp.data(), y + t * ldy + col0, ldy, static_cast<int>(n));
  }
}

// Rows [r, r + m) of a stored matrix as bf16 pairs into out (row stride ld pairs): bf16 as stored,
// any other kind decoded exactly into scratch and rounded.
void part_rows(const dfq::Part& q, int64_t r, int64_t m, float* scratch, uint32_t* out, int64_t ld) {
  for (int64_t j = 0; j < m; ++j) {
    const uint8_t* row = q.data + (r + j) * q.row_bytes;
    if (q.kind == kBF16) {
      std::memcpy(out + j * ld, row, q.cols * 2);
      continue;
    }
    df_stored_dequant(static_cast<int>(q.kind), row, 1, q.cols, scratch, 1);
    round_bf16(scratch, q.cols, reinterpret_cast<uint16_t*>(out + j * ld));
  }
}

// Rows [r, r + m) of an MXFP4 matrix as bf16 pairs (pair j = byte j's two codes, low nibble first):
// each weight is an E2M1 value times 2^(s-127), exact in fp32 and in bf16, so its bf16 is its fp32's
// high half; the products are the exact decode's (df_mxfp4_dequant).
void mxfp4_rows(const uint8_t* packed, const uint8_t* scale, int64_t C, int64_t r, int64_t m, uint32_t* out) {
  static const __m512 e2m1 = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f,
                                            -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  const __m512i low15 = _mm512_set1_epi32(15), high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t j = 0; j < m; ++j) {
    const uint8_t* p = packed + (r + j) * (C / 2);
    const uint8_t* s = scale + (r + j) * (C / 32);
    for (int64_t g = 0; g < C / 32; ++g) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + g * 16)));
      const __m512 f = _mm512_set1_ps(std::ldexp(1.0f, static_cast<int>(s[g]) - 127));
      const __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, low15), e2m1), f);
      const __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), e2m1), f);
      const __m512i pair = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(lo), 16),
                                           _mm512_and_si512(_mm512_castps_si512(hi), high));
      _mm512_storeu_si512(out + j * (C / 2) + g * 16, pair);
    }
  }
}

// x [T, C] fp32 (stride ldx) rounded to bf16 [T, C], rows shared out among the threads.
std::vector<uint32_t> activations(const float* x, int64_t T, int64_t ldx, int64_t C, int threads) {
  std::vector<uint32_t> xb(T * C / 2);
  pool().run(static_cast<int>(T), threads, [&](int t) {
    round_bf16(x + t * ldx, C, reinterpret_cast<uint16_t*>(xb.data() + t * C / 2));
  });
  return xb;
}

// e^x in 16 lanes (Cephes' expf: x = n ln 2 + r, a degree-6 polynomial in r, scaled by 2^n; ~1 ulp).
// The clamp keeps 2^n finite; min/max take x's NaN through.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-88.0f), _mm512_min_ps(_mm512_set1_ps(88.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// tanh in 16 lanes (Cephes' tanhf: an odd polynomial below |x| = 0.625, where 1 - 2 / (e^2|x| + 1)
// would cancel, that expression above it, the sign put back).
inline __m512 tanh16(__m512 x) {
  const __m512 a = _mm512_abs_ps(x), z = _mm512_mul_ps(x, x), one = _mm512_set1_ps(1.0f);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  for (const float c : {2.06390887954e-2f, -5.37397155531e-2f, 1.33314422036e-1f, -3.33332819422e-1f})
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(c));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
  const __m512 big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(exp16(_mm512_add_ps(a, a)), one)));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  const __m512 signed_big = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(big), sign));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ), signed_big, small);
}

// h = (tanh(g / beta) * beta * sigmoid(g)) * (tanh(u / lbeta) * lbeta) for n <= 32 floats: SiTU in
// df_mxfp4_gate_up_situ's order, 16 lanes at a time (libm's scalar exp and tanh cost more than the
// bf16 matmuls' tile here: docs/kimi-k3-format.md §4.6 for the expression).
void situ_row(const float* g, const float* u, int64_t n, float beta, float lbeta, float* h) {
  const __m512 vb = _mm512_set1_ps(beta), vlb = _mm512_set1_ps(lbeta), one = _mm512_set1_ps(1.0f);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = n - c >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - c)) - 1);
    const __m512 gv = _mm512_maskz_loadu_ps(m, g + c), uv = _mm512_maskz_loadu_ps(m, u + c);
    const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
    const __m512 gate = _mm512_mul_ps(_mm512_mul_ps(tanh16(_mm512_div_ps(gv, vb)), vb), sig);
    _mm512_mask_storeu_ps(h + c, m, _mm512_mul_ps(gate, _mm512_mul_ps(tanh16(_mm512_div_ps(uv, vlb)), vlb)));
  }
}

constexpr bool kBuilt = true;
#else
constexpr bool kBuilt = false;
#endif

}  // namespace

extern "C" {

// 1 where this build has the bf16 kernels (the CPU has AVX512-BF16), else 0.
int df_fast_ok() { return kBuilt ? 1 : 0; }

// df_stored_parts' contract (stored_cpu.cpp) with bf16 products: y = x @ W.T, W the parts stacked by
// rows (stack_cols = 0) or side by side (1). Returns 1 if a part does not fit its kind or no kernel.
int df_fast_parts(const dfq::Part* parts, int n, int stack_cols, const float* x, int64_t T, int64_t ldx, float* y,
                  int64_t ldy, int threads) {
  if (!kBuilt) return 1;
  int64_t x_cols = 0;
  for (int p = 0; p < n; ++p) {
    if (parts[p].row_bytes != df_stored_row_bytes(static_cast<int>(parts[p].kind), parts[p].cols)) return 1;
    if (stack_cols ? parts[p].rows != parts[0].rows : parts[p].cols != parts[0].cols) return 1;
    x_cols += stack_cols || p == 0 ? parts[p].cols : 0;
  }
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const std::vector<uint32_t> xb = activations(x, T, ldx, x_cols, threads);
  // Tasks: kTile-row tiles of each part (stacked), or of the joined matrix (side by side).
  std::vector<std::array<int64_t, 3>> tasks;  // (part, first row, y column of row 0 of the part)
  int64_t y_col = 0;
  for (int p = 0; p < (stack_cols ? 1 : n); ++p) {
    for (int64_t r = 0; r < parts[p].rows; r += kTile) tasks.push_back({p, r, y_col});
    y_col += parts[p].rows;
  }
  pool().run(static_cast<int>(tasks.size()), threads, [&](int i) {
    const auto [p, r0, col0] = tasks[i];
    const dfq::Part& part = parts[p];
    const Decode decode = [&](int64_t r, int64_t m, float* scratch, uint32_t* out) {
      if (!stack_cols) return part_rows(part, r, m, scratch, out, x_cols / 2);
      // Side by side: row r of W is every part's row r, one after another.
      for (int64_t q = 0, c0 = 0; q < n; c0 += parts[q++].cols) part_rows(parts[q], r, m, scratch, out + c0 / 2, x_cols / 2);
    };
    tile(decode, r0, std::min(kTile, part.rows - r0), xb.data(), T, x_cols, y, ldy, col0 + r0);
  });
#endif
  return 0;
}

// y [T, R] = x [T, C] @ W.T for an MXFP4 W (mxfp4.py's layout) with bf16 products.
int df_fast_mxfp4(const float* x, int64_t T, int64_t ldx, const uint8_t* packed, const uint8_t* scale, int64_t R,
                  int64_t C, float* y, int64_t ldy, int threads) {
  if (!kBuilt || C % 32 != 0) return 1;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const std::vector<uint32_t> xb = activations(x, T, ldx, C, threads);
  const Decode decode = [&](int64_t r, int64_t m, float*, uint32_t* out) { mxfp4_rows(packed, scale, C, r, m, out); };
  pool().run(static_cast<int>((R + kTile - 1) / kTile), threads, [&](int i) {
    const int64_t r0 = i * kTile;
    tile(decode, r0, std::min(kTile, R - r0), xb.data(), T, C, y, ldy, r0);
  });
#endif
  return 0;
}

// h [T, R] = situ(x @ W1.T, x @ W3.T) for MXFP4 W1, W3 with bf16 products (df_mxfp4_gate_up_situ's
// contract and its SiTU expression, docs/kimi-k3-format.md §4.6): each task's rows in one pass, no torch
// op between the matmuls and the activation.
int df_fast_mxfp4_gate_up_situ(const float* x, int64_t T, const uint8_t* p1, const uint8_t* s1, const uint8_t* p3,
                               const uint8_t* s3, int64_t R, int64_t C, float beta, float lbeta, float* h,
                               int threads) {
  if (!kBuilt || C % 32 != 0) return 1;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const std::vector<uint32_t> xb = activations(x, T, C, C, threads);
  std::vector<float> g(static_cast<size_t>(T * R)), u(static_cast<size_t>(T * R));
  const Decode d1 = [&](int64_t r, int64_t m, float*, uint32_t* out) { mxfp4_rows(p1, s1, C, r, m, out); };
  const Decode d3 = [&](int64_t r, int64_t m, float*, uint32_t* out) { mxfp4_rows(p3, s3, C, r, m, out); };
  pool().run(static_cast<int>((R + kTile - 1) / kTile), threads, [&](int i) {
    const int64_t r0 = i * kTile, n = std::min(kTile, R - r0);
    tile(d1, r0, n, xb.data(), T, C, g.data(), R, r0);
    tile(d3, r0, n, xb.data(), T, C, u.data(), R, r0);
    for (int64_t t = 0; t < T; ++t) situ_row(g.data() + t * R + r0, u.data() + t * R + r0, n, beta, lbeta, h + t * R + r0);
  });
#endif
  return 0;
}

}  // extern "C"
