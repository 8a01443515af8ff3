// The exact decode of stored_cpu.cpp: one chunk of a row's weights in any stored kind to fp32, gguf-py's
// numpy dequantize with the same fp32 operations in the same order (built with -ffp-contract=off so
// d*q + m is never fused). df_stored_dequant is it; the matmul uses it where no register path covers a
// kind (Q2_K, Q3_K, the IQ formats) or the CPU has no AVX2. Included by stored_cpu.cpp only.
#pragma once
#include <cstdint>
#include <cstring>

#include "stored_blocks.h"
#include "stored_iq.h"

namespace {

using dfq::bits_to_float;
using dfq::h2f;
using dfq::rd16;
using dfq::scale_min;

// GGML type ids (gguf.GGMLQuantizationType), used as the kind codes of this library.
// I8R is deltafind's own: the row-int8 spine (docs/kimi-k3-drafting-io.md §9.6), each row an f16 scale then C int8 weights.
enum Kind : int { F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
                  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23, IQ1_M = 29,
                  BF16 = 30, I8R = 100 };
constexpr int kChunk = 256;  // weights decoded at a time (one K-block, eight 32-blocks, 256 halves)

// One 32-weight block of Q4_0/Q4_1/Q5_0/Q5_1 into o[0..32). A template per format, so the loops
// have no branches and the compiler vectorizes them; the arithmetic is gguf-py's, in its order.
template <int K>
inline void decode32(const uint8_t* b, float* o) {
  constexpr bool has_min = K == Q4_1 || K == Q5_1, five = K == Q5_0 || K == Q5_1;
  constexpr int offset = five ? 16 : 8;
  const float d = h2f(rd16(b));
  const float m = has_min ? h2f(rd16(b + 2)) : 0.0f;
  uint32_t qh = 0;
  if (five) std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
  const uint8_t* qs = b + 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
  int v[32];
  for (int j = 0; j < 16; ++j) {
    v[j] = qs[j] & 15;
    v[j + 16] = qs[j] >> 4;
  }
  if (five)
    for (int j = 0; j < 32; ++j) v[j] |= static_cast<int>((qh >> j) & 1u) << 4;
  if (has_min)
    for (int j = 0; j < 32; ++j) o[j] = d * static_cast<float>(v[j]) + m;  // (d * q) + m
  else
    for (int j = 0; j < 32; ++j) o[j] = d * static_cast<float>(v[j] - offset);  // d * (q - offset)
}

inline void decode_q8_0(const uint8_t* b, float* o) {
  const float d = h2f(rd16(b));
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(q[j]) * d;
}

// One 256-weight Q4_K or Q5_K block.
template <int K>
inline void decode_k45(const uint8_t* b, float* out) {
  const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;                    // Q5_K: bit i of qh[c] is the 5th bit of weight 32*i + c
  const uint8_t* qs = b + (K == Q4_K ? 16 : 48);  // 4 groups of 32 bytes: low nibbles, then high
  for (int i = 0; i < 8; ++i) {
    int sc, mn;
    scale_min(scales, i, &sc, &mn);
    const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(mn);
    const uint8_t* q = qs + (i / 2) * 32;
    const int shift = (i % 2) * 4;
    float* o = out + i * 32;
    int v[32];
    for (int c = 0; c < 32; ++c) v[c] = (q[c] >> shift) & 15;
    if (K == Q5_K)
      for (int c = 0; c < 32; ++c) v[c] |= ((qh[c] >> i) & 1) << 4;
    for (int c = 0; c < 32; ++c) o[c] = ds * static_cast<float>(v[c]) - dm;  // (d * q) - dm
  }
}

inline void decode_q6_k(const uint8_t* b, float* out) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = h2f(rd16(b + 208));
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < 4; ++k) {  // weights h*128 + k*32 + [0, 32)
      const uint8_t* lo = ql + h * 64 + (k % 2) * 32;
      const uint8_t* hi = qh + h * 32;
      const int lshift = (k / 2) * 4, hshift = k * 2;
      const float d0 = d * static_cast<float>(sc[h * 8 + k * 2]), d1 = d * static_cast<float>(sc[h * 8 + k * 2 + 1]);
      float* o = out + h * 128 + k * 32;
      int v[32];
      for (int c = 0; c < 32; ++c) v[c] = (((lo[c] >> lshift) & 15) | (((hi[c] >> hshift) & 3) << 4)) - 32;
      for (int c = 0; c < 16; ++c) o[c] = d0 * static_cast<float>(v[c]);
      for (int c = 16; c < 32; ++c) o[c] = d1 * static_cast<float>(v[c]);
    }
  }
}

template <int K>
inline void decode_blocks32(const uint8_t* row, int64_t c0, int n, float* out) {
  for (int k = 0; k < n / 32; ++k) {
    const uint8_t* b = row + (c0 / 32 + k) * dfq::block_bytes(K);
    if (K == Q8_0)
      decode_q8_0(b, out + k * 32);
    else
      decode32<K>(b, out + k * 32);
  }
}

// Decode weights [c0, c0 + n) of one row into out: c0 a multiple of kChunk, n = kChunk or the row's
// tail (a multiple of the block size; K formats have no tail).
void decode(int kind, const uint8_t* row, int64_t c0, int n, float* out) {
  switch (kind) {
    case BF16: {
      const uint8_t* p = row + c0 * 2;
      for (int j = 0; j < n; ++j) out[j] = bits_to_float(static_cast<uint32_t>(rd16(p + 2 * j)) << 16);
      return;
    }
    case F16: {
      const uint8_t* p = row + c0 * 2;
      for (int j = 0; j < n; ++j) out[j] = h2f(rd16(p + 2 * j));
      return;
    }
    case I8R: {
      const float scale = h2f(rd16(row));
      const int8_t* q = reinterpret_cast<const int8_t*>(row + 2 + c0);
      for (int j = 0; j < n; ++j) out[j] = scale * static_cast<float>(q[j]);
      return;
    }
    case Q4_0: decode_blocks32<Q4_0>(row, c0, n, out); return;
    case Q4_1: decode_blocks32<Q4_1>(row, c0, n, out); return;
    case Q5_0: decode_blocks32<Q5_0>(row, c0, n, out); return;
    case Q5_1: decode_blocks32<Q5_1>(row, c0, n, out); return;
    case Q8_0: decode_blocks32<Q8_0>(row, c0, n, out); return;
    case Q4_K: decode_k45<Q4_K>(row + (c0 / 256) * dfq::block_bytes(Q4_K), out); return;
    case Q5_K: decode_k45<Q5_K>(row + (c0 / 256) * dfq::block_bytes(Q5_K), out); return;
    case Q6_K: decode_q6_k(row + (c0 / 256) * dfq::block_bytes(Q6_K), out); return;
    // Q2_K, Q3_K and the IQ formats: no register path yet (stored_rows.h); decoded into the L1 buffer
    case Q2_K: dfq::decode_q2_k(row + (c0 / 256) * dfq::block_bytes(Q2_K), out); return;
    case Q3_K: dfq::decode_q3_k(row + (c0 / 256) * dfq::block_bytes(Q3_K), out); return;
    case IQ4_NL: for (int k = 0; k < n / 32; ++k) dfq::decode_iq4_nl(row + (c0 / 32 + k) * 18, out + 32 * k); return;
    default: dfq::decode_iq(kind, row + (c0 / 256) * dfq::block_bytes(kind), out); return;
  }
}

}  // namespace
