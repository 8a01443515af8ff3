// stored_q8.h's block dot products on AVX2: unsigned weight codes times signed int8 activations pairwise
// into int16 (vpmaddubsw, never saturating for these codes), times the group's scale pairwise into int32
// (vpdpwssd on AVX512-VNNI, vpmaddwd + vpaddd elsewhere: the same integers), one fp32 FMA per block and
// token (Q4_K and Q5_K on AVX512-VNNI with GFNI: stored_q8_vnni512.h, 64 weights a register). The weight codes are
// unpacked once per block and dotted with up to NT token rows, each token in its own registers, and a pass
// takes up to 4 rows side by side; no (row, token) result depends on the others.
#pragma once
#include <immintrin.h>

#include <type_traits>

namespace dfq8 {
namespace {

// acc + the pairwise int16 products p * s summed into int32 lanes.
inline __m256i dotw(__m256i acc, __m256i p, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, p, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

// vpshufb masks: int16 lane `lo` of each 128-bit half into lanes 0-7, lane `hi` into lanes 8-15, at
// [8 * lo + hi]. A table: built from broadcasts in the loop they cost two uops each, 16 a Q4_K block.
struct PickMasks {
  alignas(32) uint8_t m[64][32];
};
constexpr PickMasks make_pick_masks() {
  PickMasks r{};
  for (int lo = 0; lo < 8; ++lo)
    for (int hi = 0; hi < 8; ++hi)
      for (int b = 0; b < 32; ++b) {
        const int w = b < 16 ? lo : hi;  // bytes 0-15: the low half's lanes 0-7; 16-31: the high half's
        r.m[8 * lo + hi][b] = static_cast<uint8_t>(2 * w + (b & 1));
      }
  return r;
}
constexpr PickMasks kPick = make_pick_masks();

inline __m256i pick16(__m256i v, int lo, int hi) {
  return _mm256_shuffle_epi8(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(kPick.m[8 * lo + hi])));
}

inline __m256i load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Bit G of each byte of v moved to bit 4 (Q5_K's fifth bit of group G).
inline __m256i bit_to_4(__m256i v, int g) {
  const __m256i b = _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(1 << g)));
  return g <= 4 ? _mm256_slli_epi16(b, 4 - g) : _mm256_srli_epi16(b, g - 4);
}

// Independent int32 accumulators per token in a block: one chain of vpdpwssd (~5 cycles each) held a
// token's block to ~45 cycles. Integer sums, so how many chains does not change a result.
template <int NT>
constexpr int kChains = NT == 1 ? 4 : NT == 2 ? 2 : 1;

template <int NT>
inline __m256i chains(const __m256i* a) {
  if constexpr (kChains<NT> == 4) return _mm256_add_epi32(_mm256_add_epi32(a[0], a[1]), _mm256_add_epi32(a[2], a[3]));
  else if constexpr (kChains<NT> == 2) return _mm256_add_epi32(a[0], a[1]);
  else return a[0];
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// k_scales_words in vector lanes: dwords (scales 0-3, scales 4-7, mins 0-3, mins 4-7) from the 12 bytes
// (and 4 more that are read, not used). Built in general registers and moved over, they cost ~20 uops a block.
inline __m128i k_scales_vec(const uint8_t* s) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));  // w0 w1 w2 -
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4)),
                                   _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                                   _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));  // ((w >> 6) & 3) << 4
  return _mm_or_si128(lo, hi);
}

template <int K, int NT>
inline __attribute__((always_inline)) void k45_block(const uint8_t* b, const BlockK* const* x, __m256* acc, __m256* accm) {
  const __m256i sm16 = _mm256_cvtepu8_epi16(k_scales_vec(b + 4));
  const __m256i sc = _mm256_permute4x64_epi64(sm16, 0x44);  // the 8 scales in both halves
  const __m128i mn = _mm256_extracti128_si256(sm16, 1);
  const __m256i mn2 = _mm256_set_m128i(_mm_unpackhi_epi16(mn, mn), _mm_unpacklo_epi16(mn, mn));  // mn_g for bsums 2g, 2g+1
  const uint8_t* qs = b + (K == kQ4_K ? 16 : 48);
  const __m256i m4 = _mm256_set1_epi8(15), hb = K == kQ5_K ? load(b + 16) : _mm256_setzero_si256();
  __m256i s[NT][kChains<NT>];
  for (int t = 0; t < NT; ++t)
    for (int a = 0; a < kChains<NT>; ++a) s[t][a] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {  // groups 2j (low nibbles) and 2j + 1 (high) of 32 weights
    const __m256i q = load(qs + 32 * j);
    __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if constexpr (K == kQ5_K) {
      lo = _mm256_or_si256(lo, bit_to_4(hb, 2 * j));
      hi = _mm256_or_si256(hi, bit_to_4(hb, 2 * j + 1));
    }
    const __m256i s0 = pick16(sc, 2 * j, 2 * j), s1 = pick16(sc, 2 * j + 1, 2 * j + 1);
    for (int t = 0; t < NT; ++t) {
      __m256i& a = s[t][j % kChains<NT>];
      a = dotw(a, _mm256_maddubs_epi16(lo, load(x[t]->qs + 64 * j)), s0);
      a = dotw(a, _mm256_maddubs_epi16(hi, load(x[t]->qs + 64 * j + 32)), s1);
    }
  }
  const float d = dfq::h2f(dfq::rd16(b)), dmin = dfq::h2f(dfq::rd16(b + 2));
  for (int t = 0; t < NT; ++t) {
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(chains<NT>(s[t])), _mm256_set1_ps(d * x[t]->d), acc[t]);
    const __m256i m = _mm256_madd_epi16(load(x[t]->bsums), mn2);
    accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(-(dmin * x[t]->d)), accm[t]);
  }
}

template <int NT>
inline __attribute__((always_inline)) void q6_block(const uint8_t* b, const BlockK* const* x, __m256* acc) {
  const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
  __m256i s[NT][kChains<NT>];
  for (int t = 0; t < NT; ++t) {  // the codes' offset of 32, taken once: -32 * sum_g sc_g * (sum of x in g)
    s[t][0] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, load(x[t]->bsums)), 5));
    for (int a = 1; a < kChains<NT>; ++a) s[t][a] = _mm256_setzero_si256();
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // weights 128h + 32k + c: groups 8h + 2k (c < 16) and 8h + 2k + 1
    const __m256i l0 = load(b + 64 * h), l1 = load(b + 64 * h + 32), hb = load(b + 128 + 32 * h);
    const __m256i sch = _mm256_permute4x64_epi64(sc16, h == 0 ? 0x44 : 0xEE);
    const __m256i q[4] = {
        _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)),
        _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30))};
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const __m256i scv = pick16(sch, 2 * k, 2 * k + 1);
      for (int t = 0; t < NT; ++t) {
        __m256i& a = s[t][k % kChains<NT>];
        a = dotw(a, _mm256_maddubs_epi16(q[k], load(x[t]->qs + 128 * h + 32 * k)), scv);
      }
    }
  }
  const float d = dfq::h2f(dfq::rd16(b + 208));
  for (int t = 0; t < NT; ++t)
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(chains<NT>(s[t])), _mm256_set1_ps(d * x[t]->d), acc[t]);
}

template <int NT>
inline __attribute__((always_inline)) void q80_block(const uint8_t* b, const Block0* const* x, __m256* acc) {
  const __m256i w = load(b + 2), aw = _mm256_abs_epi8(w);
  const float dw = dfq::h2f(dfq::rd16(b));
  for (int t = 0; t < NT; ++t) {
    const __m256i sx = _mm256_sign_epi8(load(x[t]->qs), w);  // |w| * (x * sign w) = w * x
    const __m256i s = dotw(_mm256_setzero_si256(), _mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1));
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw * dfq::h2f(x[t]->d)), acc[t]);
  }
}

}  // namespace
}  // namespace dfq8

// Q4_K and Q5_K in 64-weight registers (stored_q8_vnni512.h, with the helpers above) where the CPU has
// AVX512-VNNI and GFNI (Ice Lake, Zen 4 on).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__GFNI__)
#define DF_Q8_K45_512 1
#include "stored_q8_vnni512.h"
#endif

namespace dfq8 {
namespace {

constexpr int64_t kAhead = 2048;  // prefetch distance in a row's bytes, as stored_rows.h streams


// Rows a pass takes for NT token rows: each block's x loads (L1) shared by NR rows, and NR independent
// chains per block, where one row of 8 blocks left the core waiting on each row's final sums. Q6_K's
// 210-byte blocks streamed from memory ran at 13 GB/s four rows at a time, 21 two at a time
// (tests/bench/RESULTS.md, "q8 kernels: 64-weight registers"); its 256-bit form here streams ~10-15 %
// faster than the 64-weight one did ("q8 Q4_K/Q5_K one-token kernels").
template <int K, int NT>
constexpr int kRowsPerPass = NT == 1 ? (K == kQ6_K ? 2 : 4) : NT == 2 && K != kQ6_K ? 2 : 1;

// out[r * NT + t] = row r of NR rows of K (nb blocks each, row_bytes apart) dotted with NT token rows of
// quantized x (token t's blocks at xq + t * xstride). Each (row, token) takes the same instructions in
// the same order for every NR and NT, so its result does not depend on them.
template <int K, int NT, int NR>
__attribute__((noinline)) void row_dot(const uint8_t* row, int64_t row_bytes, int64_t nb, const uint8_t* xq, int64_t xstride,
                                       float* out) {
  using X = std::conditional_t<x_kind(K) == kQ8_K, BlockK, Block0>;
  constexpr int64_t bb = dfq::block_bytes(K);
  __m256 acc[NR][NT], accm[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = accm[r][t] = _mm256_setzero_ps();
#ifdef DF_Q8_K45_512
  __m512 acc512[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc512[r][t] = _mm512_setzero_ps();
#endif
  const X* x[NT];
  for (int64_t i = 0; i < nb; ++i) {
    for (int t = 0; t < NT; ++t) x[t] = reinterpret_cast<const X*>(xq + t * xstride) + i;
    // The pass reads its NR rows (adjacent, q8_cpu.cpp checks) side by side: the bytes after them are
    // fetched as one stream, NR blocks' worth per block index, kAhead past the next pass's start.
    const uint8_t* ahead = row + NR * row_bytes + kAhead + i * NR * bb;
    for (int64_t o = 0; o < NR * bb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const uint8_t* b = row + r * row_bytes + i * bb;
#ifdef DF_Q8_K45_512
      if constexpr (K == kQ4_K || K == kQ5_K)
        k45_block512<K, NT>(b, x, acc512[r], accm[r]);
      else
#endif
      if constexpr (K == kQ4_K || K == kQ5_K)
        k45_block<K, NT>(b, x, acc[r], accm[r]);
      else if constexpr (K == kQ6_K)
        q6_block<NT>(b, x, acc[r]);
      else
        q80_block<NT>(b, x, acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
#ifdef DF_Q8_K45_512
      if constexpr (K == kQ4_K || K == kQ5_K)
        acc[r][t] = _mm256_add_ps(_mm512_castps512_ps256(acc512[r][t]), _mm512_extractf32x8_ps(acc512[r][t], 1));
#endif
      out[r * NT + t] = hsum(acc[r][t]) + hsum(accm[r][t]);
    }
}

}  // namespace
}  // namespace dfq8
