// The rows of a float source as float32, decoded one row at a time inside the requant job (JobArgs::rows):
// bf16 / f16 / f32 weights, e4m3 and E2M1 times their block scales (FP8, MXFP4, NVFP4), MLX affine
// words with their scales and biases, GGUF's quantised blocks. Each decodes exactly as the per-module
// reader does (float_source.FloatReader, fp8.block_dequant, fp4._fp4_weights, mlx_checkpoint.dequantize,
// gguf.quants.dequantize): the same float32 operations in the same order, so a row is the same bits
// either way. A row decoded in the job stays in cache, where a whole decoded tensor (6 MB for an
// expert of Qwen3-30B-A3B) went through memory twice.

#include "convert_kernels.h"

namespace i4p {

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, f;
  if (exp == 0) {
    if (mant == 0) {
      f = sign;
    } else {  // subnormal: normalise the mantissa
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while (!(mant & 0x400u));
      f = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3FFu) << 13);
    }
  } else if (exp == 31) {
    f = sign | 0x7F800000u | (mant << 13);
  } else {
    f = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float x;
  std::memcpy(&x, &f, 4);
  return x;
}

namespace {

template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// e4m3 byte -> float32, exactly (sign, 4 exponent bits of bias 7, 3 mantissa bits); NaN at 0x7F, 0xFF
float e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 0x0F, m = b & 7;
  if ((b & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  const float v = e == 0 ? std::ldexp(static_cast<float>(m) / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -v : v;
}

// a scale as float32, as the readers decode it (formats/minifloat.py, fp8._scale_f32, mlx_checkpoint._float)
float scale_value(const uint8_t* p, int64_t type) {
  switch (type) {
    case kScaleF32: return load<float>(p);
    case kScaleF16: return half_to_float(load<uint16_t>(p));
    case kScaleBf16: return bf16_value(load<uint16_t>(p));
    case kScaleE8m0: {
      if (*p == 255) return std::numeric_limits<float>::quiet_NaN();
      const uint32_t w = *p == 0 ? 0x00400000u : static_cast<uint32_t>(*p) << 23;  // 2^(e - 127)
      float v;
      std::memcpy(&v, &w, 4);
      return v;
    }
    default: return e4m3_value(*p);
  }
}

int64_t scale_bytes(int64_t type) { return type == kScaleF32 ? 4 : (type >= kScaleE8m0 ? 1 : 2); }

// ------------------------------------------------------------------------------ bf16, f16, f32

I4P_CLONES void bf16_row(const uint8_t* p, int64_t k, float* x) {
  for (int64_t c = 0; c < k; ++c) {
    const uint32_t u = static_cast<uint32_t>(load<uint16_t>(p + 2 * c)) << 16;
    std::memcpy(x + c, &u, 4);
  }
}

struct PlainRows : FloatRows {
  const uint8_t* w;
  int64_t k, layout;
  void row(int64_t r, float* x) const override {
    if (layout == kSrcF32) {
      std::memcpy(x, w + r * k * 4, k * 4);
    } else if (layout == kSrcBf16) {
      bf16_row(w + r * k * 2, k, x);
    } else {
      for (int64_t c = 0; c < k; ++c) x[c] = half_to_float(load<uint16_t>(w + (r * k + c) * 2));
    }
  }
};

// ------------------------------------------------------------------------------ e4m3, E2M1 blocks

// (fp8.block_dequant: the e4m3 value times its block's scale; fp4._fp4_weights: the block scales
// divided or multiplied by the global one first, then each code's value times its block's scale)
struct BlockRows : FloatRows {
  const uint8_t* w;
  int64_t k, bn, bk, cols;
  bool e2m1;
  std::vector<float> sc;  // [ceil(N / bn), cols]
  float lut[256];
  void row(int64_t r, float* x) const override {
    const float* srow = sc.data() + (r / bn) * cols;
    if (e2m1 && bk % 2) {  // a pair across two blocks
      const uint8_t* b = w + r * (k / 2);
      for (int64_t c = 0; c < k; c += 2) {
        x[c] = lut[b[c / 2] & 0x0F] * srow[c / bk];
        x[c + 1] = lut[b[c / 2] >> 4] * srow[(c + 1) / bk];
      }
      return;
    }
    for (int64_t c0 = 0; c0 < k; c0 += bk) {
      const float s = srow[c0 / bk];
      const int64_t c1 = std::min(k, c0 + bk);
      if (e2m1) {
        const uint8_t* b = w + r * (k / 2);
        for (int64_t c = c0; c < c1; c += 2) {
          x[c] = lut[b[c / 2] & 0x0F] * s;
          x[c + 1] = lut[b[c / 2] >> 4] * s;
        }
      } else {
        const uint8_t* b = w + r * k;
        for (int64_t c = c0; c < c1; ++c) x[c] = lut[b[c]] * s;
      }
    }
  }
};

// ------------------------------------------------------------------------------ MLX affine

// mlx_checkpoint.dequantize: q * scale + bias per group (float32, the product rounded, then the sum),
// q the bits-wide fields of the little-endian words from the low bits up
I4P_CLONES void mlx_row(const uint8_t* w, const float* s, const float* b, int64_t k, int64_t group, int bits,
                        float* x) {
  for (int64_t j = 0; j < k / group; ++j) {
    const float sj = s[j], bj = b[j];
    float* o = x + j * group;
    if (bits == 8) {
      const uint8_t* q = w + j * group;
      for (int64_t c = 0; c < group; ++c) o[c] = static_cast<float>(q[c]) * sj + bj;
    } else {
      const uint8_t* q = w + j * group / 2;
      for (int64_t c = 0; c < group / 2; ++c) {
        o[2 * c] = static_cast<float>(q[c] & 0x0F) * sj + bj;
        o[2 * c + 1] = static_cast<float>(q[c] >> 4) * sj + bj;
      }
    }
  }
}

struct MlxRows : FloatRows {
  const uint8_t *w, *s, *b;
  int64_t k, group, type;
  int bits;
  void row(int64_t r, float* x) const override {
    const int64_t groups = k / group, item = scale_bytes(type);
    float sv[kMlxMaxGroups], bv[kMlxMaxGroups];
    for (int64_t j = 0; j < groups; ++j) {
      sv[j] = scale_value(s + (r * groups + j) * item, type);
      bv[j] = scale_value(b + (r * groups + j) * item, type);
    }
    mlx_row(w + r * (k * bits / 8), sv, bv, k, group, bits, x);
  }
  static constexpr int64_t kMlxMaxGroups = 1 << 12;
};

// ------------------------------------------------------------------------------ GGUF blocks

// gguf.quants.<type>.dequantize_blocks, block by block: the float32 operations of its numpy
// expressions, in their order (d * q, (d * q) + m, (d * sc) * q - dmin * m, ...)
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// 6-bit scale and min j of a K-quant block's 12 bytes (gguf's Q4_K.get_scale_min)
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 0x3F;
    m = s[4 + j] & 0x3F;
  } else {
    sc = (s[8 + j - 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    m = (s[8 + j - 4] >> 4) | ((s[4 + j - 4] >> 2) & 0x30);
  }
}

I4P_CLONES void gguf_row(int64_t type, const uint8_t* p, int64_t k, float* x) {
  switch (type) {
    case kGgufQ4_1:
    case kGgufQ5_0:
    case kGgufQ5_1:
    case kGgufIq4Nl: {  // 32 values: d (and m) fp16, the high bits (Q5), 16 bytes of nibbles
      const bool q5 = type == kGgufQ5_0 || type == kGgufQ5_1, min = type == kGgufQ4_1 || type == kGgufQ5_1;
      const int64_t bytes = 18 + (min ? 2 : 0) + (q5 ? 4 : 0);
      for (int64_t i = 0; i < k / 32; ++i, p += bytes) {
        const float d = half_to_float(load<uint16_t>(p));
        const float m = min ? half_to_float(load<uint16_t>(p + 2)) : 0.0f;
        const uint32_t qh = q5 ? load<uint32_t>(p + (min ? 4 : 2)) : 0;
        const uint8_t* qs = p + bytes - 16;
        float* o = x + 32 * i;
        for (int j = 0; j < 32; ++j) {
          const int lo = (j < 16 ? qs[j] : qs[j - 16] >> 4) & 0x0F;
          if (type == kGgufIq4Nl) {
            o[j] = d * static_cast<float>(kIq4Values[lo]);
          } else if (type == kGgufQ4_1) {
            o[j] = d * static_cast<float>(lo) + m;
          } else {
            const int q = lo | static_cast<int>(((qh >> j) & 1u) << 4);
            o[j] = min ? d * static_cast<float>(q) + m : d * static_cast<float>(q - 16);
          }
        }
      }
      return;
    }
    case kGgufQ8_0:  // 32 values: d fp16, 32 int8
      for (int64_t i = 0; i < k / 32; ++i, p += 34) {
        const float d = half_to_float(load<uint16_t>(p));
        const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
        for (int j = 0; j < 32; ++j) x[32 * i + j] = static_cast<float>(q[j]) * d;
      }
      return;
    case kGgufQ4_K:
    case kGgufQ5_K: {  // 256 values: d, dmin fp16, 12 bytes of 6-bit scales and mins, (32 bytes of 5th bits,) nibbles
      const bool q5 = type == kGgufQ5_K;
      const int64_t bytes = q5 ? 176 : 144;
      for (int64_t i = 0; i < k / 256; ++i, p += bytes) {
        const float d = half_to_float(load<uint16_t>(p)), dmin = half_to_float(load<uint16_t>(p + 2));
        const uint8_t* qh = p + 16;
        const uint8_t* qs = p + (q5 ? 48 : 16);
        for (int sb = 0; sb < 8; ++sb) {  // sub-block sb: nibble sb % 2 of bytes 32 (sb / 2) ..
          int sc, mn;
          k_scale_min(p + 4, sb, sc, mn);
          const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(mn);
          const uint8_t* b = qs + 32 * (sb / 2);
          float* o = x + 256 * i + 32 * sb;
          for (int j = 0; j < 32; ++j) {
            int q = (b[j] >> (4 * (sb % 2))) & 0x0F;
            if (q5) q |= ((qh[j] >> sb) & 1) << 4;
            o[j] = dl * static_cast<float>(q) - ml;
          }
        }
      }
      return;
    }
    case kGgufQ6_K:  // 256 values: 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d fp16
      for (int64_t i = 0; i < k / 256; ++i, p += 210) {
        const float d = half_to_float(load<uint16_t>(p + 208));
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
        float* o = x + 256 * i;
        for (int e = 0; e < 256; ++e) {
          const int h = e / 128, f = e % 128;
          const int lo = (p[64 * h + f % 64] >> (4 * (f / 64))) & 0x0F;
          const int hi = (p[128 + 32 * h + f % 32] >> (2 * (f / 32))) & 0x03;
          o[e] = (d * static_cast<float>(sc[e / 16])) * static_cast<float>((lo | (hi << 4)) - 32);
        }
      }
      return;
    case kGgufIq4Xs:  // 256 values: d fp16, high scale bits (uint16), 4 bytes of low scale nibbles, nibbles
      for (int64_t i = 0; i < k / 256; ++i, p += 136) {
        const float d = half_to_float(load<uint16_t>(p));
        const uint16_t sh = load<uint16_t>(p + 2);
        for (int sb = 0; sb < 8; ++sb) {
          const int lo = (p[4 + sb / 2] >> (4 * (sb % 2))) & 0x0F, hi = (sh >> (2 * sb)) & 0x03;
          const float dl = d * static_cast<float>((lo | (hi << 4)) - 32);
          const uint8_t* qs = p + 8 + 16 * sb;
          float* o = x + 256 * i + 32 * sb;
          for (int j = 0; j < 32; ++j) o[j] = dl * static_cast<float>(kIq4Values[(j < 16 ? qs[j] : qs[j - 16] >> 4) & 0x0F]);
        }
      }
      return;
    default: fail("gguf_row: ggml type ", type);
  }
}

struct GgufRows : FloatRows {
  const uint8_t* w;
  int64_t k, type, row_bytes;
  void row(int64_t r, float* x) const override { gguf_row(type, w + r * row_bytes, k, x); }
};

}  // namespace

int64_t gguf_block(int64_t type, int64_t& bytes) {
  switch (type) {
    case kGgufQ4_0: bytes = 18; return 32;
    case kGgufQ4_1: bytes = 20; return 32;
    case kGgufQ5_0: bytes = 22; return 32;
    case kGgufQ5_1: bytes = 24; return 32;
    case kGgufQ8_0: bytes = 34; return 32;
    case kGgufIq4Nl: bytes = 18; return 32;
    case kGgufQ4_K: bytes = 144; return 256;
    case kGgufQ5_K: bytes = 176; return 256;
    case kGgufQ6_K: bytes = 210; return 256;
    case kGgufIq4Xs: bytes = 136; return 256;
    default: bytes = 0; return 0;
  }
}

bool q4_0_codes(const int64_t* d, int64_t m, const uint8_t* src, int64_t src_len, std::vector<uint8_t>& codes,
                std::vector<float>& scales, std::vector<uint8_t>& zeros) {
  const int64_t n = d[kbN], k = d[kbK], blocks = k / 32;
  I4P_CHECK(k % 32 == 0 && d[kbD0] == n && d[kbD1] == blocks * 18, "requant_batch: module ", m, ": bad Q4_0 blocks");
  I4P_CHECK(d[kbWords] >= 0 && d[kbWords] <= src_len - n * d[kbD1], "requant_batch: module ", m,
            ": GGUF blocks outside the mapping");
  codes.resize(n * k);
  scales.resize(n * blocks);
  zeros.resize(n * blocks);
  bool negative = false;
  for (int64_t i = 0; i < n * blocks; ++i) {
    const uint8_t* b = src + d[kbWords] + i * 18;
    const uint16_t h = load<uint16_t>(b);
    const bool nan = (h & 0x7C00u) == 0x7C00u && (h & 0x03FFu);
    const bool neg = (h & 0x8000u) && (h & 0x7FFFu) && !nan;  // d < 0: not -0, not a NaN
    negative |= neg;
    const uint8_t flip = neg ? 15 : 0;
    scales[i] = half_to_float(static_cast<uint16_t>(h & 0x7FFFu));  // np.abs(d)
    zeros[i] = neg ? 7 : 8;
    uint8_t* c = codes.data() + i * 32;
    for (int j = 0; j < 16; ++j) {
      c[j] = static_cast<uint8_t>((b[2 + j] & 0x0F) ^ flip);  // 15 - q
      c[j + 16] = static_cast<uint8_t>((b[2 + j] >> 4) ^ flip);
    }
  }
  return negative;
}

std::unique_ptr<FloatRows> float_rows(const int64_t* d, int64_t m, const uint8_t* src, int64_t src_len) {
  const int64_t n = d[kbN], k = d[kbK], layout = d[kbLayout];
  auto inside = [&](int64_t off, int64_t bytes) { return off >= 0 && bytes >= 0 && off <= src_len - bytes; };
  if (layout == kSrcBf16 || layout == kSrcF16 || layout == kSrcF32) {
    I4P_CHECK(inside(d[kbWords], (layout == kSrcF32 ? 4 : 2) * n * k), "requant_batch: module ", m,
              ": weights outside the mapping");
    auto rows = std::make_unique<PlainRows>();
    rows->w = src + d[kbWords];
    rows->k = k;
    rows->layout = layout;
    return rows;
  }
  if (layout == kSrcE4m3 || layout == kSrcE2m1) {
    const bool e2m1 = layout == kSrcE2m1;
    I4P_CHECK(!e2m1 || k % 2 == 0, "requant_batch: module ", m, ": E2M1 pairs with K odd");
    I4P_CHECK(inside(d[kbWords], e2m1 ? n * k / 2 : n * k), "requant_batch: module ", m,
              ": weights outside the mapping");
    const int64_t bn = d[kbGidxGroup], bk = d[kbSrcGroup], cols = d[kbSrcGroups], t = d[kbScaleType];
    I4P_CHECK(bn > 0 && bk > 0 && cols == (k + bk - 1) / bk && t >= kScaleF32 && t <= kScaleE4m3,
              "requant_batch: module ", m, ": bad block scales");
    const int64_t brows = (n + bn - 1) / bn;
    I4P_CHECK(inside(d[kbScales], brows * cols * scale_bytes(t)), "requant_batch: module ", m,
              ": scales outside the mapping");
    auto rows = std::make_unique<BlockRows>();
    rows->w = src + d[kbWords];
    rows->k = k;
    rows->bn = bn;
    rows->bk = bk;
    rows->cols = cols;
    rows->e2m1 = e2m1;
    rows->sc.resize(brows * cols);
    for (int64_t i = 0; i < brows * cols; ++i) {
      const float v = scale_value(src + d[kbScales] + i * scale_bytes(t), t);
      if (!std::isfinite(v) || v < 0.0f) return nullptr;  // the reader refuses the module: it words why
      rows->sc[i] = v;
    }
    if (e2m1) {
      const uint32_t gbits = static_cast<uint32_t>(d[kbZerosBytes]);
      float gs;
      std::memcpy(&gs, &gbits, 4);
      if (d[kbZeroByte] == 1) {
        for (float& v : rows->sc) v = v / gs;
      } else if (d[kbZeroByte] == 2) {
        for (float& v : rows->sc) v = v * gs;
      }
      static const float kE2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
      for (int b = 0; b < 256; ++b) rows->lut[b] = kE2m1[b & 0x0F];
    } else {
      for (int b = 0; b < 256; ++b) rows->lut[b] = e4m3_value(static_cast<uint8_t>(b));  // a NaN byte: NaN
    }
    return rows;
  }
  if (layout == kSrcMlx) {
    const int64_t group = d[kbSrcGroup], bits = d[kbZeroByte], t = d[kbScaleType];
    I4P_CHECK((bits == 4 || bits == 8) && group > 0 && group % 8 == 0 && k % group == 0 &&
                  k / group <= MlxRows::kMlxMaxGroups && d[kbSrcGroups] == k / group && t >= kScaleF32 &&
                  t <= kScaleBf16,
              "requant_batch: module ", m, ": bad MLX layout");
    const int64_t sbytes = n * (k / group) * scale_bytes(t);
    I4P_CHECK(inside(d[kbWords], n * k * bits / 8) && inside(d[kbScales], sbytes) && inside(d[kbZeros], sbytes),
              "requant_batch: module ", m, ": MLX tensors outside the mapping");
    auto rows = std::make_unique<MlxRows>();
    rows->w = src + d[kbWords];
    rows->s = src + d[kbScales];
    rows->b = src + d[kbZeros];
    rows->k = k;
    rows->group = group;
    rows->type = t;
    rows->bits = static_cast<int>(bits);
    return rows;
  }
  I4P_CHECK(layout == kSrcGguf, "requant_batch: module ", m, ": layout ", layout);
  const int64_t type = d[kbScaleType];
  int64_t bytes = 0;
  const int64_t per = gguf_block(type, bytes);
  I4P_CHECK(per > 0 && type != kGgufQ4_0 && k % per == 0 && d[kbD0] == n && d[kbD1] == k / per * bytes,
            "requant_batch: module ", m, ": bad GGUF blocks");
  I4P_CHECK(inside(d[kbWords], n * d[kbD1]), "requant_batch: module ", m, ": GGUF blocks outside the mapping");
  auto rows = std::make_unique<GgufRows>();
  rows->w = src + d[kbWords];
  rows->k = k;
  rows->type = type;
  rows->row_bytes = d[kbD1];
  return rows;
}

}  // namespace i4p
