// The small per-layer ops of a CPU decode step, fp32: RMSNorm and rotary embeddings.
//
// Each was a handful of torch ops costing 10-30 us a call on one token, against ~3 us for one ctypes
// call here; a demo token runs 61 norms and 30 ropes (tests/bench/RESULTS.md). Single-threaded (a
// row is 0.5-30 KB of work). Built by deltafind/models/ops/cpu_kernels.py with -ffp-contract=off:
// the rope is torch's arithmetic op for op (x*cos + rotate_half(x)*sin, every product and the sum
// rounded), so bit-identical; the norm sums its squares in 8 fixed lanes, one fixed tree, which
// differs from torch's reduction only in summation order.
#include <cmath>
#include <cstdint>

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

}  // extern "C"
