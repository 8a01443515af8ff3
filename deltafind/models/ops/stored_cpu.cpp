// Matmul on weights in their stored format: bf16, fp16 and llama.cpp's GGUF block formats
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K and the IQ formats), with fp32 activations and fp32 accumulation.
//
// y[t, r] = sum_c w(r, c) * x[t, c], every w(r, c) its exact stored value. The decode (df_stored_dequant,
// and the matmul without AVX2) is gguf-py's numpy dequantize, the same fp32 operations in the same order
// (built with -ffp-contract=off so d*q + m is never fused). The block formats are dotted in registers
// (stored_blocks.h, stored_rows.h): on AVX-512 each weight decoded exactly by table, on AVX2 factored,
// d * (q . x) + m * sum(x) per group of weights; bf16/f16/row-int8 are widened in registers; without AVX2 every format is
// decoded chunk by chunk into an L1 buffer. Each (token, row) sums in fixed lanes
// combined by one fixed tree at the end; that order does not depend on the number of tokens or
// threads, so one token and a batch give bit-identical rows. Built by deltafind/models/ops/cpu_kernels.py.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>

#include "cpu_pool.h"
#include "stored_decode.h"
#include "stored_iq.h"
#include "stored_panel.h"
#include "stored_rows.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

using df::pool;

constexpr int kTile = 4;     // tokens per pass over a decoded chunk

bool block_shape(int kind, int64_t* elems, int64_t* bytes) {
  switch (kind) {
    case F16: case BF16: *elems = 1; *bytes = 2; return true;
    case I8R: *elems = 1; *bytes = 1; return true;  // plus the row's 2-byte scale (df_stored_row_bytes)
    default:
      *elems = dfq::block256(kind) ? 256 : 32;
      *bytes = dfq::block_bytes(kind);
      return *bytes > 0;
  }
}

using dfq::Part;

#ifdef __AVX2__
// 32 consecutive bf16/f16/row-int8 weights as four vectors, weights 0-7, 8-15, 16-23, 24-31, decoded
// with exactly decode()'s fp32 operations: the fused path below never writes them to memory.
// `scale` is the row's scale (I8R only).
template <int K>
inline void decode_vec(const uint8_t* b, float scale, __m256 w[4]) {
  if constexpr (K == BF16) {
    for (int g = 0; g < 4; ++g) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * g));
      w[g] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  } else if constexpr (K == F16) {
    for (int g = 0; g < 4; ++g) w[g] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * g)));
  } else {  // I8R: the row's scale times the int8 weight
    const __m256 dv = _mm256_set1_ps(scale);
    for (int g = 0; g < 4; ++g) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8 * g));
      w[g] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), dv);
    }
  }
}

#endif

// acc[0..32) += w[0..n) * x[0..n) for n a multiple of 32: four 8-lane chains, weights j % 32 in
// [8c, 8c + 8) on chain c (four independent FMA chains hide the FMA latency).
inline void dot_chunk(const float* w, const float* x, int n, float* acc) {
#ifdef __AVX2__
  __m256 a[4];
  for (int c = 0; c < 4; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int j = 0; j < n; j += 32)
    for (int c = 0; c < 4; ++c) a[c] = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 8 * c), _mm256_loadu_ps(x + j + 8 * c), a[c]);
  for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
#else
  for (int j = 0; j < n; j += 32)
    for (int l = 0; l < 32; ++l) acc[l] = std::fma(w[j + l], x[j + l], acc[l]);
#endif
}

// The one fixed tree that ends every (token, row): chains pairwise, then the 8 lanes. On AVX the same
// adds in the same order, 8 lanes at a time: the scalar loop (31 dependent adds a row) was ~8 % of a
// demo decode token, a reduce per output row of every matrix.
inline float reduce32(const float* a) {
#ifdef __AVX2__
  const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(a + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(a + 16), _mm256_loadu_ps(a + 24)));
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));  // s[l] + s[l + 4]
  const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));  // (s0 + s4) + (s2 + s6), (s1 + s5) + (s3 + s7)
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
#else
  float s[8];
  for (int l = 0; l < 8; ++l) s[l] = (a[l] + a[8 + l]) + (a[16 + l] + a[24 + l]);
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
#endif
}

#ifdef __AVX2__
// acc[t][0..32) += row . x[t] over `cols` weights, decode fused into the dot: the lanes take weights
// in dot_chunk's order, so results are bit-identical to the decode-to-buffer path.
template <int K, int NT>
void fused_row(const uint8_t* row, int64_t cols, const float* x, int64_t ldx, float (*acc)[32]) {
  static_assert(K == BF16 || K == F16 || K == I8R, "the block formats take stored_rows.h");
  constexpr int64_t bytes = K == I8R ? 32 : 64;
  const float scale = K == I8R ? h2f(rd16(row)) : 0.0f;
  row += K == I8R ? 2 : 0;
  __m256 a[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int c = 0; c < 4; ++c) a[t][c] = _mm256_loadu_ps(acc[t] + 8 * c);
  for (int64_t b = 0; b < cols / 32; ++b) {
    __m256 w[4];
    decode_vec<K>(row + b * bytes, scale, w);
    const float* xb = x + b * 32;
    for (int t = 0; t < NT; ++t)
      for (int c = 0; c < 4; ++c) a[t][c] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(xb + t * ldx + 8 * c), a[t][c]);
  }
  for (int t = 0; t < NT; ++t)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc[t] + 8 * c, a[t][c]);
}

template <int K>
bool fused_tile(const uint8_t* row, int64_t cols, const float* x, int64_t ldx, int nt, float (*acc)[32]) {
  switch (nt) {
    case 1: fused_row<K, 1>(row, cols, x, ldx, acc); return true;
    case 2: fused_row<K, 2>(row, cols, x, ldx, acc); return true;
    case 3: fused_row<K, 3>(row, cols, x, ldx, acc); return true;
    case 4: fused_row<K, 4>(row, cols, x, ldx, acc); return true;
    default: return false;
  }
}
#endif

// For nrows rows `row_bytes` apart from `first` and t < nt (<= kTile): acc_r[t] += row_r . x[t], acc_r at
// acc + r * stride, `cols` weights of `kind`: the block formats in registers (stored_rows.h; xs: x's sums
// per 32 columns, for the AVX2 path), bf16/f16/row-int8 decoded in registers, or (no AVX2) decoded chunk by chunk into an L1
// buffer (those two in dot_chunk's lane order).
void accumulate(int kind, const uint8_t* first, int64_t nrows, int64_t row_bytes, int64_t cols, const float* x,
                int64_t ldx, const float* xs, int64_t ldxs, const float* xp, int64_t ldxp, int nt, float* acc,
                int64_t stride, const uint8_t* run_end) {
#ifdef __AVX2__
  switch (kind) {
    case Q8_0: if (dfq::tile<Q8_0>(first, nrows, row_bytes, cols, x, ldx, xs, ldxs, xp, ldxp, nt, acc, stride, run_end)) return; break;
    case Q4_0: if (dfq::tile<Q4_0>(first, nrows, row_bytes, cols, x, ldx, xs, ldxs, xp, ldxp, nt, acc, stride, run_end)) return; break;
    case Q4_1: if (dfq::tile<Q4_1>(first, nrows, row_bytes, cols, x, ldx, xs, ldxs, xp, ldxp, nt, acc, stride, run_end)) return; break;
    case Q5_0: if (dfq::tile<Q5_0>(first, nrows, row_bytes, cols, x, ldx, xs, ldxs, xp, ldxp, nt, acc, stride, run_end)) return; break;
    case Q5_1: if (dfq::tile<Q5_1>(first, nrows, row_bytes, cols, x, ldx, xs, ldxs, xp, ldxp, nt, acc, stride, run_end)) return; break;
    case Q4_K: if (dfq::tile<Q4_K>(first, nrows, row_bytes, cols, x, ldx, xs, ldxs, xp, ldxp, nt, acc, stride, run_end)) return; break;
    case Q5_K: if (dfq::tile<Q5_K>(first, nrows, row_bytes, cols, x, ldx, xs, ldxs, xp, ldxp, nt, acc, stride, run_end)) return; break;
    case Q6_K: if (dfq::tile<Q6_K>(first, nrows, row_bytes, cols, x, ldx, xs, ldxs, xp, ldxp, nt, acc, stride, run_end)) return; break;
    default: break;
  }
#else
  (void)xs, (void)ldxs, (void)xp, (void)ldxp, (void)run_end;
#endif
  for (int64_t r = 0; r < nrows; ++r) {
    const uint8_t* row = first + r * row_bytes;
    float (*ac)[32] = reinterpret_cast<float (*)[32]>(acc + r * stride);
#ifdef __AVX2__
    if ((kind == BF16 && fused_tile<BF16>(row, cols, x, ldx, nt, ac)) || (kind == F16 && fused_tile<F16>(row, cols, x, ldx, nt, ac))
        || (kind == I8R && fused_tile<I8R>(row, cols, x, ldx, nt, ac)))
      continue;
#endif
    alignas(64) float buf[kChunk];
    for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, cols - c0));
      decode(kind, row, c0, n, buf);
      for (int t = 0; t < nt; ++t) dot_chunk(buf, x + t * ldx + c0, n, ac[t]);
    }
  }
}

}  // namespace

extern "C" {

int df_q8_parts(const Part* parts, int n, int stack_cols, const float* x, int64_t T, int64_t ldx, float* y, int64_t ldy,
                int threads);  // q8_cpu.cpp: -1 where [device] math = "q8" does not take the call

int df_stored_abi() { return 2; }

// Hand in gguf-py's code grid of an IQ `kind` (stored_iq.h's set_grid).
int df_stored_set_grid(int kind, const int8_t* values, int64_t n) { return dfq::set_grid(kind, values, n); }

// Bytes of one row of `cols` weights in `kind` (0 when the kind is unknown or cols does not fit it).
int64_t df_stored_row_bytes(int kind, int64_t cols) {
  int64_t elems, bytes;
  if (!block_shape(kind, &elems, &bytes) || cols % (elems == 256 ? 256 : 32) != 0) return 0;
  return cols / elems * bytes + (kind == I8R ? 2 : 0);
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

// y = x @ W.T for W made of `n` stored matrices (`Part`s), weights read as stored, in one pool run.
// stack_cols = 0: W stacks the parts' rows (all of one width C = x's columns); y's columns follow the
//   parts in order (q/k/v, or every slice's gate then up): y [T, sum rows].
// stack_cols = 1: W joins the parts side by side (all of one height R); x's columns follow the parts
//   in order and each output sums over all of them in one set of lanes (a dense MLP's down slices).
// x [T, *] and y [T, *] have row strides ldx, ldy. Returns 1 if a part's shape does not fit its kind.
int df_stored_parts(const Part* parts, int n, int stack_cols, const float* x, int64_t T, int64_t ldx, float* y,
                    int64_t ldy, int threads) {
  if (const int rc = df_q8_parts(parts, n, stack_cols, x, T, ldx, y, ldy, threads); rc >= 0) return rc;  // q8 mode
  int64_t all_rows = 0;
  for (int p = 0; p < n; ++p) {
    if (parts[p].row_bytes != df_stored_row_bytes(static_cast<int>(parts[p].kind), parts[p].cols)) return 1;
    if (stack_cols && parts[p].rows != parts[0].rows) return 1;
    all_rows += stack_cols ? 0 : parts[p].rows;
  }
  if (stack_cols) all_rows = parts[0].rows;
  const int64_t rows_per_task = dfq::rows_per_task(all_rows, threads);
  int64_t tasks = 0;
  for (int p = 0; p < (stack_cols ? 1 : n); ++p) tasks += (parts[p].rows + rows_per_task - 1) / rows_per_task;
  int64_t x_cols = 0;  // x's columns: one part's width, or all the parts' side by side
  for (int p = 0; p < (stack_cols ? n : 1); ++p) x_cols += parts[p].cols;
  // x's forms for the block kernels (stored_rows.h), each only where a part reads it.
  bool need_sums = false, need_lanes = false;
  for (int p = 0; p < n; ++p) {
    need_sums = need_sums || dfq::reads_sums(static_cast<int>(parts[p].kind));
    need_lanes = need_lanes || dfq::reads_lanes(static_cast<int>(parts[p].kind));
  }
  const std::vector<float> xs = need_sums ? dfq::block_sums(x, T, ldx, x_cols) : std::vector<float>();
  const dfq::Floats xp = need_lanes ? dfq::permute_x(x, T, ldx, x_cols) : dfq::Floats();
  const int64_t ldxs = x_cols / 32;
  auto at = [](const auto& v, int64_t i) { return v.empty() ? nullptr : v.data() + i; };  // null: unread
  // Rows r0..r1 of `count` parts side by side (one part: a run of a stacked matrix's rows), in chunks of
  // rows whose weights stay in L1/L2 while every tile of tokens passes over them; within a chunk part by
  // part, each part's rows read in one run. Every row keeps its sums across the parts, so they add in the
  // same order as part after part within the row; its tokens' outputs land at column y_col + r of y.
  const bool panel = dfq::panel_takes(parts, n, stack_cols, T);  // prefill on AVX-512: decoded once per panel (stored_panel.h)
  auto rows_of = [&](int64_t r0, int64_t r1, const Part* first, int count, int64_t y_col) {
    if (panel) {
      dfq::panel_rows(first, count, r0, r1, x, ldx, at(xp, 0), x_cols, T, y, ldy, y_col, reduce32);
      return;
    }
    int64_t row_bytes = 0;
    for (int p = 0; p < count; ++p) row_bytes += first[p].row_bytes;
    // Chunks keep a tile's weights in L1/L2 while the next tiles of tokens pass; a decode step (one tile)
    // takes its run whole, each part's rows in one stream.
    const int64_t chunk = T <= kTile ? r1 - r0 : std::max<int64_t>(1, std::min<int64_t>(r1 - r0, (32 << 10) / row_bytes));
    // Each thread keeps its accumulators between calls: allocating and zeroing kTile tokens' worth per task
    // (46 KB for a 192-row part) cost a decode step's MLP ~10 % on one core (tests/bench/RESULTS.md).
    thread_local std::vector<float> kept;
    const size_t need = static_cast<size_t>(chunk * std::min<int64_t>(T, kTile) * 32);
    if (kept.size() < need) kept.resize(need);
    float* const sums = kept.data();
    for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
      const int64_t c1 = std::min(r1, c0 + chunk);
      for (int64_t t0 = 0; t0 < T; t0 += kTile) {
        const int nt = static_cast<int>(std::min<int64_t>(kTile, T - t0));
        std::fill(sums, sums + (c1 - c0) * nt * 32, 0.0f);  // row r's nt accumulators at (r - c0) * nt * 32
        int64_t x_col = 0;
        for (int p = 0; p < count; ++p) {
          accumulate(static_cast<int>(first[p].kind), first[p].data + c0 * first[p].row_bytes, c1 - c0, first[p].row_bytes,
                     first[p].cols, x + t0 * ldx + x_col, ldx, at(xs, t0 * ldxs + x_col / 32), ldxs,
                     at(xp, t0 * x_cols + x_col), x_cols, nt, sums, nt * 32, first[p].data + r1 * first[p].row_bytes);
          x_col += first[p].cols;
        }
        for (int64_t r = c0; r < c1; ++r)
          for (int t = 0; t < nt; ++t) y[(t0 + t) * ldy + y_col + r] = reduce32(sums + ((r - c0) * nt + t) * 32);
      }
    }
  };
  pool().run(static_cast<int>(tasks), threads, [&](int i) {
    if (stack_cols) {
      const int64_t r0 = i * rows_per_task;
      rows_of(r0, std::min<int64_t>(parts[0].rows, r0 + rows_per_task), parts, n, 0);
      return;
    }
    int64_t task = i, y_col = 0;  // find the part holding task i
    for (int p = 0; p < n; ++p) {
      const int64_t part_tasks = (parts[p].rows + rows_per_task - 1) / rows_per_task;
      if (task < part_tasks) {
        const int64_t r0 = task * rows_per_task;
        rows_of(r0, std::min<int64_t>(parts[p].rows, r0 + rows_per_task), parts + p, 1, y_col);
        return;
      }
      task -= part_tasks;
      y_col += parts[p].rows;
    }
  });
  return 0;
}

}  // extern "C"
