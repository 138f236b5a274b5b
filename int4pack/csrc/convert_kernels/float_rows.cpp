// The rows of a float source as float32, decoded one row at a time inside the requant job (JobArgs::rows):
// bf16 / f16 / f32 weights, e4m3 and E2M1 times their block scales (FP8, MXFP4, NVFP4), MLX affine
// words with their scales and biases, GGUF's quantised blocks. Each decodes exactly as the per-module
// reader does (float_source.FloatReader, fp8.block_dequant, fp4._fp4_weights, mlx_checkpoint.dequantize,
// gguf.quants.dequantize): the same float32 operations in the same order, so a row is the same bits
// either way. A row decoded in the job stays in cache, where a whole decoded tensor (6 MB for an
// expert of Qwen3-30B-A3B) went through memory twice.

#include "convert_kernels.h"

namespace i4p {

namespace {

inline float from_bits(uint32_t u) {
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}
inline uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// IEEE binary16 -> float32, exactly, in integer steps and masks the compiler vectorises: the exponent
// rebiased, a subnormal's mantissa times 2^-24 (exact), Inf and NaN with their mantissa bits
inline float half_float(uint32_t h) {
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  const uint32_t sub = 0u - static_cast<uint32_t>(e == 0u), top = 0u - static_cast<uint32_t>(e == 31u);
  uint32_t bits = (((e + 112u) << 23) | (m << 13)) & ~sub;
  bits |= to_bits(static_cast<float>(static_cast<int32_t>(m)) * 0x1p-24f) & sub;
  bits = (bits & ~top) | ((0x7F800000u | (m << 13)) & top);
  return from_bits(bits | ((h & 0x8000u) << 16));
}

}  // namespace

float half_to_float(uint16_t h) { return half_float(h); }

namespace {

// The two minifloats' values, exactly, in integer steps and masks the compiler vectorises (a table
// lookup or a float operation under a condition keeps a loop scalar, and random bytes mispredict it).
// e4m3 (sign, 4 exponent bits of bias 7, 3 mantissa bits): 2^(e - 7) (1 + m / 8); m 2^-9 where e = 0,
// taken as e = 1 less 2^-6, exactly; NaN at 0x7F and 0xFF (its sign aside: a NaN weight or scale
// hands the module back, whatever its bits)
inline float e4m3_float(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  const uint32_t sub = 0u - static_cast<uint32_t>(e == 0u), nan = 0u - static_cast<uint32_t>((b & 0x7Fu) == 0x7Fu);
  const float nrm = from_bits(((e + (sub & 1u) + 120u) << 23) | (m << 20));
  uint32_t bits = (to_bits(nrm) & ~sub) | (to_bits(nrm - 0x1p-6f) & sub);
  bits = (bits & ~nan) | (0x7FC00000u & nan);
  return from_bits(bits | ((b & 0x80u) << 24));
}

// E2M1 (sign, 2 exponent bits of bias 1, 1 mantissa bit): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
inline float e2m1_float(uint32_t n) {
  const uint32_t e = (n >> 1) & 3u, m = n & 1u;
  const uint32_t sub = 0u - static_cast<uint32_t>(e == 0u);
  const uint32_t bits = ((((e + 126u) << 23) | (m << 22)) & ~sub) | (m * 0x3F000000u & sub);
  return from_bits(bits | ((n & 8u) << 28));
}

// count scales of a type (ScaleType, MiniScaleType) as float32, as the readers decode them
// (formats/minifloat.py, fp8._scale_f32, mlx_checkpoint._float): E8M0 is 2^(e - 127) (e = 0: 2^-127), NaN at 255
I4P_CLONES void scales_float(const uint8_t* p, int64_t count, int64_t type, float* out) {
  switch (type) {
    case kScaleF32: std::memcpy(out, p, count * 4); return;
    case kScaleF16:
      for (int64_t i = 0; i < count; ++i) out[i] = half_float(load<uint16_t>(p + 2 * i));
      return;
    case kScaleBf16:
      for (int64_t i = 0; i < count; ++i) out[i] = from_bits(static_cast<uint32_t>(load<uint16_t>(p + 2 * i)) << 16);
      return;
    case kScaleE8m0:
      for (int64_t i = 0; i < count; ++i) {
        const uint32_t e = p[i], zero = 0u - static_cast<uint32_t>(e == 0u), nan = 0u - static_cast<uint32_t>(e == 255u);
        const uint32_t bits = ((e << 23) & ~zero) | (0x00400000u & zero);
        out[i] = from_bits((bits & ~nan) | (0x7FC00000u & nan));
      }
      return;
    default:
      for (int64_t i = 0; i < count; ++i) out[i] = e4m3_float(p[i]);
      return;
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

I4P_CLONES void f16_row(const uint8_t* p, int64_t k, float* x) {
  for (int64_t c = 0; c < k; ++c) x[c] = half_float(load<uint16_t>(p + 2 * c));
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
      f16_row(w + r * k * 2, k, x);
    }
  }
};

// ------------------------------------------------------------------------------ e4m3, E2M1 blocks

// a row of e4m3 bytes (E2M1 pairs, low nibble first), each value times its block's scale srow[c / bk]:
// the values first, in one loop (a block of 16 values is too short a loop to vectorise), then the scales
I4P_CLONES void minifloat_row(const uint8_t* b, int64_t k, int64_t bk, const float* srow, bool e2m1, float* x) {
  if (e2m1) {
    for (int64_t c = 0; c < k / 2; ++c) {
      x[2 * c] = e2m1_float(b[c] & 0x0Fu);
      x[2 * c + 1] = e2m1_float(b[c] >> 4);
    }
  } else {
    for (int64_t c = 0; c < k; ++c) x[c] = e4m3_float(b[c]);
  }
  for (int64_t c0 = 0, j = 0; c0 < k; c0 += bk, ++j) {
    const int64_t c1 = std::min(k, c0 + bk);
    const float s = srow[j];
    for (int64_t c = c0; c < c1; ++c) x[c] = x[c] * s;
  }
}

// (fp8.block_dequant: the e4m3 value times its block's scale; fp4._fp4_weights: the block scales
// divided or multiplied by the global one first, then each code's value times its block's scale)
struct BlockRows : FloatRows {
  const uint8_t* w;
  int64_t k, bn, bk, cols;
  bool e2m1;
  std::vector<float> sc;  // [ceil(N / bn), cols]
  void row(int64_t r, float* x) const override {
    const float* srow = sc.data() + (r / bn) * cols;
    if (e2m1 && bk % 2) {  // a pair across two blocks
      const uint8_t* b = w + r * (k / 2);
      for (int64_t c = 0; c < k; c += 2) {
        x[c] = e2m1_float(b[c / 2] & 0x0Fu) * srow[c / bk];
        x[c + 1] = e2m1_float(b[c / 2] >> 4) * srow[(c + 1) / bk];
      }
      return;
    }
    minifloat_row(w + r * (e2m1 ? k / 2 : k), k, bk, srow, e2m1, x);
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
    scales_float(s + r * groups * item, groups, type, sv);
    scales_float(b + r * groups * item, groups, type, bv);
    mlx_row(w + r * (k * bits / 8), sv, bv, k, group, bits, x);
  }
  static constexpr int64_t kMlxMaxGroups = 1 << 12;
};

// ------------------------------------------------------------------------------ GGUF blocks

// gguf.quants.<type>.dequantize_blocks, block by block: the float32 operations of its numpy
// expressions, in their order (d * q, (d * q) + m, (d * sc) * q - dmin * m, ...)
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  // E2M1 doubled

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

// the 32 values of a block of 16 bytes of nibbles (element j < 16: low nibble of byte j, else the high
// nibble of byte j - 16) as f(nibble, j)
template <class F>
I4P_INLINE void nibbles32(const uint8_t* qs, float* o, const F& f) {
  for (int j = 0; j < 16; ++j) o[j] = f(qs[j] & 0x0F, j);
  for (int j = 0; j < 16; ++j) o[16 + j] = f(qs[j] >> 4, 16 + j);
}

I4P_CLONES void gguf_row(int64_t type, const uint8_t* p, int64_t k, float* x) {
  switch (type) {
    case kGgufQ4_1:  // d, m fp16, 16 bytes of nibbles: (d * q) + m
      for (int64_t i = 0; i < k / 32; ++i, p += 20) {
        const float d = half_to_float(load<uint16_t>(p)), m = half_to_float(load<uint16_t>(p + 2));
        nibbles32(p + 4, x + 32 * i, [&](int q, int) I4P_LAMBDA_INLINE { return d * static_cast<float>(q) + m; });
      }
      return;
    case kGgufQ5_0:  // d fp16, the 5th bits (uint32), nibbles: d * (q - 16)
    case kGgufQ5_1: {  // d, m fp16, the 5th bits, nibbles: (d * q) + m
      const bool min = type == kGgufQ5_1;
      const int64_t bytes = min ? 24 : 22;
      for (int64_t i = 0; i < k / 32; ++i, p += bytes) {
        const float d = half_to_float(load<uint16_t>(p)), m = min ? half_to_float(load<uint16_t>(p + 2)) : 0.0f;
        const uint32_t qh = load<uint32_t>(p + (min ? 4 : 2));
        auto q5 = [&](int q, int j) I4P_LAMBDA_INLINE { return q | static_cast<int>(((qh >> j) & 1u) << 4); };
        if (min) {
          nibbles32(p + 8, x + 32 * i,
                    [&](int q, int j) I4P_LAMBDA_INLINE { return d * static_cast<float>(q5(q, j)) + m; });
        } else {
          nibbles32(p + 6, x + 32 * i,
                    [&](int q, int j) I4P_LAMBDA_INLINE { return d * static_cast<float>(q5(q, j) - 16); });
        }
      }
      return;
    }
    case kGgufIq4Nl:  // d fp16, nibbles indexing the IQ4 values: d * value
      for (int64_t i = 0; i < k / 32; ++i, p += 18) {
        const float d = half_to_float(load<uint16_t>(p));
        nibbles32(p + 2, x + 32 * i,
                  [&](int q, int) I4P_LAMBDA_INLINE { return d * static_cast<float>(kIq4Values[q]); });
      }
      return;
    case kGgufQ8_0:  // d fp16, 32 int8: q * d
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
          const int shift = 4 * (sb % 2);
          float* o = x + 256 * i + 32 * sb;
          if (q5) {
            for (int j = 0; j < 32; ++j)
              o[j] = dl * static_cast<float>(((b[j] >> shift) & 0x0F) | (((qh[j] >> sb) & 1) << 4)) - ml;
          } else {
            for (int j = 0; j < 32; ++j) o[j] = dl * static_cast<float>((b[j] >> shift) & 0x0F) - ml;
          }
        }
      }
      return;
    }
    case kGgufQ6_K:  // 256 values: 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d fp16
      for (int64_t i = 0; i < k / 256; ++i, p += 210) {
        const float d = half_to_float(load<uint16_t>(p + 208));
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
        for (int h = 0; h < 2; ++h) {
          for (int c = 0; c < 4; ++c) {  // values 128 h + 32 c + j: nibble c / 2 of byte 64 h + 32 (c % 2) + j,
            const uint8_t* lo = p + 64 * h + 32 * (c % 2);  // bits 2c of byte 128 + 32 h + j
            const uint8_t* hi = p + 128 + 32 * h;
            const int ls = 4 * (c / 2), hs = 2 * c;
            float* o = x + 256 * i + 128 * h + 32 * c;
            for (int half = 0; half < 2; ++half) {  // 16 values a scale
              const float dl = d * static_cast<float>(sc[8 * h + 2 * c + half]);
              for (int j = 16 * half; j < 16 * half + 16; ++j)
                o[j] = dl * static_cast<float>((((lo[j] >> ls) & 0x0F) | (((hi[j] >> hs) & 0x03) << 4)) - 32);
            }
          }
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
          nibbles32(p + 8 + 16 * sb, x + 256 * i + 32 * sb,
                    [&](int q, int) I4P_LAMBDA_INLINE { return dl * static_cast<float>(kIq4Values[q]); });
        }
      }
      return;
    case kGgufMxfp4:  // E8M0 byte e, nibbles indexing E2M1 doubled: (2^(e - 128), subnormal for e < 2) * value
      for (int64_t i = 0; i < k / 32; ++i, p += 17) {
        const uint32_t e = p[0];
        const float d = from_bits(e < 2u ? 0x00200000u << e : (e - 1u) << 23);  // gguf's e8m0_to_fp32_half
        nibbles32(p + 1, x + 32 * i,
                  [&](int q, int) I4P_LAMBDA_INLINE { return d * static_cast<float>(kMxfp4Values[q]); });
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
    case kGgufMxfp4: bytes = 17; return 32;
    default: bytes = 0; return 0;
  }
}

bool q4_0_codes(const int64_t* d, int64_t m, const uint8_t* src, int64_t src_len, std::vector<uint8_t>& codes,
                std::vector<float>& scales, std::vector<uint8_t>& zeros) {
  const int64_t n = d[kbN], k = d[kbK], blocks = k / 32;
  I4P_CHECK(k % 32 == 0 && d[kbD0] == n && d[kbD1] == blocks * 18, "requant_batch: module ", m, ": bad Q4_0 blocks");
  I4P_CHECK(in_range(d[kbWords], n * d[kbD1], src_len), "requant_batch: module ", m, ": GGUF blocks outside the mapping");
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
  auto inside = [&](int64_t off, int64_t bytes) { return in_range(off, bytes, src_len); };
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
    scales_float(src + d[kbScales], brows * cols, t, rows->sc.data());
    bool ok = true;
    for (const float v : rows->sc) ok &= v >= 0.0f && v <= std::numeric_limits<float>::max();  // false for a NaN
    if (!ok) return nullptr;  // the reader refuses the module: it words why
    if (e2m1) {
      const uint32_t gbits = static_cast<uint32_t>(d[kbZerosBytes]);
      float gs;
      std::memcpy(&gs, &gbits, 4);
      if (d[kbZeroByte] == 1) {
        for (float& v : rows->sc) v = v / gs;
      } else if (d[kbZeroByte] == 2) {
        for (float& v : rows->sc) v = v * gs;
      }
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
