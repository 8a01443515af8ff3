// llama.cpp's IQ block formats for stored_cpu.cpp's decode: IQ1_S/M, IQ2_XXS/XS/S, IQ3_XXS/S, IQ4_NL/XS,
// each weight decoded exactly as gguf-py's dequantize decodes it (its fp32 operations in its order; built
// with -ffp-contract=off). The non-linear code grids are gguf-py's own, handed in once (`set_grid`).
#pragma once
#include <cstdint>
#include <cstring>

#include "stored_blocks.h"

namespace dfq {
namespace {

// The IQ formats' code grids, gguf-py's own tables (quants.py) handed in once by models/ops/stored_weight.py
// through df_stored_set_grid (a decode before then reads zeros, never garbage): 8 values an entry for
// IQ2_XXS (256 entries), IQ2_XS (512), IQ2_S (1024) and IQ1_S/IQ1_M (2048), 4 for IQ3_XXS (256), IQ3_S (512).
inline int8_t iq2xxs_grid[256 * 8], iq2xs_grid[512 * 8], iq2s_grid[1024 * 8], iq3xxs_grid[256 * 4], iq3s_grid[512 * 4],
    iq1s_grid[2048 * 8];

// IQ2_XXS/IQ2_XS/IQ3_XXS: a 7-bit sign index i means the sign byte i with bit 7 set when i has odd parity.
inline uint32_t sign_byte(uint32_t index7) { return index7 | ((__builtin_popcount(index7) & 1u) << 7); }

// 8 (or 4) weights of one grid entry: w = db * grid * sign, sign bit j of `signs` (from bit `first`). The sign
// flips the product's sign bit, exactly what * -1 does, without a branch on random bits.
template <int N>
inline void entry(float db, const int8_t* grid, uint32_t signs, int first, float* o) {
  for (int j = 0; j < N; ++j) {
    const float v = db * static_cast<float>(grid[j]);
    uint32_t u;
    std::memcpy(&u, &v, 4);
    u ^= ((signs >> (first + j)) & 1u) << 31;
    std::memcpy(o + j, &u, 4);
  }
}

// One 256-weight IQ2_XXS block (d, then 8 groups of two u32): group g's first word holds 4 grid indices
// (8 weights each), its second 4 sign indices (7 bits each) and a 4-bit scale s on top; w = db * grid * sign
// with db = d * (0.5 + s) * 0.25, gguf-py's operations in its order.
inline void decode_iq2_xxs(const uint8_t* b, float* out) {
  const float d = h2f(rd16(b));
  for (int g = 0; g < 8; ++g) {
    uint32_t aux[2];
    std::memcpy(aux, b + 2 + 8 * g, 8);
    const float db = d * (0.5f + static_cast<float>(aux[1] >> 28)) * 0.25f;
    for (int k = 0; k < 4; ++k) {
      entry<8>(db, iq2xxs_grid + 8 * ((aux[0] >> (8 * k)) & 0xFF), sign_byte((aux[1] >> (7 * k)) & 127), 0, out + 32 * g + 8 * k);
    }
  }
}

// One 256-weight IQ3_XXS block (d, qs[64] grid indices of 4 weights, 8 u32 of signs and scale): as IQ2_XXS
// with db = d * (0.5 + s) * 0.5 and 8 grid entries of 4 weights per 32.
inline void decode_iq3_xxs(const uint8_t* b, float* out) {
  const float d = h2f(rd16(b));
  for (int g = 0; g < 8; ++g) {
    uint32_t aux;
    std::memcpy(&aux, b + 66 + 4 * g, 4);
    const float db = d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f;
    for (int k = 0; k < 8; ++k) {
      entry<4>(db, iq3xxs_grid + 4 * b[2 + 8 * g + k], sign_byte((aux >> (7 * (k / 2))) & 127), 4 * (k % 2), out + 32 * g + 4 * k);
    }
  }
}

// IQ2_XS (d, 32 u16 entries: 9-bit grid index, 7-bit sign index; 16 scale nibbles) and IQ2_S (d, 32 index
// bytes, 32 sign bytes, 2 high index bits per entry, 16 scale nibbles): 8 weights an entry, a scale per 16,
// w = db * grid * sign with db = d * (0.5 + s) * 0.25.
template <bool S>
inline void decode_iq2_xs_s(const uint8_t* b, float* out) {
  const float d = h2f(rd16(b));
  const uint8_t* scales = b + (S ? 74 : 66);
  for (int l = 0; l < 32; ++l) {
    const int s = (scales[l / 4] >> (4 * ((l / 2) % 2))) & 0x0F;
    const float db = d * (0.5f + static_cast<float>(s)) * 0.25f;
    int index;
    uint32_t signs;
    if constexpr (S) {
      index = b[2 + l] | (((b[66 + l / 4] >> (2 * (l % 4))) & 3) << 8);
      signs = b[34 + l];
    } else {
      const uint16_t q = rd16(b + 2 + 2 * l);
      index = q & 511;
      signs = sign_byte(q >> 9);
    }
    entry<8>(db, (S ? iq2s_grid : iq2xs_grid) + 8 * index, signs, 0, out + 8 * l);
  }
}

// IQ3_S (d, 64 index bytes, their 9th bits, 32 sign bytes, 8 scale nibbles): 4 weights an entry, a scale per
// 32, w = (d * (1 + 2s)) * grid * sign.
inline void decode_iq3_s(const uint8_t* b, float* out) {
  const float d = h2f(rd16(b));
  for (int l = 0; l < 64; ++l) {
    const int s = (b[106 + l / 16] >> (4 * ((l / 8) % 2))) & 0x0F;
    const float db = d * static_cast<float>(1 + 2 * s);
    entry<4>(db, iq3s_grid + 4 * (b[2 + l] | (((b[66 + l / 8] >> (l % 8)) & 1) << 8)), b[74 + l / 2], 4 * (l % 2), out + 4 * l);
  }
}

// IQ1_S (d, 32 index bytes, 8 u16: 3 high index bits per entry, a 3-bit scale, the delta's sign) and IQ1_M
// (32 index bytes, 16 bytes of high bits and delta signs per entry, 4 u16 of 3-bit scales with d in their top
// nibbles): 8 weights an entry, w = dl * (grid + delta), dl = d * (2s + 1), delta = +-0.125.
template <bool M>
inline void decode_iq1(const uint8_t* b, float* out) {
  float d;
  if constexpr (M) {
    const uint16_t s0 = rd16(b + 48), s1 = rd16(b + 50), s2 = rd16(b + 52), s3 = rd16(b + 54);
    d = h2f(static_cast<uint16_t>((s0 >> 12) | ((s1 & 0xF000) >> 8) | ((s2 & 0xF000) >> 4) | (s3 & 0xF000)));
  } else {
    d = h2f(rd16(b));
  }
  const uint8_t* qs = b + (M ? 0 : 2);
  for (int l = 0; l < 32; ++l) {
    int s, high;
    bool negative;
    if constexpr (M) {
      s = (rd16(b + 48 + 2 * (l / 8)) >> (3 * ((l / 2) % 4))) & 7;
      const int nib = (b[32 + l / 2] >> (4 * (l % 2))) & 0x0F;
      high = nib & 7;
      negative = nib & 8;
    } else {
      const uint16_t qh = rd16(b + 34 + 2 * (l / 4));
      s = (qh >> 12) & 7;
      high = (qh >> (3 * (l % 4))) & 7;
      negative = qh & 0x8000;
    }
    const float dl = d * static_cast<float>(2 * s + 1), delta = negative ? -0.125f : 0.125f;
    const int8_t* grid = iq1s_grid + 8 * (qs[l] | (high << 8));
    for (int j = 0; j < 8; ++j) out[8 * l + j] = dl * (static_cast<float>(grid[j]) + delta);
  }
}

// IQ4_NL and IQ4_XS: 4-bit codes index this non-linear table (gguf-py's IQ4_NL.kvalues).
constexpr int8_t kIQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// 32 weights of 16 code bytes (low nibbles then high): w = d * kIQ4[code]. An IQ4_NL block is d then these.
inline void decode_iq4_32(const uint8_t* qs, float d, float* out) {
  for (int c = 0; c < 16; ++c) {
    out[c] = d * static_cast<float>(kIQ4[qs[c] & 15]);
    out[c + 16] = d * static_cast<float>(kIQ4[qs[c] >> 4]);
  }
}

inline void decode_iq4_nl(const uint8_t* b, float* out) { decode_iq4_32(b + 2, h2f(rd16(b)), out); }

// One 256-weight IQ4_XS block (d, scales_h u16, scales_l[4], qs[128]): group i of 32 has the 6-bit signed
// scale (nibble i of scales_l | bits 2i..2i+1 of scales_h << 4) - 32 and w = (d*sc) * kIQ4[code].
inline void decode_iq4_xs(const uint8_t* b, float* out) {
  const float d = h2f(rd16(b));
  const uint16_t high = rd16(b + 2);
  for (int i = 0; i < 8; ++i) {
    const int sc = (((b[4 + i / 2] >> (4 * (i % 2))) & 0x0F) | (((high >> (2 * i)) & 3) << 4)) - 32;
    decode_iq4_32(b + 8 + 16 * i, d * static_cast<float>(sc), out + 32 * i);
  }
}

// Weights of one 256-weight IQ block of `kind` (GGML id) into out; false for a kind not here.
inline bool decode_iq(int kind, const uint8_t* b, float* out) {
  switch (kind) {
    case 16: decode_iq2_xxs(b, out); return true;
    case 17: decode_iq2_xs_s<false>(b, out); return true;
    case 18: decode_iq3_xxs(b, out); return true;
    case 19: decode_iq1<false>(b, out); return true;
    case 21: decode_iq3_s(b, out); return true;
    case 22: decode_iq2_xs_s<true>(b, out); return true;
    case 23: decode_iq4_xs(b, out); return true;
    case 29: decode_iq1<true>(b, out); return true;
    default: return false;
  }
}

// Copy gguf-py's code grid of `kind` (entries x values, int8) in; 1 if the kind has none or `n` is not its
// size. IQ1_M shares IQ1_S's.
inline int set_grid(int kind, const int8_t* values, int64_t n) {
  int8_t* grid = kind == 16 ? iq2xxs_grid : kind == 17 ? iq2xs_grid : kind == 22 ? iq2s_grid : kind == 18 ? iq3xxs_grid
               : kind == 21 ? iq3s_grid : kind == 19 ? iq1s_grid : nullptr;
  const int64_t size = kind == 16 ? 2048 : kind == 17 ? 4096 : kind == 22 ? 8192 : kind == 18 ? 1024 : kind == 21 ? 2048 : 16384;
  if (grid == nullptr || n != size) return 1;
  std::memcpy(grid, values, static_cast<size_t>(n));
  return 0;
}

}  // namespace
}  // namespace dfq
