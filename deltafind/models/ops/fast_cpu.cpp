// Opt-in fast math ([device] math = "bf16", NOT bit-exact): prefill matmuls on AVX512-BF16's dot
// product (vdpbf16ps: two bf16 products added into each fp32 lane).
//
// Weights stay as stored. Each task decodes a tile of rows with the exact decode (df_stored_dequant,
// df_mxfp4_dequant), rounds it to bf16 once in L2 and dots it with every token's activations, which
// were rounded to bf16 once per call (both round to nearest even). bf16 and MXFP4 weights are exact in
// bf16 (MXFP4: a 3-bit mantissa times a power of two), so there only the activations round; GGUF block
// weights (d*q + m) round too. Sums stay fp32: per (token, row) 16 lanes over the columns, then one
// fixed tree, so a row's result does not depend on the batch or the thread count.
// Built into the one kernel library by cpu_kernels.py; without AVX512-BF16, df_fast_ok() is 0 and
// deltafind stays on the exact kernels.
#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "cpu_pool.h"
#include "stored_blocks.h"

extern "C" int df_stored_dequant(int kind, const uint8_t* w, int64_t R, int64_t C, float* out, int threads);
extern "C" int64_t df_stored_row_bytes(int kind, int64_t cols);
extern "C" int df_mxfp4_dequant(const uint8_t* packed, const uint8_t* scale, int64_t R, int64_t C, float* w,
                                int threads);

namespace {

using df::pool;

// Decode weight rows [r0, r0 + n) of the matrix into out [n, C] fp32 (the exact decode).
using Decode = std::function<void(int64_t r0, int64_t n, float* out)>;

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr int64_t kTile = 32;   // weight rows per task: two zmm of outputs; 32 x C bf16 (224 KB at C = 3584) in L2
constexpr int64_t kDecode = 4;  // rows decoded to fp32 at a time before rounding to bf16 (L1-sized)
constexpr int kTokens = 12;     // tokens per register block: 24 accumulators, two weight vectors

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

// y[:, col0 .. col0 + n) for rows [r0, r0 + n) (n <= kTile) of one matrix, decoded by `decode`, then
// rounded to bf16 and packed pair-major; xb [T][C/2] bf16 pairs.
void tile(const Decode& decode, int64_t r0, int64_t n, const uint32_t* xb, int64_t T, int64_t C, float* y,
          int64_t ldy, int64_t col0) {
  const int64_t pairs = C / 2;
  thread_local std::vector<uint32_t> wp, row;
  thread_local std::vector<float> rows;
  wp.assign(pairs * kTile, 0);  // rows past n stay zero
  row.resize(pairs);
  if (rows.size() < static_cast<size_t>(kDecode * C)) rows.resize(kDecode * C);
  for (int64_t d = 0; d < n; d += kDecode) {
    const int64_t m = std::min(kDecode, n - d);
    decode(r0 + d, m, rows.data());
    for (int64_t i = 0; i < m; ++i) {
      round_bf16(rows.data() + i * C, C, reinterpret_cast<uint16_t*>(row.data()));
      for (int64_t k = 0; k < pairs; ++k) wp[k * kTile + d + i] = row[k];
    }
  }
  for (int64_t t = 0; t < T; t += kTokens) {
    const int mt = static_cast<int>(std::min<int64_t>(kTokens, T - t));
    kPanels[mt - 1](xb + t * pairs, pairs, wp.data(), y + t * ldy + col0, ldy, static_cast<int>(n));
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
    const Decode decode = [&](int64_t r, int64_t m, float* out) {
      if (!stack_cols) {
        df_stored_dequant(static_cast<int>(part.kind), part.data + r * part.row_bytes, m, part.cols, out, 1);
        return;
      }
      // Side by side: row r of the joined matrix is every part's row r, one after another.
      std::vector<float> one;
      int64_t c0 = 0;
      for (int q = 0; q < n; ++q) {
        one.resize(parts[q].cols);
        for (int64_t j = 0; j < m; ++j) {
          df_stored_dequant(static_cast<int>(parts[q].kind), parts[q].data + (r + j) * parts[q].row_bytes, 1,
                            parts[q].cols, one.data(), 1);
          std::copy(one.begin(), one.end(), out + j * x_cols + c0);
        }
        c0 += parts[q].cols;
      }
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
  const Decode decode = [&](int64_t r, int64_t m, float* out) {
    df_mxfp4_dequant(packed + r * (C / 2), scale + r * (C / 32), m, C, out, 1);
  };
  pool().run(static_cast<int>((R + kTile - 1) / kTile), threads, [&](int i) {
    const int64_t r0 = i * kTile;
    tile(decode, r0, std::min(kTile, R - r0), xb.data(), T, C, y, ldy, r0);
  });
#endif
  return 0;
}

}  // extern "C"
