// `[device] math = "q8"` (opt-in, NOT bit-exact): df_stored_parts' matmuls on Q4_K, Q5_K, Q6_K and Q8_0
// weights in llama.cpp's arithmetic (stored_q8.h: each token row of x quantized to Q8_K or Q8_0 once per
// call, integer dot products per block). Any other weight kind in the same call stays on the exact kernel.
// The mode is the process's (fast_math.use sets it through df_set_math); the layer kernels reach this
// through df_stored_parts like every other matmul. Built into the one library by cpu_kernels.py.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_pool.h"
#include "stored_q8.h"

using dfq::Part;

extern "C" int df_stored_parts(const Part* parts, int n, int stack_cols, const float* x, int64_t T, int64_t ldx,
                               float* y, int64_t ldy, int threads);
extern "C" int64_t df_stored_row_bytes(int kind, int64_t cols);

namespace {

using namespace dfq8;

int g_math = 0;              // 2: q8 (fast_math.py's MODES index); anything else leaves the exact kernels alone
constexpr int kTokens = 4;   // token rows per pass over a row's unpacked codes
constexpr int64_t kRows = 16;  // rows per chunk: a tile of x (kTokens rows, ~9 KB at 2048 columns) stays in L1 over them

constexpr int64_t x_block_bytes(int xk) { return xk == kQ8_K ? sizeof(BlockK) : sizeof(Block0); }
constexpr int64_t x_block_cols(int xk) { return xk == kQ8_K ? 256 : 32; }

// out[r * nt + t] = row r of nr rows of `kind` (nb blocks each, row_bytes apart) dotted with nt token
// rows of quantized x, xstride bytes apart.
void row_dot_any(int kind, const uint8_t* row, int64_t row_bytes, int64_t nr, int64_t nb, const uint8_t* xq, int64_t xstride,
                 int nt, float* out) {
#ifdef __AVX2__
  auto go = [&](auto k, auto tokens) {
    constexpr int K = decltype(k)::value, NT = decltype(tokens)::value;
    for (int64_t r = 0; r < nr; r += kRowsPerPass<K, NT>) {
      const uint8_t* w = row + r * row_bytes;
      float* o = out + r * NT;
      switch (std::min<int64_t>(nr - r, kRowsPerPass<K, NT>)) {
        case 1: row_dot<K, NT, 1>(w, row_bytes, nb, xq, xstride, o); break;
        case 2: row_dot<K, NT, std::min(2, kRowsPerPass<K, NT>)>(w, row_bytes, nb, xq, xstride, o); break;
        case 3: row_dot<K, NT, std::min(3, kRowsPerPass<K, NT>)>(w, row_bytes, nb, xq, xstride, o); break;
        default: row_dot<K, NT, kRowsPerPass<K, NT>>(w, row_bytes, nb, xq, xstride, o); break;
      }
    }
  };
  auto tokens = [&](auto k) {
    switch (nt) {
      case 1: go(k, std::integral_constant<int, 1>()); return;
      case 2: go(k, std::integral_constant<int, 2>()); return;
      case 3: go(k, std::integral_constant<int, 3>()); return;
      default: go(k, std::integral_constant<int, 4>()); return;
    }
  };
  switch (kind) {
    case kQ4_K: tokens(std::integral_constant<int, kQ4_K>()); return;
    case kQ5_K: tokens(std::integral_constant<int, kQ5_K>()); return;
    case kQ6_K: tokens(std::integral_constant<int, kQ6_K>()); return;
    default: tokens(std::integral_constant<int, kQ8_0>()); return;
  }
#else
  const int64_t bb = dfq::block_bytes(kind), xb = x_block_bytes(x_kind(kind));
  for (int64_t r = 0; r < nr; ++r)
    for (int t = 0; t < nt; ++t) {
      float acc = 0.0f, accm = 0.0f;
      for (int64_t i = 0; i < nb; ++i) {
        int64_t s, m;
        float ds, dm;
        const uint8_t* wb = row + r * row_bytes + i * bb;
        const uint8_t* xbk = xq + t * xstride + i * xb;
        block_ints(kind, wb, xbk, &s, &m);
        block_scales(kind, wb, xbk, &ds, &dm);
        acc += ds * static_cast<float>(s);
        accm += dm * static_cast<float>(m);
      }
      out[r * nt + t] = acc + accm;
    }
#endif
}

// A stretch of x's columns quantized for one x format: at `offset` bytes into each token's quantized row.
struct Seg {
  int xk;
  int64_t col, cols, offset;
};

}  // namespace

extern "C" {

void df_set_math(int mode) { g_math = mode; }

// Which q8 dot product this build runs: 2 AVX512-VNNI, 1 AVX2, 0 scalar (benches and tests report it).
int df_q8_simd() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX2__)
  return 2;
#elif defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

// x [n] quantized as llama.cpp's `xk` blocks (15: Q8_K, n a multiple of 256; 8: Q8_0, of 32) into out.
int df_q8_quantize(int xk, const float* x, int64_t n, void* out) {
  if (xk == kQ8_K && n % 256 == 0) quantize_k(x, n, static_cast<BlockK*>(out));
  else if (xk == kQ8_0 && n % 32 == 0) quantize_0(x, n, static_cast<Block0*>(out));
  else return 1;
  return 0;
}

// df_stored_parts in q8 mode: -1 where it does not apply (another mode, no part with a q8 kernel, a
// side-by-side call with a part without one, or a shape that does not fit: the exact path takes those
// and reports a bad shape); 0 when y is done. Parts without a q8 kernel in a stacked call are run after,
// each by the exact kernel on its own columns of y.
int df_q8_parts(const Part* parts, int n, int stack_cols, const float* x, int64_t T, int64_t ldx, float* y, int64_t ldy,
                int threads) {
  if (g_math != 2 || n <= 0) return -1;
  int q8 = 0;
  for (int p = 0; p < n; ++p) {
    const int k = static_cast<int>(parts[p].kind);
    if (parts[p].row_bytes != df_stored_row_bytes(k, parts[p].cols) || (stack_cols && parts[p].rows != parts[0].rows))
      return -1;
    q8 += x_kind(k) != 0;
  }
  if (q8 == 0 || (stack_cols && q8 < n)) return -1;
  // Each token row of x quantized once per x format and stretch of columns its parts read.
  std::vector<Seg> segs;
  std::vector<int> seg_of(static_cast<size_t>(n), -1);
  int64_t tok_bytes = 0, col = 0;
  for (int p = 0; p < n; ++p) {
    const int xk = x_kind(static_cast<int>(parts[p].kind));
    const int64_t c0 = stack_cols ? col : 0;
    col += parts[p].cols;
    if (!xk) continue;
    for (size_t s = 0; s < segs.size() && seg_of[p] < 0; ++s)
      if (segs[s].xk == xk && segs[s].col == c0 && segs[s].cols == parts[p].cols) seg_of[p] = static_cast<int>(s);
    if (seg_of[p] >= 0) continue;
    seg_of[p] = static_cast<int>(segs.size());
    segs.push_back({xk, c0, parts[p].cols, tok_bytes});
    tok_bytes += (parts[p].cols / x_block_cols(xk) * x_block_bytes(xk) + 63) / 64 * 64;  // 64-byte aligned stretches
  }
  thread_local std::vector<uint8_t> kept;  // grown, never zeroed: every byte read is written below
  if (kept.size() < static_cast<size_t>(T * tok_bytes)) kept.resize(static_cast<size_t>(T * tok_bytes));
  uint8_t* const xq = kept.data();
  df::pool().run(static_cast<int>(T), threads, [&](int t) {
    for (const Seg& s : segs) df_q8_quantize(s.xk, x + t * ldx + s.col, s.cols, xq + t * tok_bytes + s.offset);
  });
  // Tasks: runs of rows of each q8 part (stacked), or of the shared rows (side by side).
  std::vector<int> ps;
  std::vector<int64_t> y_cols;
  int64_t all_rows = 0, y_col = 0;
  for (int p = 0; p < n; ++p) {
    if (!stack_cols && x_kind(static_cast<int>(parts[p].kind))) ps.push_back(p), y_cols.push_back(y_col), all_rows += parts[p].rows;
    y_col += parts[p].rows;
  }
  if (stack_cols) ps = {0}, y_cols = {0}, all_rows = parts[0].rows;
  const int64_t per_task = dfq::rows_per_task(all_rows, threads);
  std::vector<int64_t> first_task{0};
  for (int p : ps) first_task.push_back(first_task.back() + (parts[p].rows + per_task - 1) / per_task);
  df::pool().run(static_cast<int>(first_task.back()), threads, [&](int task) {
    const size_t i = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
    const Part* own = parts + ps[i];
    const int64_t r0 = (task - first_task[i]) * per_task, r1 = std::min(own->rows, r0 + per_task);
    const int count = stack_cols ? n : 1;
    for (int64_t c0 = r0; c0 < r1; c0 += kRows)
      for (int64_t t0 = 0; t0 < T; t0 += kTokens) {
        const int nt = static_cast<int>(std::min<int64_t>(kTokens, T - t0));
        const int64_t nr = std::min(r1, c0 + kRows) - c0;
        float v[kRows * kTokens] = {}, o[kRows * kTokens];
        for (int p = 0; p < count; ++p) {  // side by side: the parts' sums added in order
          const Part& w = own[p];
          const int xk = x_kind(static_cast<int>(w.kind));
          row_dot_any(static_cast<int>(w.kind), w.data + c0 * w.row_bytes, w.row_bytes, nr, w.cols / x_block_cols(xk),
                      xq + t0 * tok_bytes + segs[seg_of[own - parts + p]].offset, tok_bytes, nt, o);
          for (int64_t k = 0; k < nr * nt; ++k) v[k] += o[k];
        }
        for (int64_t r = 0; r < nr; ++r)
          for (int t = 0; t < nt; ++t) y[(t0 + t) * ldy + y_cols[i] + c0 + r] = v[r * nt + t];
      }
  });
  y_col = 0;
  for (int p = 0; p < n && q8 < n; ++p) {  // the stacked parts without a q8 kernel: exact, into their columns
    if (!x_kind(static_cast<int>(parts[p].kind)) && df_stored_parts(parts + p, 1, 0, x, T, ldx, y + y_col, ldy, threads))
      return 1;
    y_col += parts[p].rows;
  }
  return 0;
}

}  // extern "C"
