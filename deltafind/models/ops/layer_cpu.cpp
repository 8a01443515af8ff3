// The small per-layer ops of a CPU decode step, fp32: RMSNorm, rotary embeddings, one-row attention.
//
// Each was a handful of torch ops costing 10-30 us a call on one token, against ~3 us for one ctypes
// call here; a demo token runs 61 norms and 30 ropes (tests/bench/RESULTS.md). Single-threaded (a
// row is 0.5-30 KB of work). Built by deltafind/models/ops/cpu_kernels.py with -ffp-contract=off:
// the rope is torch's arithmetic op for op (x*cos + rotate_half(x)*sin, every product and the sum
// rounded), so bit-identical; the norm sums its squares in 8 fixed lanes, one fixed tree, which
// differs from torch's reduction only in summation order; the attention's dot products, softmax and
// weighted sum differ from torch's bmm/softmax only in summation order and exp's last bit.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

extern "C" {

int df_layer_abi() { return 1; }

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

}  // extern "C"
