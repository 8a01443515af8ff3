// The block formats' row loops for stored_cpu.cpp: on AVX-512 `row512` (below), else stored_blocks.h's
// AVX2 `row`; `rows` runs one over a run of rows, `tile` picks the instance for a tile of tokens.
#pragma once
#include <algorithm>

#include "stored_blocks.h"

namespace dfq {
namespace {  // internal linkage: never called through the PLT

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// CPUs with AVX-512 decode every weight exactly as decode() does (stored_cpu.cpp), through the group's
// table of code values (16, or 32 for the 5-bit formats: one mul and one add per 16 values, decode()'s
// operations in its order) indexed by the codes with vpermps, and dot them with fp32 FMAs: ~12
// instructions per 32 Q4_1 weights where the factored AVX2 path takes ~25. Q6_K's and Q5_K's codes are
// decoded by arithmetic instead (q6_half, q5_half): per 32 weights a table of 32 values ran slower than the
// AVX2 path. Q8_0 has no table to gain from: its d*q takes a widening, a conversion and a multiply per 16
// weights, where the factored form shares one multiply by d between two products, so one token runs ~0.85x
// the AVX2 path; and a cheaper exact d*q was not found (fp16 or 2^23-biased codes, an FMA with the bias
// folded in: 0.76-0.96x, tests/bench/RESULTS.md). It stays here because the prefill panel, which must give
// the one-token path's bits, reads these weights at 1.26x the AVX2 rows (128 tokens).
//
// On Intel cores the table lookups, the codes' byte-to-lane widening and the scales' fp16 conversion and
// broadcast all issue on one port (5), ~7 of a Q4_1 group's uops: the matmul ran at ~8.5 cycles per
// group. So a row's fp16 scales are converted up front, four groups at a time (`scales`), and broadcast
// from memory; and the 4-bit formats' code bytes are broadcast to every 128-bit lane and shifted (no
// shuffle), so lane l of a code vector takes byte perm(l) = 4 * (l % 4) + l / 4 of the group and x
// comes with its columns in that order (`permute_x`, once per call). Even and odd groups sum into two
// sets of lanes (an FMA's latency per group bounded one token), added once at the row's end.
//
// Lanes [0, 16) of acc[t] take weights 0-15 of each group of 32 (in perm order for the 4-bit formats),
// lanes [16, 32) weights 16-31; lane 16's m terms are not used (the m is in the table).
template <int K>
constexpr bool wide() { return true; }
template <int K>
constexpr bool lanes() { return K == 2 || K == 3 || K == 12; }  // Q4_0, Q4_1, Q4_K: codes shifted into lanes
constexpr int perm(int l) { return 4 * (l % 4) + l / 4; }
constexpr int64_t kScaleRun = 64;  // 32-weight groups whose scales are converted at a time
constexpr int64_t kBlockRun = 8;  // Q4_K/Q6_K blocks whose scales are converted at a time

// xp [T, C] contiguous: each 32 columns of x [T, C] (row stride ldx) in code-lane order.
inline Floats permute_x(const float* x, int64_t T, int64_t ldx, int64_t C) {
  Floats xp(static_cast<size_t>(T * C));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < C; g += 32)
      for (int l = 0; l < 16; ++l) {
        xp[t * C + g + l] = x[t * ldx + g + perm(l)];
        xp[t * C + g + 16 + l] = x[t * ldx + g + 16 + perm(l)];
      }
  return xp;
}

inline __m512 iota16(float from) {
  return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(from));
}

// dm[2k] and dm[2k + 1]: the fp16 halves at the start of block k of n (<= kScaleRun) 32-weight blocks from
// `first` as fp32, i.e. d and m (Q4_1, Q5_1; otherwise dm[2k + 1] is code bytes, unused). Exact (vcvtph2ps),
// four blocks per conversion (a gather of 16 was slower: gathers are slow on Intel cores since the GDS fix).
template <int K>
inline void scales(const uint8_t* first, int64_t n, float* dm) {
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    uint32_t v[4];
    for (int u = 0; u < 4; ++u) std::memcpy(&v[u], first + (k + u) * block_bytes(K), 4);
    _mm256_storeu_ps(dm + 2 * k, _mm256_cvtph_ps(_mm_setr_epi32(static_cast<int>(v[0]), static_cast<int>(v[1]),
                                                                static_cast<int>(v[2]), static_cast<int>(v[3]))));
  }
  for (; k < n; ++k) {
    dm[2 * k] = h2f(rd16(first + k * block_bytes(K)));
    dm[2 * k + 1] = h2f(rd16(first + k * block_bytes(K) + 2));
  }
}

// Values of codes 0-15 (lo) and, for the 5-bit formats, 16-31 (hi): Q4_0/Q5_0 d * (q - offset); Q4_1/Q5_1
// d * q + m; Q4_K d*sc * q - dmin*mn (here d and m), each as decode() computes it.
template <int K>
inline void tables(float d, float m, __m512* lo, __m512* hi) {
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
  constexpr bool five = K == 6 || K == 7;
  for (int half = 0; half < (five ? 2 : 1); ++half) {
    __m512* out = half ? hi : lo;
    const float first = 16.0f * static_cast<float>(half);
    if constexpr (K == 2 || K == 6)
      *out = _mm512_mul_ps(dv, iota16(first - static_cast<float>(offset<K>())));
    else if constexpr (K == 12)
      *out = _mm512_sub_ps(_mm512_mul_ps(dv, iota16(first)), mv);
    else
      *out = _mm512_add_ps(_mm512_mul_ps(dv, iota16(first)), mv);
  }
}

// Q4_K, Q5_K: the 8 groups' d*sc (ds) and dmin*mn (dm; negate_m: -dmin*mn) of block b, k45_groups' values all
// at once: the 6-bit fields as two words of bytes each (scale_min's rule, 4 groups per word), one conversion
// and multiply per 8 (per group, scale_min's scalar work shared the vector ports and took Q4_K to twice Q4_1's
// time).
inline void k4_scales(const uint8_t* b, float* ds, float* dm, bool negate_m = false) {
  uint32_t w[3];
  std::memcpy(w, b + 4, 12);
  const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, top2 = 0x30303030u;
  const __m128i sc = _mm_setr_epi32(static_cast<int>(w[0] & low6), static_cast<int>((w[2] & low4) | ((w[0] >> 2) & top2)), 0, 0);
  const __m128i mn = _mm_setr_epi32(static_cast<int>(w[1] & low6), static_cast<int>(((w[2] >> 4) & low4) | ((w[1] >> 2) & top2)), 0, 0);
  _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_set1_ps(h2f(rd16(b))), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc))));
  const float dmin = h2f(rd16(b + 2));
  _mm256_storeu_ps(dm, _mm256_mul_ps(_mm256_set1_ps(negate_m ? -dmin : dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn))));
}

// The code indices of 16 bytes broadcast to every 128-bit lane (`c`): lane l's low 4 bits are byte perm(l)'s
// low nibble, or (high) its high nibble; vpermps reads only those 4 bits.
inline __m512i code_lanes(__m512i c, bool high) {
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
  return _mm512_srlv_epi32(c, high ? _mm512_add_epi32(shift, _mm512_set1_epi32(4)) : shift);
}

// Weights 0-15 (w0) and 16-31 (w1) of a group into lane set S (0: even groups, 1: odd) of NT tokens.
template <int NT, int S>
inline void fma2(__m512 w0, __m512 w1, const float* x, int64_t ldx, __m512 (*a)[4]) {
  for (int t = 0; t < NT; ++t) {
    a[t][2 * S] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * ldx), a[t][2 * S]);
    a[t][2 * S + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + t * ldx + 16), a[t][2 * S + 1]);
  }
}

// The exact weights of one 32-weight group of block b (scales dm[0], dm[1]): w0 takes weights 0-15 (in
// perm order for the 4-bit formats), w1 weights 16-31. row512 dots them at once; the prefill panel
// (stored_panel.h) stores them, so both see the same values in the same lanes.
template <int K>
inline __attribute__((always_inline)) void group_w(const uint8_t* b, const float* dm, __m512* w0, __m512* w1) {
  if constexpr (K == 8) {  // Q8_0: code * d (exact: 8 by 11 significant bits)
    const __m512 d = _mm512_set1_ps(dm[0]);
    *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)))), d);
    *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)))), d);
  } else if constexpr (K == 6 || K == 7) {  // Q5_0, Q5_1: codes widened in order, 5th bits from the mask
    __m512 lo, hi;
    tables<K>(dm[0], has_min<K>() ? dm[1] : 0.0f, &lo, &hi);
    uint32_t h;
    std::memcpy(&h, b + (has_min<K>() ? 4 : 2), 4);
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (has_min<K>() ? 8 : 6))));
    const __m512i low4 = _mm512_set1_epi32(15), bit4 = _mm512_set1_epi32(16);
    const __m512i c0 = _mm512_and_si512(c, low4), c1 = _mm512_and_si512(_mm512_srli_epi32(c, 4), low4);
    *w0 = _mm512_permutex2var_ps(lo, _mm512_mask_or_epi32(c0, static_cast<__mmask16>(h), c0, bit4), hi);
    *w1 = _mm512_permutex2var_ps(lo, _mm512_mask_or_epi32(c1, static_cast<__mmask16>(h >> 16), c1, bit4), hi);
  } else {  // Q4_0, Q4_1: weight j's code in the low nibble of byte j, weight 16 + j's in the high
    __m512 lo, hi;
    tables<K>(dm[0], has_min<K>() ? dm[1] : 0.0f, &lo, &hi);
    const __m512i c = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (has_min<K>() ? 4 : 2))));
    *w0 = _mm512_permutexvar_ps(code_lanes(c, false), lo);
    *w1 = _mm512_permutexvar_ps(code_lanes(c, true), lo);
  }
}

// Q4_K: groups 2j and 2j + 1 of block b (k4_scales' ds, dm), the low and high nibbles of the same 32 bytes:
// w[0], w[1] group 2j's weights 0-15 and 16-31 in perm order, w[2], w[3] group 2j + 1's.
inline __attribute__((always_inline)) void k4_pair(const uint8_t* b, int j, const float* ds, const float* dm, __m512 w[4]) {
  const uint8_t* qs = b + 16 + 32 * j;
  const __m512i c0 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m512i c1 = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
  __m512 lo, hi;
  tables<12>(ds[2 * j], dm[2 * j], &lo, &hi);
  w[0] = _mm512_permutexvar_ps(code_lanes(c0, false), lo), w[1] = _mm512_permutexvar_ps(code_lanes(c1, false), lo);
  tables<12>(ds[2 * j + 1], dm[2 * j + 1], &lo, &hi);
  w[2] = _mm512_permutexvar_ps(code_lanes(c0, true), lo), w[3] = _mm512_permutexvar_ps(code_lanes(c1, true), lo);
}

// Q6_K: d * sc for the 16 scales of block b (ds[16], 64-byte aligned), decode_q6_k's products (exact).
inline void q6_scales(const uint8_t* b, float* ds) {
  const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
  _mm512_store_ps(ds, _mm512_mul_ps(_mm512_set1_ps(h2f(rd16(b + 208))), sc));
}

// Q6_K: half h of block b (weights h*128 + [0, 128) in order; ds its 8 scales): w[2k], w[2k + 1] group k's
// weights 0-15 and 16-31, decode_q6_k's arithmetic (d*sc) * (code - 32). The 6-bit codes of 64 weights are
// assembled in one register of bytes; each 16 go to the low bytes of dwords holding 2^23 (vpermb, or a
// widening without VBMI), whose float less 2^23 + 32 is code - 32 exactly: one shuffle, a subtract and a
// multiply per 16 weights, where widening each group's bytes in turn took ~6 instructions more.
inline __attribute__((always_inline)) void q6_half(const uint8_t* b, int h, const float* ds, __m512 w[8]) {
  const __m512i ql = _mm512_loadu_si512(b + h * 64);
  const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + h * 32)));
  const __m512i low4 = _mm512_set1_epi8(15), top2 = _mm512_set1_epi8(0x30);
  // Groups 0 and 1 (ql's bytes 0-31, 32-63): low nibbles, qh's bits 0-1 and 2-3 as bits 4-5; groups 2 and 3:
  // high nibbles, qh's bits 4-5 and 6-7. A shift within 16 bits brings a byte's own bits to 4-5.
  const long long by4 = 0x0004000400040004ll, by2 = 0x0002000200020002ll;  // shift counts per 16 bits
  const __m512i up = _mm512_setr_epi64(by4, by4, by4, by4, by2, by2, by2, by2);
  const __m512i down = _mm512_setr_epi64(0, 0, 0, 0, by2, by2, by2, by2);
  const __m512i v[2] = {
      _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_sllv_epi16(qh, up), top2)),
      _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                      _mm512_and_si512(_mm512_srlv_epi16(qh, down), top2))};
  const __m512i exp23 = _mm512_set1_epi32(0x4B000000);
  const __m512 bias = _mm512_set1_ps(8388608.0f + 32.0f);
  for (int i = 0; i < 8; ++i) {
#ifdef __AVX512VBMI__
    const __m512i idx = _mm512_add_epi8(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi8(static_cast<char>(16 * (i % 4))));
    const __m512i f = _mm512_mask_permutexvar_epi8(exp23, 0x1111111111111111ull, idx, v[i / 4]);
#else
    const __m512i f = _mm512_or_si512(exp23, _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(v[i / 4], i % 4)));
#endif
    w[i] = _mm512_mul_ps(_mm512_set1_ps(ds[i]), _mm512_sub_ps(_mm512_castsi512_ps(f), bias));
  }
}

// Q5_K: half h of block b (groups 4h + k, weights h*128 + k*32 + [0, 32) in order; ds, dm their d*sc and
// -dmin*mn, k4_scales(negate_m)): w[2k], w[2k + 1] group k's weights 0-15 and 16-31. The 5-bit codes of 64
// weights are built in one register of bytes (nibbles, plus 16 where a byte test finds qh's bit g for group
// g), each 16 placed by vpermb into dwords and converted: w = fma(d*sc, code, -dmin*mn), one rounding, the
// bits of decode_k45's (d*sc) * code - dmin*mn since d*sc * code (11 + 6 + 5 significant bits) is exact.
// Per 16 weights a shuffle, a conversion and an FMA: 1.33x the AVX2 path, where a multiply and a subtract
// (the two roundings written out) gave 1.19x, vpermb into dwords of 2^23 less 2^23 1.27x, and per group
// a 32-value table (two FMAs, then vpermt2ps per 16) 1.14x (tests/bench/RESULTS.md).
inline __attribute__((always_inline)) void q5_half(const uint8_t* b, int h, const float* ds, const float* dm,
                                                   __m512 w[8]) {
  const __m512i ql = _mm512_loadu_si512(b + 48 + h * 64);
  const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
  const __m512i low4 = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(16);
  // ql's bytes 0-31 hold groups 4h (low nibbles) and 4h + 1 (high), bytes 32-63 groups 4h + 2 and 4h + 3.
  auto fifth = [&](int lower, int upper) {  // bytes whose 5th bit is set: qh's bit `lower` (bytes 0-31), `upper`
    const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << lower)),
                                           _mm256_set1_epi8(static_cast<char>(1 << upper)), 1);
    return _mm512_test_epi8_mask(qh, bit);
  };
  const __m512i lo = _mm512_and_si512(ql, low4), hi = _mm512_and_si512(_mm512_srli_epi16(ql, 4), low4);
  const __m512i v[2] = {_mm512_mask_add_epi8(lo, fifth(4 * h, 4 * h + 2), lo, bit4),
                        _mm512_mask_add_epi8(hi, fifth(4 * h + 1, 4 * h + 3), hi, bit4)};
  const __m512i exp23 = _mm512_set1_epi32(0x4B000000);
  const __m512 bias = _mm512_set1_ps(8388608.0f);
  for (int i = 0; i < 8; ++i) {  // group k = i / 2: v[k % 2]'s bytes 32 * (k / 2) + 16 * (i % 2) + [0, 16)
    const int k = i / 2, from = 32 * (k / 2) + 16 * (i % 2);
#ifdef __AVX512VBMI__
    const __m512i idx = _mm512_add_epi8(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi8(static_cast<char>(from)));
    const __m512i f = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, idx, v[k % 2]);
#else
    const __m512i f = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(v[k % 2], from / 16));
#endif
    w[i] = _mm512_fmadd_ps(_mm512_set1_ps(ds[k]), _mm512_cvtepi32_ps(f), _mm512_set1_ps(dm[k]));
  }
}

// acc[t] += row . x[t] for NT tokens; xp is x in code-lane order (Q4_0, Q4_1 and Q4_K read it).
template <int K, int NT>
inline __attribute__((always_inline)) void row512(const uint8_t* row, int64_t cols, const float* x, int64_t ldx,
                                                  const float* xp, int64_t ldxp, float (*acc)[32]) {
  if constexpr (!lanes<K>()) xp = x, ldxp = ldx;  // null for the others: no offsets taken from it
  __m512 a[NT][4];
  for (int t = 0; t < NT; ++t) {
    a[t][0] = _mm512_loadu_ps(acc[t]), a[t][1] = _mm512_loadu_ps(acc[t] + 16);
    a[t][2] = a[t][3] = _mm512_setzero_ps();
  }
  if constexpr (K == 12) {  // Q4_K: groups 2j and 2j + 1 are the low and high nibbles of the same 32 bytes
    // A run of blocks' scales first, then broadcast from memory (as Q6_K's, below): kept in registers, each
    // group's two took a shuffle out of a vector and a broadcast, ~30 shuffles a block.
    alignas(64) float ds[8 * kBlockRun], dm[8 * kBlockRun];
    for (int64_t b0 = 0; b0 < cols / 256; b0 += kBlockRun) {
      const int64_t n = std::min<int64_t>(kBlockRun, cols / 256 - b0);
      for (int64_t k = 0; k < n; ++k) k4_scales(row + (b0 + k) * block_bytes(K), ds + 8 * k, dm + 8 * k);
      for (int64_t k = 0; k < n; ++k)
        for (int j = 0; j < 4; ++j) {
          __m512 w[4];
          k4_pair(row + (b0 + k) * block_bytes(K), j, ds + 8 * k, dm + 8 * k, w);
          const float* xg = xp + (b0 + k) * 256 + 64 * j;
          fma2<NT, 0>(w[0], w[1], xg, ldxp, a);
          fma2<NT, 1>(w[2], w[3], xg + 32, ldxp, a);
        }
    }
  } else if constexpr (K == 13) {  // Q5_K: Q4_K's scales, groups 4h + k in natural order (as Q6_K)
    alignas(64) float ds[8 * kBlockRun], dm[8 * kBlockRun];
    for (int64_t b0 = 0; b0 < cols / 256; b0 += kBlockRun) {
      const int64_t n = std::min<int64_t>(kBlockRun, cols / 256 - b0);
      for (int64_t k = 0; k < n; ++k) k4_scales(row + (b0 + k) * block_bytes(K), ds + 8 * k, dm + 8 * k, true);
      for (int64_t k = 0; k < n; ++k)
        for (int h = 0; h < 2; ++h) {
          __m512 w[8];
          q5_half(row + (b0 + k) * block_bytes(K), h, ds + 8 * k + 4 * h, dm + 8 * k + 4 * h, w);
          const float* xg = x + (b0 + k) * 256 + h * 128;
          fma2<NT, 0>(w[0], w[1], xg, ldx, a);
          fma2<NT, 1>(w[2], w[3], xg + 32, ldx, a);
          fma2<NT, 0>(w[4], w[5], xg + 64, ldx, a);
          fma2<NT, 1>(w[6], w[7], xg + 96, ldx, a);
        }
    }
  } else if constexpr (K == 14) {  // Q6_K: groups 4h + k, natural order
    // The scales of a run of blocks first, then broadcast from memory: kept in a register, each of the 16 took a
    // shuffle on the port the codes' vpermb use.
    alignas(64) float ds[16 * kBlockRun];
    for (int64_t b0 = 0; b0 < cols / 256; b0 += kBlockRun) {
      const int64_t n = std::min<int64_t>(kBlockRun, cols / 256 - b0);
      for (int64_t k = 0; k < n; ++k) q6_scales(row + (b0 + k) * block_bytes(K), ds + 16 * k);
      for (int64_t k = 0; k < n; ++k) {
        const uint8_t* b = row + (b0 + k) * block_bytes(K);
        for (int h = 0; h < 2; ++h) {
          __m512 w[8];
          q6_half(b, h, ds + 16 * k + 8 * h, w);
          const float* xg = x + (b0 + k) * 256 + h * 128;
          fma2<NT, 0>(w[0], w[1], xg, ldx, a);
          fma2<NT, 1>(w[2], w[3], xg + 32, ldx, a);
          fma2<NT, 0>(w[4], w[5], xg + 64, ldx, a);
          fma2<NT, 1>(w[6], w[7], xg + 96, ldx, a);
        }
      }
    }
  } else {
    alignas(64) float dm[2 * kScaleRun];
    for (int64_t k0 = 0; k0 < cols / 32; k0 += kScaleRun) {
      const int64_t n = std::min<int64_t>(kScaleRun, cols / 32 - k0);
      const uint8_t* b = row + k0 * block_bytes(K);
      scales<K>(b, n, dm);
      int64_t k = 0;
      for (; k + 2 <= n; k += 2) {
        const int64_t col = 32 * (k0 + k);
        __m512 w0, w1;
        group_w<K>(b + k * block_bytes(K), dm + 2 * k, &w0, &w1);
        fma2<NT, 0>(w0, w1, xp + col, ldxp, a);
        group_w<K>(b + (k + 1) * block_bytes(K), dm + 2 * k + 2, &w0, &w1);
        fma2<NT, 1>(w0, w1, xp + col + 32, ldxp, a);
      }
      if (k < n) {
        __m512 w0, w1;
        group_w<K>(b + k * block_bytes(K), dm + 2 * k, &w0, &w1);
        fma2<NT, 0>(w0, w1, xp + 32 * (k0 + k), ldxp, a);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    _mm512_storeu_ps(acc[t], _mm512_add_ps(a[t][0], a[t][2])), _mm512_storeu_ps(acc[t] + 16, _mm512_add_ps(a[t][1], a[t][3]));
}
#else
template <int K>
constexpr bool wide() { return false; }
template <int K>
constexpr bool lanes() { return false; }
inline Floats permute_x(const float*, int64_t, int64_t, int64_t) { return {}; }
template <int K, int NT>
inline void row512(const uint8_t*, int64_t, const float*, int64_t, const float*, int64_t, float (*)[32]) {}
#endif

// Which forms of x a kind's rows read: its per-32 sums (the AVX2 path's m terms: Q4_1, Q5_1, Q4_K, Q5_K where
// they do not take row512, i.e. without AVX-512) and its columns in code-lane order (permute_x).
template <int K>
constexpr bool sums() { return (K == 3 || K == 7 || K == 12 || K == 13) && !wide<K>(); }
inline bool reads_sums(int kind) {
  return (kind == 3 && sums<3>()) || (kind == 7 && sums<7>()) || (kind == 12 && sums<12>()) || (kind == 13 && sums<13>());
}
inline bool reads_lanes(int kind) { return (kind == 2 && lanes<2>()) || (kind == 3 && lanes<3>()) || (kind == 12 && lanes<12>()); }

#ifdef __AVX2__

constexpr int64_t kAheadBytes = 2048;  // software prefetch distance in a run of rows (tests/bench/RESULTS.md)

// `row` for `nrows` rows `row_bytes` apart, each adding into its own acc (`stride` floats apart): one call
// per run of rows, not per row (a dense layer's down slices are 6 blocks a row). The bytes are prefetched
// kAheadBytes ahead up to `end`, the end of the caller's whole run of this matrix's rows (past this call's
// rows, so a run split into chunks streams on): out of cache, one core streamed Q4_1 weights at ~6 GB/s
// without it.
template <int K, int NT>
__attribute__((noinline)) void rows(const uint8_t* first, int64_t nrows, int64_t row_bytes, int64_t cols, const float* x,
                                    int64_t ldx, const float* xs, int64_t ldxs, const float* xp, int64_t ldxp, float* acc,
                                    int64_t stride, const uint8_t* end) {
  for (int64_t r = 0; r < nrows; ++r) {
    for (const uint8_t* p = first + r * row_bytes + kAheadBytes; p < first + (r + 1) * row_bytes + kAheadBytes && p < end; p += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
    if constexpr (wide<K>())
      row512<K, NT>(first + r * row_bytes, cols, x, ldx, xp, ldxp, reinterpret_cast<float (*)[32]>(acc + r * stride));
    else
      row<K, NT>(first + r * row_bytes, cols, x, ldx, xs, ldxs, reinterpret_cast<float (*)[32]>(acc + r * stride));
  }
}

template <int K>
bool tile(const uint8_t* first, int64_t nrows, int64_t row_bytes, int64_t cols, const float* x, int64_t ldx,
          const float* xs, int64_t ldxs, const float* xp, int64_t ldxp, int nt, float* acc, int64_t stride,
          const uint8_t* end) {
  switch (nt) {
    case 1: rows<K, 1>(first, nrows, row_bytes, cols, x, ldx, xs, ldxs, xp, ldxp, acc, stride, end); return true;
    case 2: rows<K, 2>(first, nrows, row_bytes, cols, x, ldx, xs, ldxs, xp, ldxp, acc, stride, end); return true;
    case 3: rows<K, 3>(first, nrows, row_bytes, cols, x, ldx, xs, ldxs, xp, ldxp, acc, stride, end); return true;
    case 4: rows<K, 4>(first, nrows, row_bytes, cols, x, ldx, xs, ldxs, xp, ldxp, acc, stride, end); return true;
    default: return false;
  }
}

#endif
}  // namespace
}  // namespace dfq
