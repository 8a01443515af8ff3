// The hot loop of stored_cpu.cpp for llama.cpp's 32-weight block formats (Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0), factored: a block's weights are w_i = d*q_i + m with integer codes q_i (Q4_0, Q5_0: the
// 4- or 5-bit code minus 8 or 16, taken in integers; m is nonzero only for Q4_1 and Q5_1), so
//
//     sum_i w_i x_i = d * (sum_i q_i x_i) + m * (sum_i x_i).
//
// Every weight keeps its exact value (the stored d, m and q; nothing is approximated) and the
// activations stay fp32. What changes against decoding each weight to fp32 first (d*q + m, two
// roundings, then an FMA) is only where fp32 rounding happens: noise of the order of a different
// summation order, which tests/unit/test_stored_kernels.py bounds against the widened path. It
// drops a multiply and an add per weight (RESULTS.md: the one-token matmul was bound by that
// per-weight vector work, not by memory).
//
// Lanes per (token, row) in acc[t][32]: [0, 8) take d * (q.x of weights 0-7 and 16-23), [8, 16)
// d * (q.x of 8-15 and 24-31); lane 16 takes the m terms, m * (block sum of x), one block after
// another. The order depends on neither the number of tokens nor of threads.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace dfq {
namespace {  // internal linkage: never called through the PLT

// xs[t * (C / 32) + k] = the sum of x[t, 32k .. 32k + 32), in one fixed order (the m terms below).
std::vector<float> block_sums(const float* x, int64_t T, int64_t ldx, int64_t C) {
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

#ifdef __AVX2__

template <int K>
constexpr int64_t block_bytes() { return K == 8 ? 34 : K == 2 ? 18 : K == 3 ? 20 : K == 6 ? 22 : 24; }
template <int K>
constexpr bool has_min() { return K == 3 || K == 7; }  // Q4_1, Q5_1
template <int K>
constexpr int offset() { return K == 2 ? 8 : K == 6 ? 16 : 0; }  // Q4_0, Q5_0: w = d * (code - offset)

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

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

// acc[t] += row . x[t] for NT tokens over `cols` weights; xs[t * ldxs + k] is the sum of x[t]'s
// block k (df_stored_parts computes it once per call, in one fixed order; unused without m).
template <int K, int NT>
__attribute__((noinline)) void row(const uint8_t* row, int64_t cols, const float* x, int64_t ldx, const float* xs, int64_t ldxs,
         float (*acc)[32]) {
  constexpr int64_t bytes = block_bytes<K>();
  __m256 a[NT][2];
  float am[NT];
  for (int t = 0; t < NT; ++t) {
    a[t][0] = _mm256_loadu_ps(acc[t]);
    a[t][1] = _mm256_loadu_ps(acc[t] + 8);
    am[t] = acc[t][16];
  }
  for (int64_t k = 0; k < cols / 32; ++k) {
    const uint8_t* b = row + k * bytes;
    __m256 q[4];
    codes<K>(b, q);
    const __m256 d = _mm256_set1_ps(half(b));
    const float m = has_min<K>() ? half(b + 2) : 0.0f;
    for (int t = 0; t < NT; ++t) {
      const float* xt = x + t * ldx + 32 * k;
      __m256 s0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(xt)), s1 = _mm256_mul_ps(q[1], _mm256_loadu_ps(xt + 8));
      s0 = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xt + 16), s0);
      s1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xt + 24), s1);
      a[t][0] = _mm256_fmadd_ps(s0, d, a[t][0]);
      a[t][1] = _mm256_fmadd_ps(s1, d, a[t][1]);
      if (has_min<K>()) am[t] = std::fma(m, xs[t * ldxs + k], am[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    _mm256_storeu_ps(acc[t], a[t][0]);
    _mm256_storeu_ps(acc[t] + 8, a[t][1]);
    acc[t][16] = am[t];
  }
}

template <int K>
bool tile(const uint8_t* r, int64_t cols, const float* x, int64_t ldx, const float* xs, int64_t ldxs, int nt,
          float (*acc)[32]) {
  switch (nt) {
    case 1: row<K, 1>(r, cols, x, ldx, xs, ldxs, acc); return true;
    case 2: row<K, 2>(r, cols, x, ldx, xs, ldxs, acc); return true;
    case 3: row<K, 3>(r, cols, x, ldx, xs, ldxs, acc); return true;
    case 4: row<K, 4>(r, cols, x, ldx, xs, ldxs, acc); return true;
    default: return false;
  }
}

#endif
}  // namespace
}  // namespace dfq
