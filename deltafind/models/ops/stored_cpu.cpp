// Matmul on weights in their stored format: bf16, fp16 and llama.cpp's GGUF block formats
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), with fp32 activations and fp32 accumulation.
//
// y[t, r] = sum_c w(r, c) * x[t, c], where w(r, c) is decoded exactly as gguf-py's numpy
// dequantize decodes it (the same fp32 operations in the same order: built with
// -ffp-contract=off so d*q + m is never fused). A row is walked in chunks of 256 weights, decoded
// into an L1 buffer once per tile of tokens, and dotted with 16 lanes per (token, row) combined
// by one fixed tree at the end; that order does not depend on the number of tokens or threads,
// so one token and a batch give bit-identical rows. Built by deltafind/models/ops/cpu_kernels.py.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>

#include "cpu_pool.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

using df::pool;

// GGML type ids (gguf.GGMLQuantizationType), used as the kind codes of this library.
enum Kind : int { F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };
constexpr int kChunk = 256;  // weights decoded at a time (one K-block, eight 32-blocks, 256 halves)
constexpr int kTile = 4;     // tokens per pass over a decoded chunk

bool block_shape(int kind, int64_t* elems, int64_t* bytes) {
  switch (kind) {
    case F16: case BF16: *elems = 1; *bytes = 2; return true;
    case Q4_0: *elems = 32; *bytes = 18; return true;
    case Q4_1: *elems = 32; *bytes = 20; return true;
    case Q5_0: *elems = 32; *bytes = 22; return true;
    case Q5_1: *elems = 32; *bytes = 24; return true;
    case Q8_0: *elems = 32; *bytes = 34; return true;
    case Q4_K: *elems = 256; *bytes = 144; return true;
    case Q5_K: *elems = 256; *bytes = 176; return true;
    case Q6_K: *elems = 256; *bytes = 210; return true;
    default: return false;
  }
}

inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

inline float bits_to_float(uint32_t bits) { float f; std::memcpy(&f, &bits, 4); return f; }

// IEEE half -> float, exact for every value (subnormals, infinities, NaN payloads).
inline float h2f(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) {
    const float f = std::ldexp(static_cast<float>(m), -24);
    return sign ? -f : f;
  }
  if (e == 31) return bits_to_float(sign | 0x7F800000u | (m << 13));
  return bits_to_float(sign | ((e + 112) << 23) | (m << 13));
}

// Q4_K/Q5_K: the 6-bit scale and min of sub-block i from the 12 packed bytes.
inline void scale_min(const uint8_t* s, int i, int* sc, int* mn) {
  if (i < 4) {
    *sc = s[i] & 63;
    *mn = s[i + 4] & 63;
  } else {
    *sc = (s[i + 4] & 0x0F) | ((s[i - 4] >> 2) & 0x30);
    *mn = (s[i + 4] >> 4) | ((s[i] >> 2) & 0x30);
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
    case Q4_K: case Q5_K: {
      const uint8_t* b = row + (c0 / 256) * (kind == Q4_K ? 144 : 176);
      const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;                       // Q5_K only: bit i of qh[c] is weight 32*i + c's 5th bit
      const uint8_t* qs = b + (kind == Q4_K ? 16 : 48);  // 4 groups of 32 bytes: low nibbles, then high
      for (int i = 0; i < 8; ++i) {
        int sc, mn;
        scale_min(scales, i, &sc, &mn);
        const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(mn);
        const uint8_t* q = qs + (i / 2) * 32;
        const int shift = (i % 2) * 4;
        for (int c = 0; c < 32; ++c) {
          int v = (q[c] >> shift) & 15;
          if (kind == Q5_K) v |= ((qh[c] >> i) & 1) << 4;
          out[i * 32 + c] = ds * static_cast<float>(v) - dm;
        }
      }
      return;
    }
    case Q6_K: {
      const uint8_t* b = row + (c0 / 256) * 210;
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = h2f(rd16(b + 208));
      for (int f = 0; f < 256; ++f) {
        const int h = f / 128, r = f % 128;
        const int lo = (ql[h * 64 + r % 64] >> ((r / 64) * 4)) & 15;
        const int hi = (qh[h * 32 + r % 32] >> ((r / 32) * 2)) & 3;
        out[f] = (d * static_cast<float>(sc[f / 16])) * static_cast<float>((lo | (hi << 4)) - 32);
      }
      return;
    }
    default: break;
  }
  int64_t elems, bytes;
  block_shape(kind, &elems, &bytes);
  for (int k = 0; k < n / 32; ++k) {
    const uint8_t* b = row + (c0 / 32 + k) * bytes;
    float* o = out + k * 32;
    const float d = h2f(rd16(b));
    if (kind == Q8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
      for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(q[j]) * d;
      continue;
    }
    const bool has_min = kind == Q4_1 || kind == Q5_1;
    const float m = has_min ? h2f(rd16(b + 2)) : 0.0f;
    const bool five = kind == Q5_0 || kind == Q5_1;
    uint32_t qh = 0;
    if (five) std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
    const uint8_t* qs = b + 2 + (has_min ? 2 : 0) + (five ? 4 : 0);
    const int offset = five ? 16 : 8;
    for (int j = 0; j < 32; ++j) {
      int v = (qs[j % 16] >> ((j / 16) * 4)) & 15;
      if (five) v |= ((qh >> j) & 1) << 4;
      // q1 formats: d*q + m on the unsigned code; q0 formats: d * (code - offset)
      o[j] = has_min ? d * static_cast<float>(v) + m : d * static_cast<float>(v - offset);
    }
  }
}

// acc[0..15] += w[0..n) * x[0..n) for n a multiple of 16: two 8-lane chains (even and odd steps).
inline void dot_chunk(const float* w, const float* x, int n, float* acc) {
#ifdef __AVX2__
  __m256 a0 = _mm256_loadu_ps(acc), a1 = _mm256_loadu_ps(acc + 8);
  for (int j = 0; j < n; j += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(x + j), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 8), _mm256_loadu_ps(x + j + 8), a1);
  }
  _mm256_storeu_ps(acc, a0);
  _mm256_storeu_ps(acc + 8, a1);
#else
  for (int j = 0; j < n; j += 16)
    for (int l = 0; l < 16; ++l) acc[l] = std::fma(w[j + l], x[j + l], acc[l]);
#endif
}

inline float reduce16(const float* a) {
  float s[8];
  for (int l = 0; l < 8; ++l) s[l] = a[l] + a[8 + l];
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

}  // namespace

extern "C" {

int df_stored_abi() { return 1; }

// Bytes of one row of `cols` weights in `kind` (0 when the kind is unknown or cols does not fit it).
int64_t df_stored_row_bytes(int kind, int64_t cols) {
  int64_t elems, bytes;
  if (!block_shape(kind, &elems, &bytes) || cols % (elems == 256 ? 256 : 32) != 0) return 0;
  return cols / elems * bytes;
}

// out [R, C] fp32 = the weights decoded (the exactness oracle compares this with gguf-py's).
int df_stored_dequant(int kind, const uint8_t* w, int64_t R, int64_t C, float* out, int threads) {
  const int64_t rb = df_stored_row_bytes(kind, C);
  if (rb == 0) return 1;
  pool().run(static_cast<int>(R), threads, [&](int r) {
    for (int64_t c0 = 0; c0 < C; c0 += kChunk)
      decode(kind, w + r * rb, c0, static_cast<int>(std::min<int64_t>(kChunk, C - c0)), out + r * C + c0);
  });
  return 0;
}

// y [T, R] (row stride ldy) = x [T, C] (row stride ldx) @ W.T, W [R, C] stored as `kind`.
int df_stored_matmul(int kind, const float* x, int64_t T, int64_t ldx, const uint8_t* w, int64_t R, int64_t C,
                     float* y, int64_t ldy, int threads) {
  const int64_t rb = df_stored_row_bytes(kind, C);
  if (rb == 0) return 1;
  const int64_t rows_per_task = 16;
  const int tasks = static_cast<int>((R + rows_per_task - 1) / rows_per_task);
  pool().run(tasks, threads, [&](int i) {
    alignas(64) float buf[kChunk];
    const int64_t r0 = i * rows_per_task, r1 = std::min<int64_t>(R, r0 + rows_per_task);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t t0 = 0; t0 < T; t0 += kTile) {
        const int nt = static_cast<int>(std::min<int64_t>(kTile, T - t0));
        float acc[kTile][16] = {};
        for (int64_t c0 = 0; c0 < C; c0 += kChunk) {
          const int n = static_cast<int>(std::min<int64_t>(kChunk, C - c0));
          decode(kind, w + r * rb, c0, n, buf);
          for (int t = 0; t < nt; ++t) dot_chunk(buf, x + (t0 + t) * ldx + c0, n, acc[t]);
        }
        for (int t = 0; t < nt; ++t) y[(t0 + t) * ldy + r] = reduce16(acc[t]);
      }
    }
  });
  return 0;
}

}  // extern "C"
