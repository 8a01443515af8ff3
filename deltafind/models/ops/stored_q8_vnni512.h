// stored_q8.h's Q4_K and Q5_K block dot products on AVX512-VNNI with GFNI, 64 weights a register: the
// codes unpacked by vgf2p8affineqb, vpdpbusd takes them times the signed int8 activations four at a time
// into int32 (no int16 step, no sign trick: a lane's sum is at most 4 * 31 * 127, so it is also an exact
// int16), then one vpdpwssd multiplies two groups' lanes at once, as (sum, sum') by (scale, scale'), into
// the block's int32 sum. The same integers as the AVX2 form; only the fp32 sum of the blocks runs in 16
// lanes instead of 8 (docs/math-modes.md). Q6_K stays on the 256-bit form: it streams from memory faster.
#pragma once
#include <immintrin.h>

namespace dfq8 {
namespace {

// vpshufb controls on Q4_K's 16 unpacked scale bytes (in each 128-bit lane): scales[k] makes the int16
// pairs (scale 4k, scale 4k + 2) in int32 lanes 0-7 and (4k + 1, 4k + 3) in lanes 8-15; mins puts min g
// in int16 lanes 2g and 2g + 1 of a ymm (beside bsums 2g, 2g + 1).
struct Q4Picks {
  alignas(64) uint8_t scales[2][64];
  alignas(32) uint8_t mins[32];
};
constexpr Q4Picks make_q4_picks() {
  Q4Picks r{};
  for (int k = 0; k < 2; ++k)
    for (int b = 0; b < 64; ++b)  // byte b of int32 lane b / 4; 0x80 zeroes the pairs' high bytes
      r.scales[k][b] = b % 2 ? 0x80 : static_cast<uint8_t>(4 * k + (b >= 32) + (b % 4 ? 2 : 0));
  for (int b = 0; b < 32; ++b) r.mins[b] = b % 2 ? 0x80 : static_cast<uint8_t>(8 + (b % 16) / 4 + 4 * (b >= 16));
  return r;
}
constexpr Q4Picks kQ4Picks = make_q4_picks();

// Q4_K/Q5_K: 32 packed bytes hold group 2j (low nibbles) and 2j + 1 (high), dotted with x's 64 bytes at
// 64j; Q5_K's fifth bits are bit g of the 32 bytes at 16. The scales are picked in-lane (vpshufb) from the
// unpacked bytes broadcast to each 128-bit lane, where a cross-lane pick per group and a vpdpwssd per 64
// weights cost ~9 % (tests/bench/RESULTS.md).
template <int K, int NT>
inline __attribute__((always_inline)) void k45_block512(const uint8_t* b, const BlockK* const* x, __m512* acc,
                                                        __m256* accm) {
  const __m512i sm = _mm512_broadcast_i32x4(k_scales_vec(b + 4));  // scales 0-7, mins 0-7 in each lane
  const __m256i mn2 = _mm256_shuffle_epi8(_mm512_castsi512_si256(sm), _mm256_load_si256(reinterpret_cast<const __m256i*>(kQ4Picks.mins)));
  // GF(2) bit matrices (vgf2p8affineqb): the 32 bytes' low nibbles in the low half, high nibbles in the
  // high half, in one op where a shift and a mask took two.
  const __m512i nib = _mm512_inserti64x4(_mm512_set1_epi64(0x0102040800000000), _mm256_set1_epi64x(0x1020408000000000), 1);
  const uint8_t* qs = b + (K == kQ4_K ? 16 : 48);
  const __m512i hb = K == kQ5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16))) : nib;
  __m512i s[NT][2];
  for (int t = 0; t < NT; ++t) s[t][0] = s[t][1] = _mm512_setzero_si512();
#pragma GCC unroll 2
  for (int k = 0; k < 2; ++k) {  // groups 4k, 4k + 1 (j = 2k) and 4k + 2, 4k + 3 (j = 2k + 1)
    __m512i q[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i q32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * k + 32 * h));
      q[h] = _mm512_gf2p8affine_epi64_epi8(_mm512_broadcast_i64x4(q32), nib, 0);
      if constexpr (K == kQ5_K) {  // bit 2j (low half) or 2j + 1 (high half) of each byte to bit 4
        const int g = 4 * k + 2 * h;
        const __m512i five = _mm512_inserti64x4(_mm512_set1_epi64(int64_t{1} << (g + 24)), _mm256_set1_epi64x(int64_t{2} << (g + 24)), 1);
        q[h] = _mm512_or_si512(q[h], _mm512_gf2p8affine_epi64_epi8(hb, five, 0));
      }
    }
    const __m512i sck = _mm512_shuffle_epi8(sm, _mm512_load_si512(reinterpret_cast<const __m512i*>(kQ4Picks.scales[k])));
    for (int t = 0; t < NT; ++t) {
      const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], _mm512_loadu_si512(x[t]->qs + 128 * k));
      const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[1], _mm512_loadu_si512(x[t]->qs + 128 * k + 64));
      // Each lane's two sums (|p| <= 4 * 31 * 128) as an int16 pair (p0, p1): one vpdpwssd for both.
      const __m512i pp = _mm512_mask_blend_epi16(0xAAAAAAAAu, p0, _mm512_slli_epi32(p1, 16));
      s[t][k] = _mm512_dpwssd_epi32(s[t][k], pp, sck);
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

}  // namespace
}  // namespace dfq8
