// Reading KleidiAI W4A8 RHS blobs back (the inverse of kleidiai_pack.cpp, from the same layout in
// docs/kleidiai.md §1.5), with the consistency checks of kleidiai.unpack; and the verify-side
// helpers that walk whole weight matrices: the range of int8 values, q * scale in float32, and
// torch's float32 reference layout of _dyn_quant_pack_4bit_weight (what its x86 matmul takes).
//
// Work unit = one 8-row block; every block is decoded and checked from its own bytes alone, so
// the split over threads changes nothing.

#include "../common.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

namespace i4p {
namespace {

constexpr int64_t kNr = 8;

inline int64_t roundup(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

inline float get_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float bf16_to_f32(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &wide, 4);
  return v;
}

// One 32-value chunk of all 8 rows of a block: 128 bytes, segment s of row r the 8 bytes at
// 64 s + 8 r -> row r's values at rowp[r] + off .. + 32; seg[r][s] gets the sum of the 16 values
// of segment s of row r. Two rows per 16-byte vector: (n & 15) ^ 8 is q + 8, minus 8 is q.
inline void get_chunk8(const uint8_t* src, int8_t* const* rowp, int64_t off, int32_t seg[][2]) {
  typedef uint8_t u8x16 __attribute__((vector_size(16)));
  constexpr uint64_t kOnes = 0x0101010101010101ULL;
  for (int s = 0; s < 2; ++s) {
    for (int j = 0; j < 4; ++j) {
      u8x16 v;
      std::memcpy(&v, src + 64 * s + 16 * j, 16);
      const u8x16 a = (v & 15) ^ 8, b = ((v >> 4) & 15) ^ 8;
      const u8x16 qa = a - 8, qb = b - 8, t = a + b;
      const uint8_t* pa = reinterpret_cast<const uint8_t*>(&qa);
      const uint8_t* pb = reinterpret_cast<const uint8_t*>(&qb);
      for (int h = 0; h < 2; ++h) {
        int8_t* d = rowp[2 * j + h] + off + 8 * s;
        std::memcpy(d, pa + 8 * h, 8);
        std::memcpy(d + 16, pb + 8 * h, 8);
        uint64_t w;
        std::memcpy(&w, reinterpret_cast<const uint8_t*>(&t) + 8 * h, 8);
        // 16 values of q + 8 sum to <= 240: one byte holds what the multiply gathers into the top byte
        seg[2 * j + h][s] = static_cast<int32_t>((w * kOnes) >> 56) - 128;
      }
    }
  }
}

}  // namespace

// The failed checks, as bits; kleidiai.unpack names the first in this order.
enum : int {
  kBadKPad = 1,      // channelwise: K padding is not zero
  kBadSums = 2,      // row sums disagree with the data (and scales)
  kBadPadData = 4,   // padding rows do not repeat row N-1 (data)
  kBadPadScale = 8,  // ... (scales)
  kBadPadBias = 16,  // ... (bias)
  kBadBias = 32,     // a bias is stored but has_bias is false
};

// blob: uint8 [bytes]; q: int8 [N, K]; scales: bf16 bits [N, K/g] (groupwise) or fp32 [N] (channel,
// g == K, the stored scale times 16); bias: fp32 [N] or null (not decoded). Returns the failed
// checks (0: consistent; always 0 without `check`).
int64_t kleidiai_unpack(const uint8_t* blob, int64_t bytes, int64_t N, int64_t K, int64_t g, bool check,
                        bool has_bias, int8_t* q, void* scales, float* bias, int64_t threads) {
  I4P_CHECK(N >= 1 && K >= 2 && K % 2 == 0, "bad shape");
  const bool channel = g == K;
  const int64_t nb = roundup(N, kNr) / kNr;
  const int64_t kp = channel ? roundup(K, 32) : K;
  const int64_t per_blk = channel ? kNr * (kp / 2 + 12) : kNr * (K / 2 + 2 * (K / g) + 8);
  if (!channel) I4P_CHECK(g > 0 && g % 32 == 0 && K % g == 0, "group size");
  I4P_CHECK(bytes == nb * per_blk, "blob has the wrong size");
  const int64_t nblk = channel ? 1 : K / g;
  std::atomic<int> bad{0};
  for_rows(nb, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, K)), threads, [&](int64_t b0, int64_t b1) {
    std::vector<int8_t> vals(kNr * kp);  // the block's 8 rows, padding rows and K padding included
    std::vector<uint16_t> sc16(kNr * nblk);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const uint8_t* src = blob + blk * per_blk;
      int flags = 0;
      float fsc[kNr], fbias[kNr];
      const int64_t row0 = blk * kNr;
      const int rows = static_cast<int>(std::min<int64_t>(kNr, N - row0));
      // each row's values straight into q (no copy after), but for padding rows and K padding
      int8_t* rowp[kNr];
      for (int r = 0; r < kNr; ++r) rowp[r] = r < rows && kp == K ? q + (row0 + r) * K : vals.data() + r * kp;
      if (channel) {
        int32_t rsum[kNr] = {0};
        for (int64_t c = 0; c < kp / 32; ++c) {
          int32_t seg[kNr][2];
          get_chunk8(src + c * 2 * kNr * 8, rowp, 32 * c, seg);
          for (int r = 0; r < kNr; ++r) rsum[r] += seg[r][0] + seg[r][1];
        }
        const uint8_t* tail = src + kp / 2 * kNr;
        for (int r = 0; r < kNr; ++r) {
          fsc[r] = get_f32(tail + 32 + 4 * r) * 16.0f;
          fbias[r] = get_f32(tail + 64 + 4 * r);
        }
        if (check) {
          for (int r = 0; r < kNr; ++r) {
            const int32_t sum = rsum[r];
            for (int64_t i = K; i < kp; ++i) flags |= rowp[r][i] != 0 ? kBadKPad : 0;
            int32_t stored;
            std::memcpy(&stored, tail + 4 * r, 4);
            if (stored != sum * 16) flags |= kBadSums;
          }
        }
      } else {
        const int64_t dlen = g / 2 * kNr;
        float sums[kNr] = {0};
        for (int64_t b = 0; b < nblk; ++b) {
          const uint8_t* d = src + b * (dlen + 2 * kNr);
          for (int r = 0; r < kNr; ++r) std::memcpy(&sc16[r * nblk + b], d + dlen + 2 * r, 2);
          float sc[kNr];
          for (int r = 0; r < kNr; ++r) sc[r] = bf16_to_f32(sc16[r * nblk + b]);
          for (int64_t c = 0; c < g / 32; ++c) {
            int32_t seg[kNr][2];
            get_chunk8(d + c * 2 * kNr * 8, rowp, b * g + 32 * c, seg);
            if (check) {
              // the packer's rounding: one float add per 16-value segment, in storage order
              for (int h = 0; h < 2; ++h)
                for (int r = 0; r < kNr; ++r) sums[r] += static_cast<float>(seg[r][h]) * sc[r];
            }
          }
        }
        const uint8_t* tail = src + nblk * (dlen + 2 * kNr);
        for (int r = 0; r < kNr; ++r) {
          fbias[r] = get_f32(tail + 32 + 4 * r);
          if (check) {
            const float stored = get_f32(tail + 4 * r);
            // bit equality, as torch.equal of the float tensors (NaN never agrees)
            if (!(stored == sums[r])) flags |= kBadSums;
          }
        }
      }
      if (check) {
        for (int r = rows; r < kNr; ++r) {  // rows past N repeat row N-1
          if (std::memcmp(rowp[r], rowp[rows - 1], K) != 0) flags |= kBadPadData;
          if (channel) {
            flags |= fsc[r] == fsc[rows - 1] ? 0 : kBadPadScale;
          } else {
            for (int64_t b = 0; b < nblk; ++b)  // value equality, as torch.equal
              flags |= bf16_to_f32(sc16[r * nblk + b]) == bf16_to_f32(sc16[(rows - 1) * nblk + b]) ? 0 : kBadPadScale;
          }
          if (!(fbias[r] == fbias[rows - 1])) flags |= kBadPadBias;
        }
        if (!has_bias)
          for (int r = 0; r < kNr; ++r) flags |= fbias[r] == 0.0f ? 0 : kBadBias;
      }
      for (int r = 0; r < rows; ++r) {
        if (rowp[r] != q + (row0 + r) * K) std::memcpy(q + (row0 + r) * K, rowp[r], K);
        if (channel) static_cast<float*>(scales)[row0 + r] = fsc[r];
        else std::memcpy(static_cast<uint16_t*>(scales) + (row0 + r) * nblk, &sc16[r * nblk], 2 * nblk);
        if (bias) bias[row0 + r] = fbias[r];
      }
      if (flags) bad.fetch_or(flags);
    }
  });
  return bad.load();
}

// float32 [N, K] = float(q) * float(scale of its group), the product torch computes (no FMA)
void dequant_w4a8(const int8_t* q, int64_t N, int64_t K, int64_t g, const void* scales, bool bf16, float* out,
                  int64_t threads) {
  I4P_CHECK(g > 0 && K % g == 0, "dequant: group ", g, " does not divide K=", K);
  const int64_t ng = K / g;
  for_rows(N, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, K)), threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t j = 0; j < ng; ++j) {
        const float s = bf16 ? bf16_to_f32(static_cast<const uint16_t*>(scales)[r * ng + j])
                             : static_cast<const float*>(scales)[r * ng + j];
        const int8_t* a = q + r * K + j * g;
        float* o = out + r * K + j * g;
        for (int64_t i = 0; i < g; ++i) o[i] = static_cast<float>(a[i]) * s;
      }
    }
  });
}

// torch's float32 reference layout of _dyn_quant_pack_4bit_weight (docs/kleidiai.md §1.6): the
// N*K/2 bytes (q_even + 8) | (q_odd + 8) << 4 as floats, then the scales as floats
void ref_pack(const int8_t* q, int64_t N, int64_t K, const void* scales, bool bf16, int64_t nscales, float* out,
              int64_t threads) {
  I4P_CHECK(K % 2 == 0, "ref_pack: odd K");
  for_rows(N, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, K)), threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* a = q + r * K;
      float* o = out + r * (K / 2);
      for (int64_t i = 0; i < K / 2; ++i)
        o[i] = static_cast<float>(((a[2 * i] + 8) & 0xF) | (((a[2 * i + 1] + 8) & 0xF) << 4));
    }
  });
  float* s = out + N * (K / 2);
  for (int64_t i = 0; i < nscales; ++i)
    s[i] = bf16 ? bf16_to_f32(static_cast<const uint16_t*>(scales)[i]) : static_cast<const float*>(scales)[i];
}

}  // namespace i4p

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// an AVX2 build next to the baseline one, picked at load time (no FMA: -ffp-contract=off)
#define I4P_VCLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define I4P_VCLONES
#endif

namespace i4p {

namespace {
void span_range_portable(const int8_t* p, int64_t a, int64_t b, int8_t* lo, int8_t* hi) {
  int8_t l = p[a], h = p[a];
  for (int64_t i = a; i < b; ++i) {
    l = std::min(l, p[i]);
    h = std::max(h, p[i]);
  }
  *lo = l;
  *hi = h;
}

#if defined(__GNUC__) && defined(__x86_64__)
// SSE2 has no signed byte min/max: the baseline loop runs at a quarter of this one's pace
__attribute__((target("avx2"))) void span_range_avx2(const int8_t* p, int64_t a, int64_t b, int8_t* lo, int8_t* hi) {
  __m256i l0 = _mm256_set1_epi8(p[a]), l1 = l0, h0 = l0, h1 = l0;
  int64_t i = a;
  for (; i + 64 <= b; i += 64) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32));
    l0 = _mm256_min_epi8(l0, v0);
    h0 = _mm256_max_epi8(h0, v0);
    l1 = _mm256_min_epi8(l1, v1);
    h1 = _mm256_max_epi8(h1, v1);
  }
  alignas(32) int8_t lv[32], hv[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lv), _mm256_min_epi8(l0, l1));
  _mm256_store_si256(reinterpret_cast<__m256i*>(hv), _mm256_max_epi8(h0, h1));
  int8_t l = *std::min_element(lv, lv + 32), h = *std::max_element(hv, hv + 32);
  if (i < b) {
    int8_t tl, th;
    span_range_portable(p, i, b, &tl, &th);
    l = std::min(l, tl);
    h = std::max(h, th);
  }
  *lo = l;
  *hi = h;
}

const bool g_range_avx2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0;
}();
#endif

// smallest and largest of p[a, b), b > a
void int8_span_range(const int8_t* p, int64_t a, int64_t b, int8_t* lo, int8_t* hi) {
#if defined(__GNUC__) && defined(__x86_64__)
  if (g_range_avx2) return span_range_avx2(p, a, b, lo, hi);
#endif
  span_range_portable(p, a, b, lo, hi);
}
}  // namespace

// smallest and largest of n int8 values (0, 0 for none)
void int8_range(const int8_t* p, int64_t n, int64_t threads, int64_t* lo_hi) {
  std::atomic<int> lo{0}, hi{0};
  if (n > 0) lo = hi = p[0];
  for_rows(n, 1 << 20, threads, [&](int64_t a, int64_t b) {
    int8_t l, h;
    int8_span_range(p, a, b, &l, &h);
    int cur = lo.load();
    while (l < cur && !lo.compare_exchange_weak(cur, l)) {
    }
    cur = hi.load();
    while (h > cur && !hi.compare_exchange_weak(cur, h)) {
    }
  });
  lo_hi[0] = lo.load();
  lo_hi[1] = hi.load();
}

}  // namespace i4p

namespace i4p {

void kleidiai_pack(const int8_t* q, int64_t E, int64_t N, int64_t K, const void* scales, bool scales_bf16,
                   const float* bias, int64_t group_size, uint8_t* out, int64_t bytes, int64_t threads);

uint32_t crc32_extend(uint32_t crc, const uint8_t* p, int64_t n);  // zlib's CRC-32 (convert_kernels/crc32.cpp)

// verify's check of one stored blob in one call: crcs[0] = the CRC-32 of its bytes; decode it with
// every consistency check into q, scales and bias (bias always decoded: [N] fp32, the caller's
// scratch); then crcs[1..3] = the CRC-32s of q, scales and bias (bias: only with has_bias), the
// decoded values packed again into `repack` (the caller's scratch, `bytes` long) and compared byte
// for byte. Returns the failed decode checks (kleidiai_unpack's bits; the rest is skipped then, as
// kleidiai.unpack raising stops it in Python), or kBadRepack when they pass but the bytes differ.
int64_t kleidiai_verify_blob(const uint8_t* blob, int64_t bytes, int64_t N, int64_t K, int64_t g, bool has_bias,
                             int8_t* q, void* scales, float* bias, uint8_t* repack, uint32_t* crcs,
                             int64_t threads) {
  constexpr int64_t kBadRepack = 64;
  crcs[0] = crc32_extend(0, blob, bytes);
  const int64_t bad = kleidiai_unpack(blob, bytes, N, K, g, true, has_bias, q, scales, bias, threads);
  if (bad) return bad;
  const int64_t scale_bytes = g == K ? 4 * N : 2 * N * (K / g);
  crcs[1] = crc32_extend(0, reinterpret_cast<const uint8_t*>(q), N * K);
  crcs[2] = crc32_extend(0, static_cast<const uint8_t*>(scales), scale_bytes);
  crcs[3] = has_bias ? crc32_extend(0, reinterpret_cast<const uint8_t*>(bias), 4 * N) : 0;
  kleidiai_pack(q, 1, N, K, scales, g != K, has_bias ? bias : nullptr, g, repack, bytes, threads);
  return std::memcmp(repack, blob, static_cast<size_t>(bytes)) == 0 ? 0 : kBadRepack;
}

// helpers of the I4P_VCLONES functions below, forced inline so that each build vectorises them
// row r of dequant_w4a8(q, scales) [N, K] into o [K]: float(q) * its group's scale
__attribute__((always_inline)) inline void dequant_row(const int8_t* q, int64_t K, int64_t r, int64_t g, int64_t ng,
                                                       const void* scales, bool bf16, float* o) {
  for (int64_t j = 0; j < ng; ++j) {
    const float s = bf16 ? bf16_to_f32(static_cast<const uint16_t*>(scales)[r * ng + j])
                         : static_cast<const float*>(scales)[r * ng + j];
    const int8_t* a = q + r * K + j * g;
    for (int64_t i = 0; i < g; ++i) o[j * g + i] = static_cast<float>(a[i]) * s;
  }
}

// sum_k a[k] * b[k] in 16 float lanes, added pairwise at the end (one fixed order: the same bits
// for the squared sums wherever they are made)
__attribute__((always_inline)) inline float dot16(const float* a, const float* b, int64_t K) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= K; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * b[i + l];
  for (; i < K; ++i) acc[0] += a[i] * b[i];
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// out = dequant_w4a8's float32 [N, K] (the same products), and on the way, where not null,
// row_sq[r] = sum_k out[r, k]^2 and col_sq[k] = sum_r out[r, k]^2 (float sums, as torch's
// (w * w).sum(dim) of the float weights): the squared-weight sums verify's error prediction needs,
// without a squared matrix. One thread: verify runs one expert per thread.
I4P_VCLONES void dequant_sq(const int8_t* q, int64_t N, int64_t K, int64_t g, const void* scales, bool bf16,
                            float* out, float* row_sq, float* col_sq) {
  I4P_CHECK(g > 0 && K % g == 0, "dequant_sq: group ", g, " does not divide K=", K);
  const int64_t ng = K / g;
  if (col_sq) std::fill(col_sq, col_sq + K, 0.0f);
  for (int64_t r = 0; r < N; ++r) {
    float* o = out + r * K;
    dequant_row(q, K, r, g, ng, scales, bf16, o);
    if (row_sq) row_sq[r] = dot16(o, o, K);
    if (col_sq)
      for (int64_t i = 0; i < K; ++i) col_sq[i] += o[i] * o[i];
  }
}

}  // namespace i4p

namespace i4p {

// verify's float32 reference of one weight matrix without its float32 copy: y [M, N] = x [M, K] @ W^T
// for W = dequant_w4a8(q, scales) (the same products: float(q) * scale), each row of W made in a
// buffer of K floats and dropped; its sum over k in 16 lanes added pairwise at the end. On the way,
// where not null, row_sq [N] and col_sq [K] as dequant_sq makes them (the same sums, the same
// order), and group_sq [N, K/g]: each group's sum of q^2 (exact: at most 64 g). Reading the int8 values
// instead of writing and reading back 4 bytes per weight is what makes it faster than dequant_sq and
// a float matmul. One thread.
I4P_VCLONES void w4a8_reference(const float* x, int64_t M, int64_t K, const int8_t* q, int64_t N, int64_t g,
                                const void* scales, bool bf16, float* y, float* row_sq, float* col_sq,
                                float* group_sq) {
  I4P_CHECK(g > 0 && K % g == 0, "w4a8_reference: group ", g, " does not divide K=", K);
  const int64_t ng = K / g;
  std::vector<float> w(K);
  float* o = w.data();
  if (col_sq) std::fill(col_sq, col_sq + K, 0.0f);
  for (int64_t r = 0; r < N; ++r) {
    dequant_row(q, K, r, g, ng, scales, bf16, o);
    if (row_sq) row_sq[r] = dot16(o, o, K);
    if (col_sq)
      for (int64_t i = 0; i < K; ++i) col_sq[i] += o[i] * o[i];
    for (int64_t m = 0; m < M; ++m) y[m * N + r] = dot16(x + m * K, o, K);
    if (group_sq)
      for (int64_t j = 0; j < ng; ++j) {
        const int8_t* a = q + r * K + j * g;
        int32_t acc = 0;
        for (int64_t i = 0; i < g; ++i) acc += a[i] * a[i];
        group_sq[r * ng + j] = static_cast<float>(acc);
      }
  }
}

}  // namespace i4p
