// The prefill path of stored_cpu.cpp on AVX-512: a block of rows decoded once per chunk of columns into
// an fp32 panel in L1, then register-blocked FMAs over kNR rows x kNT tokens at a time, so a weight is
// decoded once per kTB tokens (not once per 4, as row512 does) and each load of x or of a weight feeds
// several FMAs. The panel holds exactly the vectors row512 / fused_row build in registers (stored_rows.h
// group_w, k4_pair, q5_half, q6_half; bf16/f16/row-int8 widened as fused_row does), and every (token, row) sums
// into the same lanes in the same order: lanes [0, 32) over even 32-weight groups, [32, 64) over odd ones
// (the block formats; bf16/f16/row-int8 use one set), added once per matrix. So a row's result is
// bit-identical to the one-token path and does not depend on the batch (tests/unit/test_stored_kernels.py).
#pragma once
#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "stored_rows.h"

namespace dfq {
namespace {  // internal linkage: never called through the PLT

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// Measured on Zen 4 under load (tests/bench/RESULTS.md): 4 x 5 beat 4 x 6, 4 x 4 and 5 x 4; a panel of 4 rows
// (16 KB, in L1 while every tile of tokens passes) beat 8, 16 and 32; 1024 columns beat 512 and 2048.
constexpr int kNR = 4, kNT = 5;  // rows x tokens in registers: 20 accumulators, 4 weight vectors, 5 of x
constexpr int64_t kKC = 1024;    // columns decoded at a time, a multiple of 64 (even groups) and of 256 (K-quant blocks)
constexpr int64_t kRB = kNR;     // rows decoded at a time
constexpr int64_t kTB = 80;      // tokens per pass over a decoded panel (a multiple of kNT)
constexpr int64_t kPanelMin = 8;  // fewer tokens take row512 (a decode per 4 tokens costs them less than a panel)
// Narrower rows take row512: a (token, row)'s fixed costs (its 64 accumulator lanes zeroed, loaded and stored per
// tile, reduced at the end) outweighed the saved decodes at the demo's 576 columns (34 % of peak vs 40 %),
// broke even at 1536 and gained a third at 3584.
constexpr int64_t kPanelMinCols = 2048;

// The kinds with a panel decode: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and F16, BF16, row-int8 (I8R, 100).
inline bool panel_kind(int64_t kind) {
  return kind == 2 || kind == 3 || kind == 6 || kind == 7 || kind == 8 || (kind >= 12 && kind <= 14) || kind == 1
      || kind == 30 || kind == 100;
}
// The block formats sum even and odd groups in two lane sets (row512); bf16/f16/row-int8 in one (fused_row).
inline bool two_sets(int64_t kind) { return kind != 1 && kind != 30 && kind != 100; }

template <int K>
inline void panel_groups(const uint8_t* row, int64_t c0, int64_t kc, float* out) {
  alignas(64) float dm[2 * kScaleRun];
  const int64_t n = kc / 32;  // <= kScaleRun: kKC / 32 groups
  const uint8_t* b = row + (c0 / 32) * block_bytes(K);
  scales<K>(b, n, dm);
  for (int64_t k = 0; k < n; ++k) {
    __m512 w0, w1;
    group_w<K>(b + k * block_bytes(K), dm + 2 * k, &w0, &w1);
    _mm512_storeu_ps(out + 32 * k, w0), _mm512_storeu_ps(out + 32 * k + 16, w1);
  }
}

// Weights [c0, c0 + kc) of one row into out, in the lanes row512 / fused_row give them.
inline void panel_decode(int64_t kind, const uint8_t* row, int64_t c0, int64_t kc, float* out) {
  switch (kind) {
    case 2: panel_groups<2>(row, c0, kc, out); return;
    case 3: panel_groups<3>(row, c0, kc, out); return;
    case 6: panel_groups<6>(row, c0, kc, out); return;
    case 7: panel_groups<7>(row, c0, kc, out); return;
    case 8: panel_groups<8>(row, c0, kc, out); return;
    case 12:
      for (int64_t blk = 0; blk < kc / 256; ++blk) {
        const uint8_t* b = row + (c0 / 256 + blk) * block_bytes(12);
        alignas(32) float ds[8], dm[8];
        k4_scales(b, ds, dm);
        for (int j = 0; j < 4; ++j) {
          __m512 w[4];
          k4_pair(b, j, ds, dm, w);
          for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + blk * 256 + 64 * j + 16 * v, w[v]);
        }
      }
      return;
    case 13:
      for (int64_t blk = 0; blk < kc / 256; ++blk) {
        const uint8_t* b = row + (c0 / 256 + blk) * block_bytes(13);
        alignas(32) float ds[8], dm[8];
        k4_scales(b, ds, dm, true);
        for (int h = 0; h < 2; ++h) {
          __m512 w[8];
          q5_half(b, h, ds + 4 * h, dm + 4 * h, w);
          for (int i = 0; i < 8; ++i) _mm512_storeu_ps(out + blk * 256 + h * 128 + 16 * i, w[i]);
        }
      }
      return;
    case 14:
      for (int64_t blk = 0; blk < kc / 256; ++blk) {
        const uint8_t* b = row + (c0 / 256 + blk) * block_bytes(14);
        alignas(64) float ds[16];
        q6_scales(b, ds);
        for (int h = 0; h < 2; ++h) {
          __m512 w[8];
          q6_half(b, h, ds + 8 * h, w);
          for (int i = 0; i < 8; ++i) _mm512_storeu_ps(out + blk * 256 + h * 128 + 16 * i, w[i]);
        }
      }
      return;
    case 30:  // bf16: the top half of an fp32
      for (int64_t j = 0; j < kc; j += 16) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * (c0 + j)));
        _mm512_storeu_ps(out + j, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
      }
      return;
    case 1:
      for (int64_t j = 0; j < kc; j += 16)
        _mm512_storeu_ps(out + j, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * (c0 + j)))));
      return;
    default: {  // row-int8: the row's scale times the int8 weight, fused_row's product
      const __m512 scale = _mm512_set1_ps(h2f(rd16(row)));
      for (int64_t j = 0; j < kc; j += 16) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 + c0 + j));
        _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), scale));
      }
      return;
    }
  }
}

// For one chunk of ng groups: a[i][t] (acc + (i * ldr + t) * 64) += w_i . x_t, each lane set's half in
// turn (`sets` 2: lanes [32s + 16h, +16) over the groups of parity s; 1: lanes [16h, +16) over all), its
// groups in order. Each weight vector feeds NT FMAs and each x vector NR (held in a register: folded into
// the FMAs as memory operands, x was loaded NR times over).
template <int NR, int NT>
__attribute__((noinline)) void micro(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t ng, int64_t sets,
                                     float* acc, int64_t ldr) {
  for (int64_t s = 0; s < sets; ++s)
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t off = 32 * s + 16 * h, step = 32 * sets, n = (ng - s + sets - 1) / sets;
      __m512 a[NR][NT];
      for (int i = 0; i < NR; ++i)
        for (int t = 0; t < NT; ++t) a[i][t] = _mm512_loadu_ps(acc + (i * ldr + t) * 64 + off);
      const float *wk = w + off, *xk = x + off;
      for (int64_t k = 0; k < n; ++k, wk += step, xk += step) {
        __m512 wv[NR];
        for (int i = 0; i < NR; ++i) wv[i] = _mm512_loadu_ps(wk + i * ldw);
        for (int t = 0; t < NT; ++t) {
          __m512 xv = _mm512_loadu_ps(xk + t * ldx);
          asm("" : "+v"(xv));
          for (int i = 0; i < NR; ++i) a[i][t] = _mm512_fmadd_ps(wv[i], xv, a[i][t]);
        }
      }
      for (int i = 0; i < NR; ++i)
        for (int t = 0; t < NT; ++t) _mm512_storeu_ps(acc + (i * ldr + t) * 64 + off, a[i][t]);
    }
}

using Micro = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t);
template <int NR, int... NT>
constexpr std::array<Micro, sizeof...(NT)> micro_row(std::integer_sequence<int, NT...>) { return {micro<NR, NT + 1>...}; }
template <int... NR>
constexpr std::array<std::array<Micro, kNT>, sizeof...(NR)> micro_all(std::integer_sequence<int, NR...>) {
  return {micro_row<NR + 1>(std::make_integer_sequence<int, kNT>())...};
}
constexpr auto kMicro = micro_all(std::make_integer_sequence<int, kNR>());  // [rows - 1][tokens - 1]

// out[0, 32) = a[0, 32) + a[32, 64): a (token, row)'s two lane sets, lane by lane (row512's last add).
inline void add_sets(const float* a, float* out) {
  for (int h = 0; h < 2; ++h) _mm512_storeu_ps(out + 16 * h, _mm512_add_ps(_mm512_loadu_ps(a + 16 * h), _mm512_loadu_ps(a + 32 + 16 * h)));
}

// Whether a df_stored_parts call of T tokens takes the panel: every part's kind has one and its rows are wide.
inline bool panel_takes(const Part* parts, int n, int stack_cols, int64_t T) {
  if (T < kPanelMin) return false;
  int64_t cols = stack_cols ? 0 : parts[0].cols;  // a row's width: all the parts side by side, or the narrowest
  for (int p = 0; p < n; ++p) {
    if (!panel_kind(parts[p].kind)) return false;
    cols = stack_cols ? cols + parts[p].cols : std::min(cols, parts[p].cols);
  }
  return cols >= kPanelMinCols;
}

// Rows [r0, r1) of `count` parts side by side (stored_cpu.cpp's rows_of) for all T tokens: x as given
// (row stride ldx) and in code-lane order (xp, ldxp; read by the kinds reads_lanes names); token t's
// 32 lanes of row r go through reduce (the one fixed tree) to y[t * ldy + y_col + r].
template <class Reduce>
void panel_rows(const Part* first, int count, int64_t r0, int64_t r1, const float* x, int64_t ldx, const float* xp,
                int64_t ldxp, int64_t T, float* y, int64_t ldy, int64_t y_col, Reduce reduce) {
  thread_local Floats acc_kept, w_kept;  // kept between calls, as rows_of's sums
  acc_kept.resize(static_cast<size_t>(kRB * kTB * 64)), w_kept.resize(static_cast<size_t>(kRB * kKC));
  float *const acc = acc_kept.data(), *const w = w_kept.data();
  for (int64_t t0 = 0; t0 < T; t0 += kTB) {
    const int64_t tb = std::min(kTB, T - t0);
    for (int64_t rb = r0; rb < r1; rb += kRB) {
      const int64_t nr = std::min(kRB, r1 - rb);
      std::fill(acc, acc + nr * tb * 64, 0.0f);
      int64_t x_col = 0;
      for (int p = 0; p < count; ++p) {
        const Part& part = first[p];
        const bool sets = two_sets(part.kind);
        for (int64_t i = 0; sets && p > 0 && i < nr * tb; ++i) std::fill(acc + i * 64 + 32, acc + i * 64 + 64, 0.0f);
        const bool permuted = reads_lanes(static_cast<int>(part.kind));
        const int64_t ldb = permuted ? ldxp : ldx;
        const float* xb = (permuted ? xp + t0 * ldxp : x + t0 * ldx) + x_col;
        for (int64_t c0 = 0; c0 < part.cols; c0 += kKC) {
          const int64_t kc = std::min(kKC, part.cols - c0), ng = kc / 32;
          for (int64_t r = 0; r < nr; ++r) panel_decode(part.kind, part.data + (rb + r) * part.row_bytes, c0, kc, w + r * kKC);
          // The bytes decoded next (the next chunk of these rows, or the next rows' first) are fetched into L2
          // a few lines per register tile: each row is a stream of a few KB, too short for the hardware
          // prefetcher to ramp up on, and a burst of them all overflowed the misses the core keeps in flight.
          const bool last = c0 + kKC >= part.cols;
          const int64_t next_col = last ? 0 : c0 + kKC, next_row = last ? rb + kRB : rb;
          const int64_t lines = std::min(kKC, part.cols - next_col) * part.row_bytes / part.cols / 64 + 2;
          const int64_t todo = std::max<int64_t>(0, std::min(kRB, r1 - next_row)) * lines;
          const int64_t per = todo / (((tb + kNT - 1) / kNT) * ((nr + kNR - 1) / kNR)) + 1;
          const uint8_t* ahead = part.data + next_row * part.row_bytes + next_col * part.row_bytes / part.cols;
          int64_t done = 0;
          for (int64_t i = 0; i < nr; i += kNR)
            for (int64_t t = 0; t < tb; t += kNT) {
              const Micro f = kMicro[std::min<int64_t>(kNR, nr - i) - 1][std::min<int64_t>(kNT, tb - t) - 1];
              // c0 is a multiple of kKC: a chunk starts at an even group, so parity within it is global
              f(w + i * kKC, kKC, xb + t * ldb + c0, ldb, ng, sets ? 2 : 1, acc + (i * tb + t) * 64, tb);
              for (const int64_t end = std::min(todo, done + per); done < end; ++done)
                _mm_prefetch(reinterpret_cast<const char*>(ahead + (done / lines) * part.row_bytes + (done % lines) * 64), _MM_HINT_T1);
            }
        }
        // The sets added once per matrix, as row512 does (the last matrix's as its rows are reduced, below).
        for (int64_t i = 0; sets && p + 1 < count && i < nr * tb; ++i) add_sets(acc + i * 64, acc + i * 64);
        x_col += part.cols;
      }
      const bool sets = two_sets(first[count - 1].kind);
      alignas(64) float lanes[32];
      for (int64_t t = 0; t < tb; ++t)  // y's rows in order
        for (int64_t r = 0; r < nr; ++r) {
          float* a = acc + (r * tb + t) * 64;
          if (sets) add_sets(a, lanes);
          y[(t0 + t) * ldy + y_col + rb + r] = reduce(sets ? lanes : a);
        }
    }
  }
}
#else
inline bool panel_takes(const Part*, int, int, int64_t) { return false; }
template <class Reduce>
void panel_rows(const Part*, int, int64_t, int64_t, const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t,
                int64_t, Reduce) {}
#endif

}  // namespace
}  // namespace dfq
