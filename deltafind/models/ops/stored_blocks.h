// llama.cpp's block formats for stored_cpu.cpp: their fields (fp16 scales, K-quant scale/min) and
// the hot loop, factored. In every format a group of 32 (Q6_K: 16) weights is w_i = d*q_i + m with
// integer codes q_i: Q4_0..Q8_0 one d (and m, Q4_1 and Q5_1) per 32 weights; Q4_K/Q5_K d = d*sc and
// m = -dmin*mn per 32; Q6_K d = d*sc per 16, m = 0; code
// offsets (Q4_0's 8, Q5_0's 16, Q6_K's 32) are taken in integers. So
//
//     sum_i w_i x_i = d * (sum_i q_i x_i) + m * (sum_i x_i).
//
// Every weight keeps its exact value (d*sc and dmin*mn are exact in fp32; nothing is approximated)
// and the activations stay fp32. What changes against decoding each weight to fp32 first (d*q + m,
// two roundings, then an FMA) is only where fp32 rounding happens: against an fp64 matmul the error
// stays at an fp32 matmul's level (tests/unit/test_stored_kernels.py). It drops a multiply and an
// add per weight, which bounded the one-token matmul (RESULTS.md), and the K-quants' decode through
// an L1 buffer.
//
// Lanes per (token, row) in acc[t][32]: [0, 8) take d * (q.x of weights 0-7 and 8-15 of each group
// of 32), [8, 16) of weights 16-31; lane 16 takes the m terms, m * (sum of the group's x), one group
// after another. The order depends on neither the number of tokens nor of threads.
//
// That is the AVX2 path. A CPU with AVX-512 takes stored_rows.h's row512 instead: each weight decoded
// exactly (a table of the group's code values, decode()'s arithmetic), then plain fp32 FMAs. The two
// differ only in fp32 rounding; tests/unit/test_stored_kernels.py builds and checks both.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <utility>
#include <vector>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace dfq {
namespace {  // internal linkage: never called through the PLT

// A vector of 64-byte-aligned floats: a zmm load from a 16-byte-aligned vector spans two cache lines
// three times in four, and the prefill panel's FMA tiles ran ~20 % slower on such x (Q4_K's permuted x).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  // Default-initialized, not zeroed: every user writes each float before reading it, and zeroing x's
  // permuted copy was a memset per df_stored_parts call (~1.7 % of a MoE decode token with the one below).
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    if constexpr (sizeof...(A) == 0) ::new (static_cast<void*>(p)) U;
    else ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <class U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
using Floats = std::vector<float, Aligned64<float>>;

// One stored matrix of a df_stored_parts call (cpu_kernels.py's StoredPart): `rows` rows of `cols`
// weights in `kind`, `row_bytes` apart from `data`.
struct Part {
  int64_t kind, rows, cols, row_bytes;
  const uint8_t* data;
};

// Rows per task of a df_stored_parts call over `rows` rows: about four runs of consecutive rows per thread,
// at least 16 rows, so each thread streams long runs of weights. 16-row tasks taken in turn cut both threads'
// streams into ~6 KB pieces, and two threads read the demo's 30 MB head at 13.7 GB/s where runs of its rows
// give 22 (RESULTS.md).
inline int64_t rows_per_task(int64_t rows, int threads) {
  const int64_t per = std::max<int64_t>(1, 4 * static_cast<int64_t>(threads));
  return std::max<int64_t>(16, (rows + per - 1) / per + 15) / 16 * 16;
}

// Bytes of one block of a GGUF block format by its GGML kind id (32 weights a block; 256 for the
// K-quants Q2_K..Q6_K, kinds 10-14), 0 for any other kind: the one table of the block sizes.
constexpr int64_t block_bytes(int kind) {
  return kind == 2 ? 18 : kind == 3 ? 20 : kind == 6 ? 22 : kind == 7 ? 24 : kind == 8 ? 34
       : kind == 10 ? 84 : kind == 11 ? 110 : kind == 12 ? 144 : kind == 13 ? 176 : kind == 14 ? 210
       : kind == 16 ? 66 : kind == 17 ? 74 : kind == 18 ? 98 : kind == 19 ? 50 : kind == 20 ? 18 : kind == 21 ? 110
       : kind == 22 ? 82 : kind == 23 ? 136 : kind == 29 ? 56 : 0;
}

// 256 weights a block: the K-quants and every IQ format but IQ4_NL.
constexpr bool block256(int kind) { return (kind >= 10 && kind <= 14) || (kind >= 16 && kind <= 23 && kind != 20) || kind == 29; }

// The formats' fields, for this header and stored_cpu.cpp's decode alike.
inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

inline float bits_to_float(uint32_t bits) { float f; std::memcpy(&f, &bits, 4); return f; }

// IEEE half -> float, exact for every value (subnormals, infinities, NaN payloads).
inline float h2f(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#endif
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

// One 256-weight Q2_K block (scales[16], qs[64], d, dmin): weight j = 128h + 32s + c has the 2-bit code
// (qs[32h + c] >> 2s) & 3 and sub-block j / 16's 4-bit scale and min; w = (d*sc) * q - dmin*mn, gguf-py's
// operations in its order (no FMA: -ffp-contract=off).
inline void decode_q2_k(const uint8_t* b, float* out) {
  const uint8_t *scales = b, *qs = b + 16;
  const float d = h2f(rd16(b + 80)), dmin = h2f(rd16(b + 82));
  for (int sb = 0; sb < 16; ++sb) {  // weights 16 sb + [0, 16): h = sb / 8, s = (sb / 2) % 4
    const float dl = d * static_cast<float>(scales[sb] & 0xF), ml = dmin * static_cast<float>(scales[sb] >> 4);
    const uint8_t* q = qs + 32 * (sb / 8) + 16 * (sb % 2);
    const int shift = 2 * ((sb / 2) % 4);
    float* o = out + 16 * sb;
    for (int c = 0; c < 16; ++c) o[c] = dl * static_cast<float>((q[c] >> shift) & 3) - ml;
  }
}

// One 256-weight Q3_K block (hmask[32], qs[64], scales[12], d): 6-bit signed scales (low nibbles in
// bytes 0-7, high bit pairs in 8-11, minus 32) per 16 weights; weight j = 128h + 32s + c has the 2-bit
// code (qs[32h + c] >> 2s) & 3, less 4 where bit j / 32 of hmask[c] is clear; w = (d*sc) * q.
inline void decode_q3_k(const uint8_t* b, float* out) {
  const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
  const float d = h2f(rd16(b + 108));
  for (int sb = 0; sb < 16; ++sb) {  // weights 16 sb + [0, 16): h = sb / 8, s = (sb / 2) % 4, hmask bit sb / 2
    const int low = (sc[sb % 8] >> (4 * (sb / 8))) & 0x0F, high = (sc[8 + sb % 4] >> (2 * (sb / 4))) & 3;
    const float dl = d * static_cast<float>(static_cast<int8_t>((low | (high << 4)) - 32));
    const uint8_t *q = qs + 32 * (sb / 8) + 16 * (sb % 2), *m = hmask + 16 * (sb % 2);
    const int shift = 2 * ((sb / 2) % 4), bit = sb / 2;
    float* o = out + 16 * sb;
    for (int c = 0; c < 16; ++c) o[c] = dl * static_cast<float>(((q[c] >> shift) & 3) - (((m[c] >> bit) & 1) ? 0 : 4));
  }
}

// xs[t * (C / 32) + k] = the sum of x[t, 32k .. 32k + 32), in one fixed order (the m terms below).
inline std::vector<float> block_sums(const float* x, int64_t T, int64_t ldx, int64_t C) {
  const int64_t nb = C / 32;
  std::vector<float> xs(static_cast<size_t>(T * nb));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < nb; ++k) {
      const float* v = x + t * ldx + 32 * k;
      float s[8];
      for (int l = 0; l < 8; ++l) s[l] = (v[l] + v[8 + l]) + (v[16 + l] + v[24 + l]);
      xs[t * nb + k] = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
    }
  return xs;
}

// Q4_K/Q5_K: fn(i, ds, dm, q, b, col) for each 32-weight group of a row: w = ds * code - dm with ds = d*sc
// and dm = dmin*mn (both products exact), the group's 32 code bytes q (low nibbles for even i, high for
// odd), its 256-weight block b and its first column.
template <int K, class F>
inline void k45_groups(const uint8_t* row, int64_t cols, F&& fn) {
  for (int64_t blk = 0; blk < cols / 256; ++blk) {
    const uint8_t* b = row + blk * block_bytes(K);
    const float d = h2f(rd16(b)), dmin = h2f(rd16(b + 2));
    for (int i = 0; i < 8; ++i) {
      int sc, mn;
      scale_min(b + 4, i, &sc, &mn);
      fn(i, d * static_cast<float>(sc), dmin * static_cast<float>(mn), b + (K == 12 ? 16 : 48) + (i / 2) * 32, b, blk * 256 + i * 32);
    }
  }
}

#ifdef __AVX2__

template <int K>
constexpr bool has_min() { return K == 3 || K == 7; }  // Q4_1, Q5_1
template <int K>
constexpr int offset() { return K == 2 ? 8 : K == 6 ? 16 : 0; }  // Q4_0, Q5_0: w = d * (code - offset)

// The integer codes of one block as four float vectors (weights 0-7, 8-15, 16-23, 24-31): exact.
template <int K>
inline void codes(const uint8_t* b, __m256 q[4]) {
  if constexpr (K == 8) {
    for (int g = 0; g < 4; ++g)
      q[g] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * g))));
  } else {
    constexpr bool five = K == 6 || K == 7;
    uint32_t qh = 0;
    if (five) std::memcpy(&qh, b + (has_min<K>() ? 4 : 2), 4);
    const uint8_t* qs = b + 2 + (has_min<K>() ? 2 : 0) + (five ? 4 : 0);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), low4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int g = 0; g < 4; ++g) {
      __m256i v = _mm256_cvtepu8_epi32(parts[g]);
      if (five)
        v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(
                                   _mm256_set1_epi32(static_cast<int>(qh >> (8 * g))), lanes), _mm256_set1_epi32(1)), 4));
      if (offset<K>()) v = _mm256_sub_epi32(v, _mm256_set1_epi32(offset<K>()));
      q[g] = _mm256_cvtepi32_ps(v);
    }
  }
}

// One 32-weight group for NT tokens: a[t][0] += d_lo * (q . x over weights 0-15), a[t][1] += d_hi * (16-31).
template <int NT>
inline void dot32(const __m256 q[4], __m256 d_lo, __m256 d_hi, const float* x, int64_t ldx, __m256 (*a)[2]) {
  for (int t = 0; t < NT; ++t) {
    const float* xt = x + t * ldx;
    __m256 lo = _mm256_mul_ps(q[0], _mm256_loadu_ps(xt)), hi = _mm256_mul_ps(q[2], _mm256_loadu_ps(xt + 16));
    lo = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xt + 8), lo);
    hi = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xt + 24), hi);
    a[t][0] = _mm256_fmadd_ps(lo, d_lo, a[t][0]);
    a[t][1] = _mm256_fmadd_ps(hi, d_hi, a[t][1]);
  }
}

// 32 code bytes (0..63) as four float vectors, weights 0-7, 8-15, 16-23, 24-31, minus `offset`: exact.
inline void widen32(__m256i bytes, int offset, __m256 q[4]) {
  const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int g = 0; g < 4; ++g)
    q[g] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[g]), _mm256_set1_epi32(offset)));
}

// acc[t] += row . x[t] for NT tokens over `cols` weights; xs[t * ldxs + k] is the sum of x[t]'s
// 32-column block k (df_stored_parts computes it once per call, in one fixed order).
// Q4_0..Q8_0: one (d, m) per 32 weights. Q4_K/Q5_K: per 256 weights d and dmin, per 32 a 6-bit scale
// and min (w = d*sc * q - dmin*mn: both products exact in fp32). Q6_K: per 256 weights d, per 16 an
// int8 scale (w = d*sc * (q - 32)).
template <int K, int NT>
inline __attribute__((always_inline)) void row(const uint8_t* row, int64_t cols, const float* x, int64_t ldx,
                                               const float* xs, int64_t ldxs, float (*acc)[32]) {
  __m256 a[NT][2];
  float am[NT];
  for (int t = 0; t < NT; ++t) {
    a[t][0] = _mm256_loadu_ps(acc[t]);
    a[t][1] = _mm256_loadu_ps(acc[t] + 8);
    am[t] = acc[t][16];
  }
  __m256 q[4];
  if constexpr (K == 12 || K == 13) {  // Q4_K, Q5_K
    k45_groups<K>(row, cols, [&](int i, float ds, float dm, const uint8_t* qs, const uint8_t* b, int64_t col) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
      v = _mm256_and_si256(i % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
      if (K == 13) {  // bit i of qh[c] is the 5th bit of weight c
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
        v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(i)),
                                                                  _mm256_set1_epi8(1)), 4));
      }
      widen32(v, 0, q);
      dot32<NT>(q, _mm256_set1_ps(ds), _mm256_set1_ps(ds), x + col, ldx, a);
      for (int t = 0; t < NT; ++t) am[t] = std::fma(-dm, xs[t * ldxs + col / 32], am[t]);
    });
  } else if constexpr (K == 14) {  // Q6_K
    for (int64_t blk = 0; blk < cols / 256; ++blk) {
      const uint8_t* b = row + blk * block_bytes(K);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = h2f(rd16(b + 208));
      for (int h = 0; h < 2; ++h) {
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + h * 32));
        for (int k = 0; k < 4; ++k) {  // weights h*128 + k*32 + [0, 32), as decode_q6_k
          const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + h * 64 + (k % 2) * 32));
          const __m256i l4 = _mm256_and_si256(k / 2 ? _mm256_srli_epi16(lo, 4) : lo, _mm256_set1_epi8(15));
          const __m256i h2 = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
          widen32(_mm256_or_si256(l4, _mm256_slli_epi16(h2, 4)), 32, q);
          dot32<NT>(q, _mm256_set1_ps(d * static_cast<float>(sc[h * 8 + k * 2])),
                    _mm256_set1_ps(d * static_cast<float>(sc[h * 8 + k * 2 + 1])), x + blk * 256 + h * 128 + k * 32, ldx, a);
        }
      }
    }
  } else {  // the 32-weight block formats
    constexpr int64_t bytes = block_bytes(K);
    for (int64_t k = 0; k < cols / 32; ++k) {
      const uint8_t* b = row + k * bytes;
      codes<K>(b, q);
      const __m256 d = _mm256_set1_ps(h2f(rd16(b)));
      dot32<NT>(q, d, d, x + 32 * k, ldx, a);
      if (has_min<K>())
        for (int t = 0; t < NT; ++t) am[t] = std::fma(h2f(rd16(b + 2)), xs[t * ldxs + k], am[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    _mm256_storeu_ps(acc[t], a[t][0]);
    _mm256_storeu_ps(acc[t] + 8, a[t][1]);
    acc[t][16] = am[t];
  }
}

#endif
}  // namespace
}  // namespace dfq
