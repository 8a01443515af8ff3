// `[device] math = "q8"` (NOT bit-exact): llama.cpp's arithmetic for the GGUF K-quants and Q8_0, written
// from its definitions (ggml-quants.c, docs/math-modes.md). The activations are quantized per token row
// (Q8_K: per 256 values one fp32 d = max/-127 with the codes rounded half to even and capped at 127, plus
// 16 sums of 16 codes; Q8_0: per 32 values d = amax/127 rounded to fp16, the codes rounded half away from
// zero) and each weight block is dotted with integer products, the weights as stored:
//   Q4_K/Q5_K: d*dx * sum_g sc_g (q . x8)_g  -  dmin*dx * sum_g mn_g * (sum of x8 in g)   (8 groups of 32)
//   Q6_K:      d*dx * sum_g sc_g ((q - 32) . x8)_g                                      (16 groups of 16)
//   Q8_0:      dw*dx * (q . x8)                                                          (one group of 32)
// The integer sums are exact (no int16 saturation: |u8*s8 pairs| <= 2*63*127); only the fp32 combination of
// the blocks is ordered our way. Per token row, so a row's result is the same alone or in a batch.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "stored_blocks.h"

namespace dfq8 {
namespace {

// llama.cpp's block_q8_K and block_q8_0, byte for byte.
struct BlockK {
  float d;
  int8_t qs[256];
  int16_t bsums[16];
};
struct Block0 {
  uint16_t d;
  int8_t qs[32];
};
static_assert(sizeof(BlockK) == 292 && sizeof(Block0) == 34, "llama.cpp's Q8_K / Q8_0 block layouts");

constexpr int kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kQ8_K = 15;  // GGML type ids
// The x format a weight kind dots with: Q8_K, Q8_0, or 0 where the kind has no q8 kernel (exact).
constexpr int x_kind(int kind) { return kind == kQ4_K || kind == kQ5_K || kind == kQ6_K ? kQ8_K : kind == kQ8_0 ? kQ8_0 : 0; }

// fp32 -> IEEE half, round to nearest even (numpy's float16 cast; F16C where built).
inline uint16_t f2h(float f) {
#ifdef __F16C__
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t sign = (b >> 16) & 0x8000u, a = b & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return static_cast<uint16_t>(sign | 0x7C00u | (a > 0x7F800000u ? 0x200u : 0u));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504
  if (a < 0x38800000u) {                                               // a half subnormal (or zero)
    const float v = dfq::bits_to_float(a) * 16777216.0f;              // exact: in units of 2^-24
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(v)));
  }
  const uint32_t m = a + 0xFFFu + ((a >> 13) & 1u);  // round the 13 dropped bits to nearest even
  return static_cast<uint16_t>(sign | ((m - 0x38000000u) >> 13));
#endif
}

// n values (a multiple of 256) of x into n / 256 Q8_K blocks.
inline void quantize_k(const float* x, int64_t n, BlockK* y) {
  for (int64_t i = 0; i < n / 256; ++i, x += 256) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 256; ++j)
      if (std::fabs(x[j]) > amax) amax = std::fabs(x[j]), max = x[j];
    BlockK& b = y[i];
    if (amax == 0.0f) {
      std::memset(&b, 0, sizeof b);
      continue;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < 256; ++j) b.qs[j] = static_cast<int8_t>(std::min(127, static_cast<int>(std::nearbyint(iscale * x[j]))));
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += b.qs[16 * g + j];
      b.bsums[g] = static_cast<int16_t>(s);
    }
    b.d = 1.0f / iscale;
  }
}

// n values (a multiple of 32) of x into n / 32 Q8_0 blocks.
inline void quantize_0(const float* x, int64_t n, Block0* y) {
  for (int64_t i = 0; i < n / 32; ++i, x += 32) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = f2h(d);
    for (int j = 0; j < 32; ++j) y[i].qs[j] = static_cast<int8_t>(std::round(x[j] * id));
  }
}

// Q4_K/Q5_K's 8 scales (out[0..8)) and 8 mins (out[8..16)) from the 12 packed bytes (dfq::scale_min's
// layout, four at a time).
inline void k_scales_words(const uint8_t* s, uint32_t r[4]) {
  uint32_t w[3];
  std::memcpy(w, s, 12);
  r[0] = w[0] & 0x3F3F3F3Fu;
  r[1] = (w[2] & 0x0F0F0F0Fu) | (((w[0] >> 6) & 0x03030303u) << 4);
  r[2] = w[1] & 0x3F3F3F3Fu;
  r[3] = ((w[2] >> 4) & 0x0F0F0F0Fu) | (((w[1] >> 6) & 0x03030303u) << 4);
}

inline void k_scales(const uint8_t* s, uint8_t out[16]) {
  uint32_t r[4];
  k_scales_words(s, r);
  std::memcpy(out, r, 16);
}

// A 6-bit Q6_K code or a 4/5-bit Q4_K/Q5_K code of weight j of block b (for the scalar path).
inline int code(int kind, const uint8_t* b, int j) {
  if (kind == kQ6_K) {
    const int h = j / 128, k = (j % 128) / 32, c = j % 32;
    return ((b[64 * h + 32 * (k % 2) + c] >> (4 * (k / 2))) & 15) | (((b[128 + 32 * h + c] >> (2 * k)) & 3) << 4);
  }
  const uint8_t* qs = b + (kind == kQ4_K ? 16 : 48);
  const int g = j / 32, c = j % 32, v = (qs[32 * (g / 2) + c] >> (4 * (g % 2))) & 15;
  return kind == kQ5_K ? v | (((b[16 + c] >> g) & 1) << 4) : v;
}

// The integer sums of one weight block against one x block: *s = the scaled code sum, *m = the min sum
// (Q4_K/Q5_K) or 0. The definition the SIMD path must equal (and the scalar build's path).
inline void block_ints(int kind, const uint8_t* b, const void* xb, int64_t* s, int64_t* m) {
  *s = *m = 0;
  if (kind == kQ8_0) {
    const Block0* x = static_cast<const Block0*>(xb);
    for (int j = 0; j < 32; ++j) *s += static_cast<int8_t>(b[2 + j]) * x->qs[j];
    return;
  }
  const BlockK* x = static_cast<const BlockK*>(xb);
  if (kind == kQ6_K) {
    for (int g = 0; g < 16; ++g) {
      int64_t d = 0;
      for (int j = 16 * g; j < 16 * g + 16; ++j) d += (code(kind, b, j) - 32) * x->qs[j];
      *s += static_cast<int8_t>(b[192 + g]) * d;
    }
    return;
  }
  uint8_t sm[16];
  k_scales(b + 4, sm);
  for (int g = 0; g < 8; ++g) {
    int64_t d = 0;
    for (int j = 32 * g; j < 32 * g + 32; ++j) d += code(kind, b, j) * x->qs[j];
    *s += sm[g] * d;
    *m += sm[8 + g] * (x->bsums[2 * g] + x->bsums[2 * g + 1]);
  }
}

// The block's scale(s) times x's d: (d, -dmin) for Q4_K/Q5_K, (d, 0) otherwise.
inline void block_scales(int kind, const uint8_t* b, const void* xb, float* ds, float* dm) {
  if (kind == kQ8_0) {
    *ds = dfq::h2f(dfq::rd16(b)) * dfq::h2f(static_cast<const Block0*>(xb)->d), *dm = 0.0f;
    return;
  }
  const float dx = static_cast<const BlockK*>(xb)->d;
  *ds = dfq::h2f(dfq::rd16(b + (kind == kQ6_K ? 208 : 0))) * dx;
  *dm = kind == kQ6_K ? 0.0f : -(dfq::h2f(dfq::rd16(b + 2)) * dx);
}

}  // namespace
}  // namespace dfq8

#ifdef __AVX2__
#include "stored_q8_avx2.h"
#endif
