// MXFP4 (compressed-tensors mxfp4-pack-quantized) fused dequant + matmul for CPUs.
//
// y[t, r] = sum_g 2^(s[r,g]-127) * sum_{j<32} e2m1(code[r, 32g+j]) * x[t, 32g+j]
// Weights are decoded in registers (never materialised); activations stay fp32.
// The summation order of one (t, r) is fixed (8 lanes, group by group, one tree
// at the end; 32 lanes on AVX-512, rows512 below) and does not depend on T or on
// the thread count, so one token and a batch of tokens give bit-identical rows.
// Built by deltafind/models/ops/cpu_kernels.py.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_pool.h"
#include "stored_blocks.h"  // dfq::Floats: x split into 64-byte-aligned rows, one cache line per zmm load
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

// 2 * E2M1 value by code (sign bit 3): integers, so int8 lookups and int->float are exact.
const int8_t kTwiceE2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
const float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// kPow2[s + off] = 2^(s - 128 + off) for the E8M0 byte s: a table, since ldexp per group is slow.
struct Pow2Table {
  float v[257];
  Pow2Table() {
    for (int i = 0; i < 257; ++i) v[i] = std::ldexp(1.0f, i - 128);
  }
};
const Pow2Table kPow2;
inline float half_scale(uint8_t s) { return kPow2.v[s]; }     // 0.5 * 2^(s-127)
inline float full_scale(uint8_t s) { return kPow2.v[s + 1]; }  // 2^(s-127)

using df::pool;

constexpr int kTile = 8;  // tokens per register tile

#ifdef __AVX2__
// The 32 weights of one group as four vectors of 2 * E2M1 (columns 0-7, 8-15, 16-23, 24-31).
inline void decode_group(const uint8_t* p, __m256 w[4]) {
  const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kTwiceE2M1));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(b, low4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
  const __m128i v0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));  // columns 0..15
  const __m128i v1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));  // columns 16..31
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)));
}

// One group's contribution, in the one order every path uses.
inline __m256 group_dot(const __m256 w[4], const float* xg, __m256 hs, __m256 yv) {
  __m256 acc = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
  acc = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), acc);
  acc = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), acc);
  acc = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), acc);
  return _mm256_fmadd_ps(acc, hs, yv);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// One token, four rows at once: four independent chains keep the FMA units busy.
void rows4_one_token(const float* x, const uint8_t* packed, const uint8_t* scale, int64_t r, int64_t C, float* y) {
  const int64_t G = C / 32;
  __m256 yv[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < G; ++g) {
    const float* xg = x + g * 32;
    for (int k = 0; k < 4; ++k) {
      __m256 w[4];
      decode_group(packed + (r + k) * (C / 2) + g * 16, w);
      yv[k] = group_dot(w, xg, _mm256_set1_ps(half_scale(scale[(r + k) * G + g])), yv[k]);
    }
  }
  for (int k = 0; k < 4; ++k) y[r + k] = hsum(yv[k]);
}
#endif

// Rows [r0, r1) for tokens [t0, t0+nt), nt <= kTile.
void rows_tile(const float* x, int64_t ldx, int nt, const uint8_t* packed, const uint8_t* scale,
               int64_t r0, int64_t r1, int64_t C, float* y, int64_t ldy) {
  const int64_t G = C / 32;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* prow = packed + r * (C / 2);
    const uint8_t* srow = scale + r * G;
#ifdef __AVX2__
    if (nt == 1 && r + 4 <= r1) {
      rows4_one_token(x, packed, scale, r, C, y);
      r += 3;
      continue;
    }
    __m256 yv[kTile];
    for (int t = 0; t < nt; ++t) yv[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256 w[4];
      decode_group(prow + g * 16, w);
      const __m256 hs = _mm256_set1_ps(half_scale(srow[g]));
      for (int t = 0; t < nt; ++t) yv[t] = group_dot(w, x + t * ldx + g * 32, hs, yv[t]);
    }
    for (int t = 0; t < nt; ++t) y[t * ldy + r] = hsum(yv[t]);
#else
    // Same lanes and order as the AVX2 path, written out for other CPUs.
    float yv[kTile][8] = {};
    for (int64_t g = 0; g < G; ++g) {
      float w[32];
      for (int j = 0; j < 16; ++j) {
        w[2 * j] = kTwiceE2M1[prow[g * 16 + j] & 15];
        w[2 * j + 1] = kTwiceE2M1[prow[g * 16 + j] >> 4];
      }
      const float hs = half_scale(srow[g]);
      for (int t = 0; t < nt; ++t) {
        const float* xg = x + t * ldx + g * 32;
        for (int l = 0; l < 8; ++l) {
          float acc = w[l] * xg[l];
          acc = std::fma(w[8 + l], xg[8 + l], acc);
          acc = std::fma(w[16 + l], xg[16 + l], acc);
          acc = std::fma(w[24 + l], xg[24 + l], acc);
          yv[t][l] = std::fma(acc, hs, yv[t][l]);
        }
      }
    }
    for (int t = 0; t < nt; ++t) {
      const float* v = yv[t];
      float s0 = v[0] + v[4], s1 = v[1] + v[5], s2 = v[2] + v[6], s3 = v[3] + v[7];
      y[t * ldy + r] = (s0 + s2) + (s1 + s3);
    }
#endif
  }
}

// Tokens per pass of the split rows (AVX-512): 6, two rows sharing each load of x (a tile of 8 tokens of
// a 3584-wide x, 115 KB, came from L2 for every row). Each pass decodes the rows' weights again: 6 tokens
// (24 accumulators) over 4 ran a K3 expert 3-4 % faster at 64 and 128 tokens (tests/bench/RESULTS.md).
constexpr int kSplitTile = 6;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// AVX-512: each weight decoded exactly as df_mxfp4_dequant decodes it, E2M1 value * 2^(s-127), from the
// group's 16-value table (one multiply) indexed by the codes with vpermps: even columns from the low
// nibbles, odd ones from the high, dotted with x's even and odd columns (split once per call, `split`).
// Per 32 weights ~8 instructions where the AVX2 path above takes ~20. Two accumulators per (row, token),
// even and odd columns, reduced in one fixed tree: the order depends on neither T nor the threads.
constexpr bool kSplit = true;

// xs [T, C]: per group of 32 columns, x's 16 even columns then its 16 odd ones.
dfq::Floats split(const float* x, int64_t T, int64_t ldx, int64_t C) {
  dfq::Floats xs(static_cast<size_t>(T * C));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; c += 2) {
      const int64_t g = c / 32 * 32, j = (c % 32) / 2;
      xs[t * C + g + j] = x[t * ldx + c];
      xs[t * C + g + 16 + j] = x[t * ldx + c + 1];
    }
  return xs;
}

// NR rows from r, NT tokens of xs: NR * NT independent pairs of FMA chains.
template <int NR, int NT>
void rows512(const float* xs, int64_t C, const uint8_t* packed, const uint8_t* scale, int64_t r, float* y, int64_t ldy) {
  const int64_t G = C / 32;
  const __m512 e2m1 = _mm512_loadu_ps(kE2M1);
  __m512 a[NR][NT][2];
  for (int k = 0; k < NR; ++k)
    for (int t = 0; t < NT; ++t) a[k][t][0] = a[k][t][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int k = 0; k < NR; ++k) {
      const __m512 table = _mm512_mul_ps(e2m1, _mm512_set1_ps(full_scale(scale[(r + k) * G + g])));
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + (r + k) * (C / 2) + g * 16)));
      const __m512 even = _mm512_permutexvar_ps(codes, table), odd = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
      for (int t = 0; t < NT; ++t) {
        a[k][t][0] = _mm512_fmadd_ps(even, _mm512_loadu_ps(xs + t * C + g * 32), a[k][t][0]);
        a[k][t][1] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(xs + t * C + g * 32 + 16), a[k][t][1]);
      }
    }
  }
  for (int k = 0; k < NR; ++k)
    for (int t = 0; t < NT; ++t) {
      alignas(64) float v[16];
      _mm512_store_ps(v, _mm512_add_ps(a[k][t][0], a[k][t][1]));
      float s[4];
      for (int l = 0; l < 4; ++l) s[l] = (v[l] + v[8 + l]) + (v[4 + l] + v[12 + l]);
      y[t * ldy + r + k] = (s[0] + s[2]) + (s[1] + s[3]);
    }
}

template <int NT>
void tile512(const float* xs, int64_t C, const uint8_t* packed, const uint8_t* scale, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  int64_t r = r0;
  for (; r + 2 <= r1; r += 2) rows512<2, NT>(xs, C, packed, scale, r, y, ldy);
  for (; r < r1; ++r) rows512<1, NT>(xs, C, packed, scale, r, y, ldy);
}

// Rows [r0, r1) for tokens [t0, t0+nt) of the split x, nt <= kSplitTile.
void rows_split(const float* xs, int nt, const uint8_t* packed, const uint8_t* scale, int64_t r0, int64_t r1, int64_t C,
                float* y, int64_t ldy) {
  switch (nt) {
    case 1: tile512<1>(xs, C, packed, scale, r0, r1, y, ldy); break;
    case 2: tile512<2>(xs, C, packed, scale, r0, r1, y, ldy); break;
    case 3: tile512<3>(xs, C, packed, scale, r0, r1, y, ldy); break;
    case 4: tile512<4>(xs, C, packed, scale, r0, r1, y, ldy); break;
    case 5: tile512<5>(xs, C, packed, scale, r0, r1, y, ldy); break;
    default: tile512<kSplitTile>(xs, C, packed, scale, r0, r1, y, ldy); break;
  }
}
#else
constexpr bool kSplit = false;
dfq::Floats split(const float*, int64_t, int64_t, int64_t) { return {}; }
void rows_split(const float*, int, const uint8_t*, const uint8_t*, int64_t, int64_t, int64_t, float*, int64_t) {}
#endif

// Rows [r0, r1) of W (packed, scale) for all T tokens of x: by the split x where the build takes it.
void rows_all(const float* x, int64_t ldx, const dfq::Floats& xs, int64_t T, const uint8_t* packed, const uint8_t* scale,
              int64_t r0, int64_t r1, int64_t C, float* y, int64_t ldy) {
  const int tile = kSplit ? kSplitTile : kTile;
  for (int64_t t0 = 0; t0 < T; t0 += tile) {
    const int nt = static_cast<int>(std::min<int64_t>(tile, T - t0));
    if (kSplit)
      rows_split(xs.data() + t0 * C, nt, packed, scale, r0, r1, C, y + t0 * ldy, ldy);
    else
      rows_tile(x + t0 * ldx, ldx, nt, packed, scale, r0, r1, C, y + t0 * ldy, ldy);
  }
}

}  // namespace

extern "C" {

// y [T, R] (row stride ldy) = x [T, C] (row stride ldx) @ W.T, W given as packed [R, C/2], scale [R, C/32].
int df_mxfp4_matmul(const float* x, int64_t T, int64_t ldx, const uint8_t* packed, const uint8_t* scale,
                    int64_t R, int64_t C, float* y, int64_t ldy, int threads) {
  if (C % 32 != 0) return 1;
  const int64_t rows_per_task = 64;
  const int tasks = static_cast<int>((R + rows_per_task - 1) / rows_per_task);
  const dfq::Floats xs = kSplit ? split(x, T, ldx, C) : dfq::Floats();
  pool().run(tasks, threads, [&](int i) {
    const int64_t r0 = i * rows_per_task, r1 = std::min<int64_t>(R, r0 + rows_per_task);
    rows_all(x, ldx, xs, T, packed, scale, r0, r1, C, y, ldy);
  });
  return 0;
}

// h [T, R] = situ(x @ W1.T, x @ W3.T): the routed expert's first half in one pass, SiTU in the
// docs/kimi-k3-format.md §4.6 order: (tanh(g/beta)*beta*sigmoid(g)) * (tanh(u/lbeta)*lbeta). No torch op (and no
// torch thread wake-up) between the two matmuls and the activation.
int df_mxfp4_gate_up_situ(const float* x, int64_t T, const uint8_t* p1, const uint8_t* s1, const uint8_t* p3,
                          const uint8_t* s3, int64_t R, int64_t C, float beta, float lbeta, float* h, int threads) {
  if (C % 32 != 0) return 1;
  const int64_t rows_per_task = 64;
  const int tasks = static_cast<int>((R + rows_per_task - 1) / rows_per_task);
  std::vector<float> g(static_cast<size_t>(T * R)), u(static_cast<size_t>(T * R));
  const dfq::Floats xs = kSplit ? split(x, T, C, C) : dfq::Floats();
  pool().run(tasks, threads, [&](int i) {
    const int64_t r0 = i * rows_per_task, r1 = std::min<int64_t>(R, r0 + rows_per_task);
    rows_all(x, C, xs, T, p1, s1, r0, r1, C, g.data(), R);
    rows_all(x, C, xs, T, p3, s3, r0, r1, C, u.data(), R);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t r = r0; r < r1; ++r) {
        const float gv = g[t * R + r], uv = u[t * R + r];
        const float sig = 1.0f / (1.0f + std::exp(-gv));
        h[t * R + r] = (std::tanh(gv / beta) * beta * sig) * (std::tanh(uv / lbeta) * lbeta);
      }
    }
  });
  return 0;
}

// w [R, C] fp32 = exact dequantisation.
int df_mxfp4_dequant(const uint8_t* packed, const uint8_t* scale, int64_t R, int64_t C, float* w, int threads) {
  if (C % 32 != 0) return 1;
  const int64_t rows_per_task = 64;
  const int tasks = static_cast<int>((R + rows_per_task - 1) / rows_per_task);
  pool().run(tasks, threads, [&](int i) {
    const int64_t r0 = i * rows_per_task, r1 = std::min<int64_t>(R, r0 + rows_per_task);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < C / 32; ++g) {
        const float f = full_scale(scale[r * (C / 32) + g]);
        const uint8_t* p = packed + r * (C / 2) + g * 16;
        float* out = w + r * C + g * 32;
        for (int j = 0; j < 16; ++j) {
          out[2 * j] = kE2M1[p[j] & 15] * f;
          out[2 * j + 1] = kE2M1[p[j] >> 4] * f;
        }
      }
    }
  });
  return 0;
}

int df_mxfp4_abi(void) { return 2; }
}
