// The per-layer ops of a CPU decode step, fp32: RMSNorm, rotary embeddings, one-row attention, and two
// fused steps built from them and stored_cpu.cpp's matmul: a whole attention half of a layer for one
// token (df_attn_decode), a gated MLP (df_gated_mlp), one token's routed experts of a MoE layer
// (df_moe_token) and its softmax top-k router (df_route_token), and a chain of decoder layers
// (df_decode_layers).
//
// Each small op was a handful of torch ops costing 10-30 us a call on one token, against ~3 us for one
// ctypes call here; a demo token runs 61 norms and 30 ropes, and the Python between the calls cost as
// much as the weights' arithmetic (tests/bench/RESULTS.md). The small ops are single-threaded (a row is
// 0.5-30 KB of work); the matmuls inside the fused steps run on the shared pool. Built with
// stored_cpu.cpp and mxfp4_cpu.cpp into one library by deltafind/models/ops/cpu_kernels.py, with
// -ffp-contract=off: the rope is torch's arithmetic op for op (x*cos + rotate_half(x)*sin, every product
// and the sum rounded), so bit-identical; the norm sums its squares in 8 fixed lanes, one fixed tree,
// which differs from torch's reduction only in summation order; the attention's dot products, softmax
// and weighted sum differ from torch's bmm/softmax only in summation order and exp's last bit, and so do
// the router's logits and softmax.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_pool.h"
#include "stored_blocks.h"

using dfq::Part;

extern "C" {

int df_stored_parts(const Part* parts, int n, int stack_cols, const float* x, int64_t T, int64_t ldx, float* y,
                    int64_t ldy, int threads);  // stored_cpu.cpp

int df_layer_abi() { return 6; }

// y[t] = w * (x[t] * (1 / sqrt(mean(x[t]^2) + eps))) for T rows of C (a multiple of 8) at stride ldx; y is
// [T, C] contiguous. HF's RMSNorm in fp32 (rsqrt is 1 / sqrt, as torch's vectorised rsqrt computes it).
void df_rms_norm(const float* x, int64_t T, int64_t C, int64_t ldx, const float* w, float eps, float* y) {
  for (int64_t t = 0; t < T; ++t) {
    const float* v = x + t * ldx;
    float s[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t c = 0; c < C; c += 8)
      for (int l = 0; l < 8; ++l) s[l] += v[c + l] * v[c + l];
    const float sum = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
    const float r = 1.0f / std::sqrt(sum / static_cast<float>(C) + eps);
    float* o = y + t * C;
    for (int64_t c = 0; c < C; ++c) o[c] = w[c] * (v[c] * r);
  }
}

// y[t, h] = x[t, h] * cos[t] + rotate_half(x[t, h]) * sin[t] for x [T, H, D] (heads and D contiguous, token
// stride ldx), cos/sin [T, D]; rotate_half(v) = (-v[D/2:], v[:D/2]). y is [T, H, D] contiguous.
void df_rope(const float* x, int64_t T, int64_t H, int64_t D, int64_t ldx, const float* cos, const float* sin, float* y) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float *c = cos + t * D, *s = sin + t * D;
    for (int64_t h = 0; h < H; ++h) {
      const float* v = x + t * ldx + h * D;
      float* o = y + (t * H + h) * D;
      for (int64_t j = 0; j < half; ++j) o[j] = v[j] * c[j] + (-v[j + half]) * s[j];
      for (int64_t j = half; j < D; ++j) o[j] = v[j] * c[j] + v[j - half] * s[j];
    }
  }
}

// One query row per head over a sequence's cache: o[h] = softmax(scale * K_g q[h]) V_g with g = h / (Hq / Hkv)
// (grouped-query attention). q [Hq, D] contiguous; k [L, Hkv, D] and v [L, Hkv, Dv] contiguous; o [Hq, Dv].
void df_attend_one(const float* q, const float* k, const float* v, int64_t L, int64_t Hq, int64_t Hkv, int64_t D,
                   int64_t Dv, float scale, float* o) {
  const int64_t group = Hq / Hkv;
  std::vector<float> p(static_cast<size_t>(L));
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t g = h / group;
    const float* qh = q + h * D;
    float top = -INFINITY;
    for (int64_t l = 0; l < L; ++l) {
      const float* kl = k + (l * Hkv + g) * D;
      float s[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      int64_t d = 0;
      for (; d + 8 <= D; d += 8)
        for (int j = 0; j < 8; ++j) s[j] += qh[d + j] * kl[d + j];
      float dot = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
      for (; d < D; ++d) dot += qh[d] * kl[d];
      p[l] = dot * scale;
      top = std::max(top, p[l]);
    }
    float total = 0.0f;
    for (int64_t l = 0; l < L; ++l) total += (p[l] = std::exp(p[l] - top));
    float* oh = o + h * Dv;
    std::fill(oh, oh + Dv, 0.0f);
    for (int64_t l = 0; l < L; ++l) {
      const float w = p[l] / total;
      const float* vl = v + (l * Hkv + g) * Dv;
      for (int64_t d = 0; d < Dv; ++d) oh[d] += w * vl[d];
    }
  }
}

// One attention layer as attention.py's AttnStep plans it (cpu_kernels.py's AttnLayer): q/k/v as the
// stacked rows of n_qkv stored parts, o as n_o parts; the optional pointers are null where absent.
struct AttnLayer {
  const Part *qkv, *o;
  int64_t n_qkv, n_o;
  const float *norm, *qkv_bias, *o_bias, *q_norm, *k_norm;
  int64_t hidden, hq, hkv, d;
  float eps, qk_eps, scale;
};

// out [hidden] = x + o(attend(rope(q), rope(k), v)) for ONE token x [hidden], with q/k/v = qkv(rms_norm(x))
// (+ bias; each head of q and k RMS-normed first where q_norm/k_norm are given), the token's k and v
// written into row `len` of its cache kbuf/vbuf ([>= len + 1, hkv, d], the caller made room) and the
// attention over rows 0..len. The transformer's Attention step op for op, so the same numbers as its
// per-op path. Returns 1 if a matmul part does not fit its kind.
int df_attn_decode(const AttnLayer* a, const float* x, const float* cos, const float* sin, float* kbuf, float* vbuf,
                   int64_t len, float* out, int threads) {
  const int64_t H = a->hidden, hq = a->hq, hkv = a->hkv, D = a->d, n_qkv = (hq + 2 * hkv) * D;
  dfq::Floats scratch(static_cast<size_t>(H + n_qkv + 3 * hq * D + H));  // written before read: not zeroed
  float *hn = scratch.data(), *qkv = hn + H, *q = qkv + n_qkv, *qn = q + hq * D, *o = qn + hq * D, *y = o + hq * D;
  float *k_row = kbuf + len * hkv * D, *v_row = vbuf + len * hkv * D;
  df_rms_norm(x, 1, H, H, a->norm, a->eps, hn);
  if (df_stored_parts(a->qkv, static_cast<int>(a->n_qkv), 0, hn, 1, H, qkv, n_qkv, threads)) return 1;
  if (a->qkv_bias)
    for (int64_t i = 0; i < n_qkv; ++i) qkv[i] += a->qkv_bias[i];
  if (a->q_norm) {
    std::vector<float> kn(static_cast<size_t>(hkv * D));
    df_rms_norm(qkv, hq, D, D, a->q_norm, a->qk_eps, qn);
    df_rms_norm(qkv + hq * D, hkv, D, D, a->k_norm, a->qk_eps, kn.data());
    df_rope(qn, 1, hq, D, hq * D, cos, sin, q);
    df_rope(kn.data(), 1, hkv, D, hkv * D, cos, sin, k_row);
  } else {
    df_rope(qkv, 1, hq, D, n_qkv, cos, sin, q);
    df_rope(qkv + hq * D, 1, hkv, D, n_qkv, cos, sin, k_row);
  }
  std::memcpy(v_row, qkv + (hq + hkv) * D, sizeof(float) * hkv * D);
  df_attend_one(q, kbuf, vbuf, len + 1, hq, hkv, D, D, a->scale, o);
  if (df_stored_parts(a->o, static_cast<int>(a->n_o), 0, o, 1, hq * D, y, H, threads)) return 1;
  if (a->o_bias)
    for (int64_t i = 0; i < H; ++i) y[i] += a->o_bias[i];
  for (int64_t i = 0; i < H; ++i) out[i] = x[i] + y[i];
  return 0;
}

namespace {

// h [T, I] = act(g[t, :I]) * g[t, I:] for T rows of g, `ld` apart, on the pool in tasks of `per_task` rows.
// act is torch's formula: 0 silu x / (1 + exp(-x)), 1 gelu x * 0.5 * (1 + erf(x / sqrt 2)), 2 gelu's tanh
// form (libm's exp/erf/tanh may differ from torch's in the last bit); a scalar exp/erf/tanh per element.
void gate_act(const float* g, int64_t T, int64_t ld, int64_t I, int act, float* h, int64_t per_task, int threads) {
  constexpr float kSqrtHalf = 0.70710678118654752440f, kBeta = 0.79788456080286535588f, kKappa = 0.044715f;
  df::pool().run(static_cast<int>((T + per_task - 1) / per_task), threads, [&](int task) {
    for (int64_t t = task * per_task; t < std::min(T, (task + 1) * per_task); ++t)
      for (int64_t i = 0; i < I; ++i) {
        const float v = g[t * ld + i];
        const float a = act == 0 ? v / (1.0f + std::exp(-v))
                      : act == 1 ? v * 0.5f * (1.0f + std::erf(v * kSqrtHalf))
                                 : 0.5f * v * (1.0f + std::tanh(kBeta * (v + kKappa * v * v * v)));
        h[t * I + i] = a * g[t * ld + I + i];
      }
  });
}

}  // namespace

// y [T, hidden] = down(act(gate n) * up n) for x [T, cols], n = x or, where `norm` is given, rms_norm(x)
// with it; plus x itself where add_x (a decoder layer's whole MLP half, x + mlp(norm(x))). `gu` stacks
// the gate rows then the up rows (one expert's gate and up, or every slice's gates then every slice's
// ups), `down` the down matrices side by side (their columns follow the gates'); act as gate_act's.
// Returns 1 if a part does not fit its kind or the halves do not match.
int df_gated_mlp(const Part* gu, int n_gu, const Part* down, int n_down, const float* x, int64_t T, int act,
                 const float* norm, float eps, int add_x, float* y, int threads) {
  int64_t rows = 0, down_cols = 0;
  const int64_t C = gu[0].cols, H = down[0].rows;
  for (int p = 0; p < n_gu; ++p) rows += gu[p].rows;
  for (int p = 0; p < n_down; ++p) down_cols += down[p].cols;
  const int64_t I = rows / 2;
  if (rows % 2 || down_cols != I || act < 0 || act > 2 || (add_x && H != C) || (norm && C % 8)) return 1;
  // Every element written before it is read: not zeroed (a std::vector's zeroing was a memset per call).
  dfq::Floats g(static_cast<size_t>(T * rows)), h(static_cast<size_t>(T * I)), xn(norm ? T * C : 0);
  if (norm) df_rms_norm(x, T, C, C, norm, eps, xn.data());
  if (df_stored_parts(gu, n_gu, 0, norm ? xn.data() : x, T, C, g.data(), rows, threads)) return 1;
  gate_act(g.data(), T, rows, I, act, h.data(), 32, threads);  // a prompt's T x I on the pool in blocks of tokens
  if (df_stored_parts(down, n_down, 1, h.data(), T, I, y, H, threads)) return 1;
  if (add_x)
    for (int64_t i = 0; i < T * H; ++i) y[i] = x[i] + y[i];
  return 0;
}

// One routed expert as df_moe_token takes it (cpu_kernels.py's MoeExpert, planned by gated_mlp.py):
// df_gated_mlp's gate/up parts (gate rows then up rows) and down parts (side by side).
struct MoeExpert {
  const Part *gu, *down;
  int64_t n_gu, n_down;
};

// One token's k routed experts of a MoE layer in one call: y[i] = y[i] + mlp_e(x)[i] * w[e] for e = 0..k-1
// in the order given, each product and sum rounded to fp32 as torch's `y += mlp_e(x) * w_e` rounds them
// (-ffp-contract=off), mlp_e as df_gated_mlp computes it for x [1, cols] alone, bit for bit: every
// expert's gate and up rows in ONE matmul call (x read and, in q8 mode, quantized once), the activations
// on the pool an expert a task, the downs on the pool in runs of rows (each run the matmul of those rows
// alone, which gives each row the bits of the whole matrix's call), then the sum. 8 experts made 8 calls
// with 16 waits on the pool and the Python between them (tests/bench/RESULTS.md). Returns 1, y untouched,
// where an expert's parts do not fit their kinds or the experts' shapes differ.
int df_moe_token(const MoeExpert* const* ex, int k, const float* w, const float* x, int act, float* y, int threads) {
  constexpr int kMaxDown = 8;
  if (k <= 0 || act < 0 || act > 2) return 1;
  const int64_t C = ex[0]->gu[0].cols, H = ex[0]->down[0].rows;
  int64_t rows = 0;
  std::vector<Part> gu;
  for (int e = 0; e < k; ++e) {
    int64_t r = 0, dc = 0;
    for (int64_t p = 0; p < ex[e]->n_gu; ++p) r += ex[e]->gu[p].rows, gu.push_back(ex[e]->gu[p]);
    for (int64_t p = 0; p < ex[e]->n_down; ++p) dc += ex[e]->down[p].cols;
    if (e == 0) rows = r;
    if (r != rows || r % 2 || dc != r / 2 || ex[e]->down[0].rows != H || ex[e]->n_down > kMaxDown) return 1;
  }
  for (const Part& p : gu)
    if (p.cols != C) return 1;
  const int64_t I = rows / 2;
  // Runs of rows per expert: about four tasks a thread over all the experts, 16-row aligned.
  const int64_t chunks = std::max<int64_t>(1, (4 * threads + k - 1) / k);
  const int64_t run = std::max<int64_t>(16, (H + chunks - 1) / chunks + 15) / 16 * 16;
  const int64_t runs = (H + run - 1) / run;
  dfq::Floats g(static_cast<size_t>(k * rows)), h(static_cast<size_t>(k * I)), m(static_cast<size_t>(k * H));
  if (df_stored_parts(gu.data(), static_cast<int>(gu.size()), 0, x, 1, C, g.data(), k * rows, threads)) return 1;
  gate_act(g.data(), k, rows, I, act, h.data(), 1, threads);  // expert e's g is "row" e
  std::atomic<int> bad{0};
  df::pool().run(static_cast<int>(k * runs), threads, [&](int task) {
    const int e = static_cast<int>(task / runs);
    const int64_t r0 = task % runs * run, r1 = std::min(H, r0 + run);
    Part sub[kMaxDown];
    for (int64_t p = 0; p < ex[e]->n_down; ++p) {
      sub[p] = ex[e]->down[p];
      sub[p].rows = r1 - r0;
      sub[p].data += r0 * sub[p].row_bytes;
    }
    if (df_stored_parts(sub, static_cast<int>(ex[e]->n_down), 1, h.data() + e * I, 1, I, m.data() + e * H + r0, H, 1))
      bad.store(1);
  });
  if (bad.load()) return 1;
  for (int e = 0; e < k; ++e)
    for (int64_t i = 0; i < H; ++i) y[i] = y[i] + m[e * H + i] * w[e];
  return 0;
}

namespace {

// W[r] . x for a row of W [*, H]: the products summed in 16 fixed lanes, the lanes in one fixed tree, then
// the tail of H past its last multiple of 16 in order. A row at a time: 4 or 8 rows interleaved read a
// cold 1 MB weight no faster and a cached one up to 1.5x slower (tests/bench/RESULTS.md, "router").
float router_dot(const float* w, int64_t H, const float* x) {
  float s[16] = {};
  const int64_t H16 = H / 16 * 16;
  for (int64_t c = 0; c < H16; c += 16)
    for (int l = 0; l < 16; ++l) s[l] += w[c + l] * x[c + l];
  float a[8];
  for (int l = 0; l < 8; ++l) a[l] = s[l] + s[l + 8];
  float dot = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
  for (int64_t c = H16; c < H; ++c) dot += w[c] * x[c];
  return dot;
}

}  // namespace

// A softmax top-k MoE router for ONE token (Qwen3-MoE's and OLMoE's `mlp.gate`, qwen3_moe.Router): logits
// = W x for W [E, H] fp32 (rows on the pool in one contiguous run a thread), p = softmax(logits) in fp32
// (max-subtracted, times 1 / sum, as torch's CPU softmax), the k largest p in descending order, an equal
// p taking the lower expert id first, then, where `renorm`, each divided by their sum (norm_topk_prob).
// Writes ids [k] and w [k]. torch's F.linear, softmax, topk and renormalisation were five ops of 5-100 us
// each a layer on one token (tests/bench/RESULTS.md). Returns 1, nothing written, where k is not in
// [1, E] or a probability is not a number (a NaN or inf in x): torch's ops then decide.
int df_route_token(const float* W, int64_t E, int64_t H, const float* x, int k, int renorm, int64_t* ids, float* w,
                   int threads) {
  if (k < 1 || k > E || H < 1) return 1;
  dfq::Floats p(static_cast<size_t>(E));
  // One run of rows a thread: a task reads one contiguous stretch of W.
  const int64_t run = (E + std::max(threads, 1) - 1) / std::max(threads, 1);
  df::pool().run(static_cast<int>((E + run - 1) / run), threads, [&](int task) {
    for (int64_t r = task * run; r < std::min(E, (task + 1) * run); ++r) p[r] = router_dot(W + r * H, H, x);
  });
  float top = p[0], total = 0.0f;
  for (int64_t e = 1; e < E; ++e) top = std::max(top, p[e]);
  for (int64_t e = 0; e < E; ++e) total += (p[e] = std::exp(p[e] - top));
  if (!std::isfinite(total) || !(total > 0.0f)) return 1;  // NaN or inf among the logits
  const float inv = 1.0f / total;
  for (int64_t e = 0; e < E; ++e) p[e] *= inv;
  // Insertion into the k best so far: strictly greater moves up, so an equal p stays behind a lower id.
  int n = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (n == k && !(p[e] > w[k - 1])) continue;
    int j = n < k ? n++ : k - 1;
    for (; j > 0 && p[e] > w[j - 1]; --j) w[j] = w[j - 1], ids[j] = ids[j - 1];
    w[j] = p[e], ids[j] = e;
  }
  if (renorm) {
    float sum = 0.0f;
    for (int i = 0; i < k; ++i) sum += w[i];
    for (int i = 0; i < k; ++i) w[i] = w[i] / sum;
  }
  return 0;
}

// One decoder layer of a one-token decode step (cpu_kernels.py's DecodeLayer, filled by ops/step.py's
// DecodeChain): its attention as
// df_attn_decode takes it, with its cache and length, and its dense MLP (a layer's slices, held
// resident) as df_gated_mlp takes it with the layer's norm.
struct DecodeLayer {
  const AttnLayer* attn;
  float *kbuf, *vbuf;
  int64_t len;
  const Part *gu, *down;
  int64_t n_gu, n_down;
  const float* norm;
  float eps;
  int32_t act;
};

// n decoder layers of ONE token in one call: for each, x <- x + attn(norm x) (df_attn_decode), then
// x <- x + mlp(norm x) (df_gated_mlp), the calls the per-layer path makes, in its order and with its
// arguments, so bit-identical to it (tests/unit/test_decode_chain.py). x [hidden] is updated after
// each whole layer. Returns the number of layers done: n, or the layer whose part did not fit its
// kind (its cache row may be written; the caller counts a row only for the layers done).
int df_decode_layers(const DecodeLayer* layers, int n, const float* cos, const float* sin, float* x, int threads) {
  if (n <= 0) return 0;
  const int64_t H = layers[0].attn->hidden;
  std::vector<float> h(static_cast<size_t>(H)), y(static_cast<size_t>(H));
  for (int i = 0; i < n; ++i) {
    const DecodeLayer& l = layers[i];
    if (l.attn->hidden != H || df_attn_decode(l.attn, x, cos, sin, l.kbuf, l.vbuf, l.len, h.data(), threads) ||
        df_gated_mlp(l.gu, static_cast<int>(l.n_gu), l.down, static_cast<int>(l.n_down), h.data(), 1, l.act, l.norm,
                     l.eps, 1, y.data(), threads))
      return i;
    std::memcpy(x, y.data(), sizeof(float) * static_cast<size_t>(H));
  }
  return n;
}

}  // extern "C"
