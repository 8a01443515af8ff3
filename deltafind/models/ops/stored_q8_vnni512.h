// stored_q8.h's Q4_K and Q6_K block dot products on AVX512-VNNI, 64 weights a register: vpdpbusd takes the
// unsigned codes times the signed int8 activations four at a time into int32 (no int16 step, no sign trick;
// a lane's sum is at most 4 * 63 * 127, an exact int16), two such results are packed to int16 (vpackssdw,
// never saturating) and one vpdpwssd multiplies each word by its group's scale into the block's int32 sum.
// The same integers as the AVX2 form; only the fp32 sum of the blocks runs in 16 lanes instead of 8
// (docs/math-modes.md).
#pragma once
#include <immintrin.h>

namespace dfq8 {
namespace {

// vpshufb masks for Q4_K's scales against two blocks' products packed to int16 (vpackssdw of the
// results for 32-byte pieces 2jp and 2jp + 1): in 128-bit lanes 0-1 words 0-3 hold group 4jp, words 4-7
// group 4jp + 2; in lanes 2-3 groups 4jp + 1 and 4jp + 3. Each word picks its scale byte, high byte zero.
struct Q4kScaleMasks {
  alignas(64) uint8_t m[2][64];
};
constexpr Q4kScaleMasks make_q4k_scale_masks() {
  Q4kScaleMasks r{};
  for (int jp = 0; jp < 2; ++jp)
    for (int b = 0; b < 64; ++b) {
      const int lane = b / 16, w = (b % 16) / 2;
      r.m[jp][b] = b % 2 ? 0x80 : static_cast<uint8_t>(4 * jp + (w < 4 ? 0 : 2) + (lane >= 2 ? 1 : 0));
    }
  return r;
}
constexpr Q4kScaleMasks kQ4kScales = make_q4k_scale_masks();

// Q4_K: 32 packed bytes hold group 2j (low nibbles) and 2j + 1 (high), dotted with x's 64 bytes at 64j;
// two such products (|lane| <= 4 * 15 * 127) packed to int16 take one vpdpwssd by their scales.
template <int NT>
inline __attribute__((always_inline)) void q4k_block512(const uint8_t* b, const BlockK* const* x, __m512* acc,
                                                        __m256* accm) {
  const __m128i packed = k_scales_vec(b + 4);                      // scales 0-7, mins 0-7 (bytes)
  const __m512i sc4 = _mm512_broadcast_i32x4(packed);
  const __m128i mn = _mm_unpackhi_epi64(packed, packed);           // mins 0-7 in the low 8 bytes
  const __m256i mn16 = _mm256_cvtepu8_epi16(mn);                   // mins, int16, twice
  const __m256i mn2 = _mm256_permutexvar_epi16(_mm256_setr_epi16(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), mn16);
  const __m512i m4 = _mm512_set1_epi8(15), sh = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const uint8_t* qs = b + 16;
  __m512i s[NT][2];
  for (int t = 0; t < NT; ++t) s[t][0] = s[t][1] = _mm512_setzero_si512();
#pragma GCC unroll 2
  for (int jp = 0; jp < 2; ++jp) {
    __m512i q[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i q32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * jp + 32 * h));
      q[h] = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(q32), sh), m4);
    }
    const __m512i scv = _mm512_shuffle_epi8(sc4, _mm512_load_si512(kQ4kScales.m[jp]));
    for (int t = 0; t < NT; ++t) {
      const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], _mm512_loadu_si512(x[t]->qs + 128 * jp));
      const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[1], _mm512_loadu_si512(x[t]->qs + 128 * jp + 64));
      s[t][jp] = _mm512_dpwssd_epi32(s[t][jp], _mm512_packs_epi32(p0, p1), scv);
    }
  }
  uint32_t dpair;
  std::memcpy(&dpair, b, 4);
  const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dpair)));  // d, dmin
  for (int t = 0; t < NT; ++t) {
    const __m128 f = _mm_mul_ps(dd, _mm_set1_ps(x[t]->d));  // d * dx, dmin * dx: the scalar products
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s[t][0], s[t][1])), _mm512_broadcastss_ps(f), acc[t]);
    const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[t]->bsums)), mn2);
    accm[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_broadcastss_ps(_mm_movehdup_ps(f)), accm[t]);
  }
}

// vpshufb masks for Q6_K's int16 scales (groups 8h..8h+7 in every 128-bit lane) against the packed
// products of codes k = 0, 1: in lane L words 0-3 hold group 8h + L, words 4-7 group 8h + 4 + L.
struct Q6kScaleMasks {
  alignas(64) uint8_t m[64];
};
constexpr Q6kScaleMasks make_q6k_scale_masks() {
  Q6kScaleMasks r{};
  for (int b = 0; b < 64; ++b) {
    const int lane = b / 16, w = (b % 16) / 2;
    r.m[b] = static_cast<uint8_t>(2 * ((w < 4 ? 0 : 4) + lane) + b % 2);
  }
  return r;
}
constexpr Q6kScaleMasks kQ6kScales = make_q6k_scale_masks();

// Q6_K: weights 128h + 32k + c; the 64 low-nibble bytes at 64h give codes k = 0, 1 (low nibbles) and
// k = 2, 3 (high), their two high bits from the 32 bytes at 128 + 32h; a 128-bit lane is one group of 16.
// The two products of an h (|lane| <= 4 * 63 * 127) packed to int16 take one vpdpwssd by their scales.
template <int NT>
inline __attribute__((always_inline)) void q6k_block512(const uint8_t* b, const BlockK* const* x, __m512* acc) {
  const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
  const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
  const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  __m512i s[NT][2];
  for (int t = 0; t < NT; ++t) {  // the codes' offset of 32, taken once: -32 * sum_g sc_g * (sum of x in g)
    const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[t]->bsums))), 5);
    s[t][0] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(off));
    s[t][1] = _mm512_setzero_si512();
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m512i l = _mm512_loadu_si512(b + 64 * h);
    const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
    const __m512i q0 = _mm512_ternarylogic_epi32(l, m4, _mm512_and_si512(_mm512_sllv_epi16(hb, shl), m30), 0xEA);  // (a & b) | c
    const __m512i q1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(l, 4), m4, _mm512_and_si512(_mm512_srlv_epi16(hb, shr), m30), 0xEA);
    const __m512i sch = _mm512_broadcast_i32x4(h == 0 ? _mm256_castsi256_si128(sc16) : _mm256_extracti128_si256(sc16, 1));
    const __m512i scv = _mm512_shuffle_epi8(sch, _mm512_load_si512(kQ6kScales.m));
    for (int t = 0; t < NT; ++t) {
      const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q0, _mm512_loadu_si512(x[t]->qs + 128 * h));
      const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q1, _mm512_loadu_si512(x[t]->qs + 128 * h + 64));
      s[t][h] = _mm512_dpwssd_epi32(s[t][h], _mm512_packs_epi32(p0, p1), scv);
    }
  }
  const float d = dfq::h2f(dfq::rd16(b + 208));
  for (int t = 0; t < NT; ++t)
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s[t][0], s[t][1])), _mm512_set1_ps(d * x[t]->d), acc[t]);
}

}  // namespace
}  // namespace dfq8
