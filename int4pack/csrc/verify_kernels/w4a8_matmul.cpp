// torch's reference W4A8 matmul (_dyn_quant_matmul_4bit where torch has no KleidiAI: x86-64), the
// same arithmetic, from int4 values and scales instead of torch's float32 buffer, vectorised.
//
// torch's algorithm (aten/src/ATen/native/cpu/int4mm_kernel.cpp, the ref_dyn_quant_matmul_4bit
// channelwise and groupwise kernels; docs/kleidiai.md §2.3-2.4):
// * each input row is quantised to asymmetric int8: rmin = min(0, min x), rmax = max(0, max x),
//   scale = 255 / (rmax - rmin) (1 when equal), the zero point from the side with the smaller error,
//   clamped to [-128, 127] and rounded half to even; q = clamp(round_half_away(x * scale) + zp);
// * per output n and block b of the row, an exact integer sum iacc = sum_k (q_k - zp) (w_k - 8),
//   w_k the weight's nibble (q + 8) & 15;
// * groupwise: acc = 0; acc += float(iacc_b) * s_b block after block (no FMA); y = acc * (1 / scale);
//   channelwise: y = (float(iacc) * s) * (1 / scale); then y clamped to [-FLT_MAX, FLT_MAX].
// The integer sums are exact in any order (int32, wrapping as torch's), so only the float steps
// above fix the result, and they are done here as torch does them: the output is the same bits.
//
// The integer sum is split so that bytes multiply bytes (AVX2 maddubs, 32 products an instruction):
// sum (q - zp)(w - 8) = sum q w - 8 sum q - zp (sum w - 8 len), with w = (q + 8) & 15 in [0, 15]
// unsigned and q signed int8; sum q per block is made once per input row, sum w once per weight row.

#include "../common.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define I4P_MM_AVX2 1
#endif

namespace i4p {
namespace {

// One input row as torch quantises it: the int8 values, the zero point and 1 / scale. torch's two
// kernels add the zero point's two error terms in different orders; `channel` picks the one.
void quantize_row(const float* x, int64_t K, bool channel, int8_t* q, int32_t* zp_out, float* recip_out) {
  float max0 = -FLT_MAX, min0 = FLT_MAX;
  for (int64_t k = 0; k < K; ++k) {
    max0 = std::max(x[k], max0);
    min0 = std::min(x[k], min0);
  }
  const float qmin = -128.0f, qmax = 127.0f;
  const float rmin0 = std::min(0.0f, min0), rmax0 = std::max(0.0f, max0);
  const float scale0 = rmin0 == rmax0 ? 1.f : (qmax - qmin) / (rmax0 - rmin0);
  const float recip = scale0 ? 1.0f / scale0 : 0.0f;
  const float dmin = rmin0 * scale0, dmax = rmax0 * scale0;
  const bool from_min = channel ? (qmin + dmin) + (qmax + dmax) > 0 : qmin + dmin + qmax + dmax > 0;
  float zp = from_min ? qmin - dmin : qmax - dmax;
  zp = std::min(std::max(zp, qmin), qmax);
  const int32_t zpi = static_cast<int32_t>(std::lrintf(zp));
  for (int64_t k = 0; k < K; ++k) {
    int32_t v = static_cast<int32_t>(std::round(x[k] * scale0)) + zpi;
    v = std::max(std::min(v, int32_t{127}), int32_t{-128});
    q[k] = static_cast<int8_t>(v);
  }
  *zp_out = zpi;
  *recip_out = recip;
}

struct Rows {  // the quantised input rows
  int64_t M, K, bl, nb;
  std::vector<int8_t> q;      // [M, K]
  std::vector<int32_t> zp;    // [M]
  std::vector<float> recip;   // [M]
  std::vector<int32_t> qsum;  // [M, nb]: sum of q over each block
};

// torch's float steps for weight row n, given the integer sums of every (input row, block): qw [M, nb]
// (sum q w), ws [nb] (sum w). The block sums are (uint32, wrapping as torch's int32)
// sum q w - 8 sum q - zp (sum w - 8 bl); their products with the scales are independent (the
// compiler vectorises them), and only their sum runs block after block, as torch's. sc, part: nb floats.
inline __attribute__((always_inline)) void finish_row(const Rows& r, const uint32_t* qw, const uint32_t* ws,
                                                      const void* scales, bool bf16, int64_t n, int64_t N, float* y,
                                                      float* sc, float* part) {
  const int64_t nb = r.nb;
  if (bf16) {
    const uint16_t* s16 = static_cast<const uint16_t*>(scales) + n * nb;
    for (int64_t b = 0; b < nb; ++b) {
      const uint32_t wide = static_cast<uint32_t>(s16[b]) << 16;
      std::memcpy(&sc[b], &wide, 4);
    }
  } else {
    std::memcpy(sc, static_cast<const float*>(scales) + n * nb, 4 * nb);
  }
  const uint32_t len8 = 8u * static_cast<uint32_t>(r.bl);
  for (int64_t m = 0; m < r.M; ++m) {
    const uint32_t* qm = qw + m * nb;
    const int32_t* qs = r.qsum.data() + m * nb;
    const uint32_t zp = static_cast<uint32_t>(r.zp[m]);
    for (int64_t b = 0; b < nb; ++b) {
      const uint32_t v = qm[b] - 8u * static_cast<uint32_t>(qs[b]) - zp * (ws[b] - len8);
      part[b] = static_cast<float>(static_cast<int32_t>(v)) * sc[b];
    }
    float acc = part[0];  // channelwise: the one product; groupwise: 0 + the first, as torch starts
    if (r.bl != r.K) {
      acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) acc = acc + part[b];
    }
    float v = acc * r.recip[m];
    v = std::max(v, -FLT_MAX);
    v = std::min(v, FLT_MAX);
    y[m * N + n] = v;
  }
}

// portable: weight rows [n0, n1)
void rows_portable(const Rows& r, const int8_t* q, const void* scales, bool bf16, int64_t N, int64_t n0, int64_t n1,
                   float* y) {
  std::vector<uint32_t> qw(r.M * r.nb), ws(r.nb);
  std::vector<float> sc(r.nb), part(r.nb);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = q + n * r.K;
    for (int64_t b = 0; b < r.nb; ++b) {
      const int8_t* wb = w + b * r.bl;
      uint32_t s = 0;
      for (int64_t k = 0; k < r.bl; ++k) s += static_cast<uint32_t>((wb[k] + 8) & 15);
      ws[b] = s;
      for (int64_t m = 0; m < r.M; ++m) {
        const int8_t* x = r.q.data() + m * r.K + b * r.bl;
        uint32_t a = 0;
        for (int64_t k = 0; k < r.bl; ++k) a += static_cast<uint32_t>(static_cast<int32_t>(x[k]) * ((wb[k] + 8) & 15));
        qw[m * r.nb + b] = a;
      }
    }
    finish_row(r, qw.data(), ws.data(), scales, bf16, n, N, y, sc.data(), part.data());
  }
}

#ifdef I4P_MM_AVX2
__attribute__((target("avx2"), always_inline)) inline uint32_t hsum32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(s));
}

// the sums of 4 vectors of 8 int32 (wrapping): [sum a, sum b, sum c, sum d]
__attribute__((target("avx2"), always_inline)) inline __m128i hsum4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

// One weight row's block (its first bl / 32 * 32 values; wb points at the block) against input rows
// [m0, m0 + mt): acc[j * stride] += 8 lanes of sum q w of row m0 + j; with `with_ws`, *wsum += 8 lanes
// of sum w. 32 nibbles a step, up to 8 steps summed in int16 (|8 * 2 * 15 * 128| < 2^15) before
// they are widened to int32.
__attribute__((target("avx2"), always_inline)) inline void block_sums(const Rows& r, const int8_t* wb, int64_t b,
                                                                     int64_t m0, int mt, bool with_ws, __m256i* acc,
                                                                     int stride, __m256i* wsum) {
  const __m256i eight = _mm256_set1_epi8(8), fifteen = _mm256_set1_epi8(15), ones8 = _mm256_set1_epi8(1);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const int64_t steps = r.bl / 32;
  for (int64_t s0 = 0; s0 < steps; s0 += 8) {
    const int ns = static_cast<int>(std::min<int64_t>(8, steps - s0));
    __m256i u[8];
    __m256i ws16 = _mm256_setzero_si256();
    for (int i = 0; i < ns; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * (s0 + i)));
      u[i] = _mm256_and_si256(_mm256_add_epi8(v, eight), fifteen);
      if (with_ws) ws16 = _mm256_add_epi16(ws16, _mm256_maddubs_epi16(u[i], ones8));
    }
    if (with_ws) *wsum = _mm256_add_epi32(*wsum, _mm256_madd_epi16(ws16, ones16));
    for (int j = 0; j < mt; ++j) {
      const int8_t* x = r.q.data() + (m0 + j) * r.K + b * r.bl + 32 * s0;
      __m256i p = _mm256_maddubs_epi16(u[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
      for (int i = 1; i < ns; ++i)
        p = _mm256_add_epi16(
            p, _mm256_maddubs_epi16(u[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * i))));
      acc[j * stride] = _mm256_add_epi32(acc[j * stride], _mm256_madd_epi16(p, ones16));
    }
  }
}

// a block's last bl % 32 values (channelwise K only) of weight row wb, added in scalar
inline void block_tail(const Rows& r, const int8_t* wb, int64_t b, uint32_t* qw, uint32_t* ws) {
  const int64_t k0 = r.bl / 32 * 32;
  if (k0 == r.bl) return;
  for (int64_t k = k0; k < r.bl; ++k) ws[b] += static_cast<uint32_t>((wb[k] + 8) & 15);
  for (int64_t m = 0; m < r.M; ++m) {
    const int8_t* x = r.q.data() + m * r.K + b * r.bl;
    for (int64_t k = k0; k < r.bl; ++k)
      qw[m * r.nb + b] += static_cast<uint32_t>(static_cast<int32_t>(x[k]) * ((wb[k] + 8) & 15));
  }
}

// rows_portable in AVX2: weight rows 4 at a time (their 8-lane sums reduced together), input rows 8
// at a time (the nibbles made again for each 8), the rows past a multiple of 4 one at a time.
__attribute__((target("avx2"))) void rows_avx2(const Rows& r, const int8_t* q, const void* scales, bool bf16,
                                              int64_t N, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = r.nb, M = r.M;
  std::vector<uint32_t> qw(4 * M * nb), ws(4 * nb);
  std::vector<float> sc(nb), part(nb);
  alignas(16) uint32_t four[4];
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int mt = static_cast<int>(std::min<int64_t>(8, M - m0));
        __m256i acc[8 * 4], wsum[4];
        for (int i = 0; i < 4 * mt; ++i) acc[i] = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) wsum[i] = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i)
          block_sums(r, q + (n + i) * r.K + b * r.bl, b, m0, mt, m0 == 0, acc + i, 4, wsum + i);
        if (m0 == 0) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(four), hsum4(wsum[0], wsum[1], wsum[2], wsum[3]));
          for (int i = 0; i < 4; ++i) ws[i * nb + b] = four[i];
        }
        for (int j = 0; j < mt; ++j) {
          const __m256i* a = acc + 4 * j;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(four), hsum4(a[0], a[1], a[2], a[3]));
          for (int i = 0; i < 4; ++i) qw[(i * M + m0 + j) * nb + b] = four[i];
        }
      }
      for (int i = 0; i < 4; ++i) block_tail(r, q + (n + i) * r.K + b * r.bl, b, &qw[i * M * nb], &ws[i * nb]);
    }
    for (int i = 0; i < 4; ++i)
      finish_row(r, &qw[i * M * nb], &ws[i * nb], scales, bf16, n + i, N, y, sc.data(), part.data());
  }
  for (; n < n1; ++n) {
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* wb = q + n * r.K + b * r.bl;
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int mt = static_cast<int>(std::min<int64_t>(8, M - m0));
        __m256i acc[8], wsum = _mm256_setzero_si256();
        for (int j = 0; j < mt; ++j) acc[j] = _mm256_setzero_si256();
        block_sums(r, wb, b, m0, mt, m0 == 0, acc, 1, &wsum);
        if (m0 == 0) ws[b] = hsum32(wsum);
        for (int j = 0; j < mt; ++j) qw[(m0 + j) * nb + b] = hsum32(acc[j]);
      }
      block_tail(r, wb, b, qw.data(), ws.data());
    }
    finish_row(r, qw.data(), ws.data(), scales, bf16, n, N, y, sc.data(), part.data());
  }
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") != 0;
}
const bool g_avx2 = cpu_has_avx2();
#endif

}  // namespace

bool w4a8_matmul_avx2() {
#ifdef I4P_MM_AVX2
  return g_avx2;
#else
  return false;
#endif
}

// y [M, N] float32 = torch's reference _dyn_quant_matmul_4bit(x, its buffer of (q, scales), bl, K, N)
// for x float32 [M, K], q int8 [N, K] (the weights; each taken as its nibble (q + 8) & 15, minus 8,
// as torch's packer stores it), scales [N, K/bl] (bf16 bits or fp32); bl == K is channelwise.
// Rows of the output split over `threads`; `simd` 0 forces the portable loops (tests).
void w4a8_matmul(const float* x, int64_t M, int64_t K, const int8_t* q, int64_t N, int64_t bl, const void* scales,
                 bool bf16, float* y, int64_t threads, bool simd) {
  I4P_CHECK(M >= 0 && N >= 0 && K >= 2 && K % 2 == 0, "w4a8_matmul: bad shape M=", M, " N=", N, " K=", K);
  const bool channel = bl == K;
  I4P_CHECK(channel || (bl > 0 && bl % 32 == 0 && K % bl == 0), "w4a8_matmul: block ", bl,
            " is neither K nor a multiple of 32 dividing K=", K);
  if (M == 0 || N == 0) return;
  Rows r{M, K, bl, K / bl, std::vector<int8_t>(M * K), std::vector<int32_t>(M), std::vector<float>(M), {}};
  r.qsum.assign(M * r.nb, 0);
  for (int64_t m = 0; m < M; ++m) {
    quantize_row(x + m * K, K, channel, r.q.data() + m * K, &r.zp[m], &r.recip[m]);
    for (int64_t b = 0; b < r.nb; ++b) {
      int32_t s = 0;
      for (int64_t k = b * bl; k < (b + 1) * bl; ++k) s += r.q[m * K + k];
      r.qsum[m * r.nb + b] = s;
    }
  }
#ifdef I4P_MM_AVX2
  const bool vec = simd && g_avx2;
#else
  (void)simd;
#endif
  for_rows(N, std::max<int64_t>(1, (1 << 18) / (K * M)), threads, [&](int64_t n0, int64_t n1) {
#ifdef I4P_MM_AVX2
    if (vec) return rows_avx2(r, q, scales, bf16, N, n0, n1, y);
#endif
    rows_portable(r, q, scales, bf16, N, n0, n1, y);
  });
}

}  // namespace i4p
