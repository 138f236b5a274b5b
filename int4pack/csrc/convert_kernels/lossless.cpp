// The lossless re-emit: q = codes - 8 and the error of the scale cast (twin: w4a8._lossless).

#include "convert_kernels.h"

namespace i4p {

// ------------------------------------------------------------------------------------ lossless

// q = codes - 8 (int8), and per contiguous group of width g: sum of q^2 and max q^2 (int32)
I4P_CLONES void lossless_rows(const uint8_t* c, int8_t* q, int32_t* sq, int32_t* mq, int64_t r0, int64_t r1,
                              int64_t k, int64_t g) {
  const int64_t groups = k / g;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < groups; ++j) {
      const uint8_t* src = c + r * k + j * g;
      int8_t* dst = q + r * k + j * g;
      int32_t s = 0, m = 0;
      for (int64_t i = 0; i < g; ++i) {
        const int32_t v = static_cast<int32_t>(src[i]) - 8;
        dst[i] = static_cast<int8_t>(v);
        s += v * v;
        m = std::max(m, v * v);
      }
      sq[r * groups + j] = s;
      mq[r * groups + j] = m;
    }
  }
}

// ------------------------------------------------------------------------------------ lossless, one call

// The whole lossless job in one pass (w4a8._lossless + convert.check_scales' common case): q = codes - 8,
// target scales cast from the source group holding each target group, and the error of that cast.
// Works on unpacked codes, or straight on the packed words (GPTQ [K/8, N] or compressed-tensors
// [N, K/8]) so the codes are never materialised. Returns status 0 and the results, or a status saying
// why the general Python path must decide:
//   1 a source scale that is NaN/Inf, negative or zero (check_scales names it),
//   2 a zero point other than 8 (not lossless: requant), 3 a scale not finite after the cast,
//   4 a target group spanning two source groups (or a K the packed path does not take).
enum LosslessStatus : int64_t { kOk = 0, kBadScale = 1, kAsym = 2, kCastOverflow = 3, kSpans = 4 };

struct Lossless {
  const uint8_t* z = nullptr;  // zeros [N, Gs] or null (all 8)
  const float* ss = nullptr;  // source scales [N, Gs]
  const int64_t* sg = nullptr;  // source group of each target group; -1 where it spans two
  int64_t gs_count = 1, k = 0, g = 0;
  bool bf16 = true;
  int8_t* q = nullptr;
  float* out_s = nullptr;  // [N, K/g] shipped values
};

// row accumulators: dd, ww, vv, wv, max_abs (a local copy per row, so they stay in registers)
struct RowAcc {
  double v[5] = {0, 0, 0, 0, 0};
  int64_t status = kOk;
};

// sqrt(m) for the largest q^2 of a group, exact: m is a square (q^2 <= 64 for 4-bit codes)
constexpr double kRoots[65] = {0, 1, 0, 0, 2, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0,
                               0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8};

// target group j of row r, whose q^2 sum and max are sq and m: check, cast, accumulate
I4P_INLINE void lossless_group(const Lossless& p, int64_t r, int64_t j, int32_t sq, int32_t m, RowAcc& a) {
  if (a.status != kOk) return;
  const int64_t groups = p.k / p.g, sg = p.sg[j];
  if (sg < 0) {
    a.status = kSpans;
    return;
  }
  if (p.z && p.z[r * p.gs_count + sg] != 8) {
    a.status = kAsym;
    return;
  }
  const float s = p.ss[r * p.gs_count + sg];
  if (!(s > 0.0f) || !std::isfinite(s)) {  // NaN, Inf, negative or zero
    a.status = kBadScale;
    return;
  }
  const float sb = p.bf16 ? ship_bf16(s) : s;
  if (!std::isfinite(sb)) {
    a.status = kCastOverflow;
    return;
  }
  p.out_s[r * groups + j] = sb;
  const double sd = s, sbd = sb, diff = sbd - sd, w = sq;
  const double root = m <= 64 ? kRoots[m] : std::sqrt(static_cast<double>(m));  // vsqrtsd stalled the loop
  a.v[0] += diff * diff * w;
  a.v[1] += sd * sd * w;
  a.v[2] += sbd * sbd * w;
  a.v[3] += sd * sbd * w;
  a.v[4] = std::max(a.v[4], std::fabs(diff) * root);
}

// 8 codes (one word) -> 8 int8 q = u - 8
I4P_INLINE void word_q(uint32_t w, int8_t* dst) {
  // u + 0x78 never carries out of its byte (u <= 15); ^ 0x80 then subtracts 0x80 mod 256: u - 8
  const uint64_t q = (spread_nibbles(w) + 0x7878787878787878ull) ^ 0x8080808080808080ull;
  std::memcpy(dst, &q, 8);
}

// sum and max of q^2 over g int8 values (a plain loop the compiler vectorises)
I4P_INLINE void q_stats(const int8_t* q, int64_t g, int32_t& sq, int32_t& m) {
  int32_t s = 0, mx = 0;
  for (int64_t i = 0; i < g; ++i) {
    const int32_t v = q[i];
    s += v * v;
    mx = std::max(mx, v * v);
  }
  sq = s;
  m = mx;
}

typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int16_t i16x16 __attribute__((vector_size(32)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

// the sum and the max of the 16 lanes, reduced by halves (GCC turned a lane loop into scalar extracts)
I4P_INLINE void reduce16(u16x16 s, u16x16 mx, int32_t& sum, int32_t& max) {
  u16x8 s8, m8, hi;
  std::memcpy(&s8, &s, 16);
  std::memcpy(&hi, reinterpret_cast<const char*>(&s) + 16, 16);
  s8 += hi;
  std::memcpy(&m8, &mx, 16);
  std::memcpy(&hi, reinterpret_cast<const char*>(&mx) + 16, 16);
  m8 = m8 > hi ? m8 : hi;
  // (I4P_SHUF: GCC's __builtin_shuffle or clang's __builtin_shufflevector)
  u16x8 t = I4P_SHUF(u16x8, s8, s8, 4, 5, 6, 7, 0, 1, 2, 3);
  s8 += t;
  t = I4P_SHUF(u16x8, m8, m8, 4, 5, 6, 7, 0, 1, 2, 3);
  m8 = m8 > t ? m8 : t;
  t = I4P_SHUF(u16x8, s8, s8, 2, 3, 0, 1, 6, 7, 4, 5);
  s8 += t;
  t = I4P_SHUF(u16x8, m8, m8, 2, 3, 0, 1, 6, 7, 4, 5);
  m8 = m8 > t ? m8 : t;
  sum = static_cast<int32_t>(s8[0]) + s8[1];
  max = std::max(m8[0], m8[1]);
}

// q_stats for q in [-8, 7] (4-bit codes less 8): squares and their sums in unsigned 16-bit lanes,
// 16 values a step (the plain loop widened every square to 32 bits). g <= 512 keeps every partial
// sum of reduce16 within 16 bits: 8 lanes of <= 32 squares of <= 64
I4P_INLINE void q4_stats(const int8_t* q, int64_t g, int32_t& sq, int32_t& m) {
  if (g > 512 || g % 16) {
    q_stats(q, g, sq, m);
    return;
  }
  u16x16 acc = {}, mx = {};
  for (int64_t i = 0; i < g; i += 16) {
    i8x16 v;
    std::memcpy(&v, q + i, 16);
    i16x16 w = __builtin_convertvector(v, i16x16);
    const u16x16 w2 = (u16x16)(w * w);
    acc += w2;
    mx = mx > w2 ? mx : w2;
  }
  reduce16(acc, mx, sq, m);
}

// the statistics, checks and scales of rows [r0, r1), whose q is written
I4P_INLINE void lossless_stats_rows(const Lossless& p, int64_t r0, int64_t r1, RowAcc* acc) {
  const int64_t k = p.k, g = p.g, groups = k / g;
  for (int64_t r = r0; r < r1; ++r) {
    RowAcc a = acc[r];
    for (int64_t j = 0; j < groups && a.status == kOk; ++j) {
      int32_t sq, m;
      q4_stats(p.q + r * k + j * g, g, sq, m);
      lossless_group(p, r, j, sq, m, a);
    }
    acc[r] = a;
  }
}

I4P_CLONES void lossless_codes_rows(const Lossless& p, const uint8_t* c, int64_t r0, int64_t r1, RowAcc* acc) {
  const int64_t k = p.k, g = p.g, groups = k / g;
  for (int64_t r = r0; r < r1; ++r) {
    RowAcc a = acc[r];
    for (int64_t j = 0; j < groups && a.status == kOk; ++j) {
      const uint8_t* src = c + r * k + j * g;
      int8_t* dst = p.q + r * k + j * g;
      for (int64_t i = 0; i < g; ++i) dst[i] = static_cast<int8_t>(static_cast<int32_t>(src[i]) - 8);
      int32_t sq, m;
      q_stats(dst, g, sq, m);  // codes of any value: not only 4-bit ones
      lossless_group(p, r, j, sq, m, a);
    }
    acc[r] = a;
  }
}

// compressed-tensors weight_packed [N, K/8]: row r's words are contiguous
I4P_CLONES void lossless_ct_rows(const Lossless& p, const uint32_t* w, int64_t kw, int64_t r0, int64_t r1,
                                 RowAcc* acc) {
  const int64_t k = p.k, kw4 = k / 32 * 4;
  for (int64_t r = r0; r < r1; ++r) {
    const uint32_t* src = w + r * kw;
    int8_t* dst = p.q + r * k;
    // the whole row first: statistics read right behind 16-byte stores would wait on each
    // (a load spanning two stores is not forwarded; lossless ran at 4.5 against 6.4 Gparam/s)
    int64_t t = 0;
    for (; t < kw4; t += 4) {
      u8x16 a, b;
      nibbles4(src + t, a, b);
      a -= 8;
      b -= 8;
      std::memcpy(dst + 8 * t, &a, 16);
      std::memcpy(dst + 8 * t + 16, &b, 16);
    }
    for (; t < k / 8; ++t) word_q(src[t], dst + 8 * t);
    lossless_stats_rows(p, r, r + 1, acc);
  }
}

// GPTQ qweight [K/8, N]: blocks of 16 rows unpacked straight into q (unpack_gptq_rows), then
// their statistics while the block is still in cache
I4P_CLONES void lossless_gptq_rows(const Lossless& p, const uint32_t* w, int64_t n, int64_t b0, int64_t b1,
                                   RowAcc* acc) {
  constexpr int64_t kBlock = 16;
  for (int64_t r0 = b0 * kBlock; r0 < std::min(n, b1 * kBlock); r0 += kBlock) {
    const int64_t r1 = std::min(n, r0 + kBlock);
    unpack_gptq_rows(w, reinterpret_cast<uint8_t*>(p.q), n, p.k / 8, r0, r1, 0, 8);
    lossless_stats_rows(p, r0, r1, acc);
  }
}

// layout: 0 codes uint8 [N, K]; 1 compressed-tensors words [N, K/8]; 2 GPTQ words [K/8, N] (data's
// shape d0 x d1). Source scales float32 [N, Gs], zeros uint8 [N, Gs] or null, source groups of
// src_group contiguous columns, target group g (K: channel), bf16 (else fp32) target scales.
// Returns the status; when 0, q int8 [N, K], s [N, K/g] float32 holding the shipped values and
// tot [5] float64 (dd, ww, vv, wv, max_abs) are filled.
int64_t lossless_job(int64_t layout, const void* data, int64_t d0, int64_t d1, int64_t n, int64_t k,
                     const float* sscale, int64_t gs_count, const uint8_t* zeros, int64_t src_group, int64_t g,
                     bool bf16, int8_t* q, float* s, double* tot, int64_t threads) {
  check_job_data(layout, d0, d1, n, k, 2);
  I4P_CHECK(g > 0 && k % g == 0, "lossless_job: group ", g, " does not divide K=", k);
  I4P_CHECK(src_group > 0, "lossless_job: bad source group ", src_group);
  Lossless p;
  p.gs_count = gs_count;
  if (zeros != nullptr) {
    p.z = zeros;
    // an asymmetric source (the requant path calls here first) leaves before any work
    const int64_t nz = n * gs_count;
    int64_t i = 0;
    while (i < nz && p.z[i] == 8) ++i;
    if (i < nz) return kAsym;
  }
  p.ss = sscale;
  // each target group's source group, once per job (two divisions per group were ~10% of the job)
  std::vector<int64_t> sgs(k / g);
  for (int64_t j = 0; j < k / g; ++j) {
    const int64_t sg = (j * g) / src_group;
    sgs[j] = ((j + 1) * g - 1) / src_group != sg || sg >= p.gs_count ? -1 : sg;
  }
  p.sg = sgs.data();
  p.k = k;
  p.g = g;
  p.bf16 = bf16;
  p.q = q;
  p.out_s = s;
  std::vector<RowAcc> acc(n);
  const bool packed_ok = layout == 0 || (k % 8 == 0 && g % 8 == 0);
  if (!packed_ok) {
    acc.assign(n, RowAcc{});
    if (n) acc[0].status = kSpans;
  } else if (layout == 0) {
    const uint8_t* c = static_cast<const uint8_t*>(data);
    for_rows(n, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(k, 1)), threads,
             [&](int64_t r0, int64_t r1) { lossless_codes_rows(p, c, r0, r1, acc.data()); });
  } else if (layout == 1) {
    const uint32_t* w = static_cast<const uint32_t*>(data);
    const int64_t kw = d1;
    for_rows(n, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(k, 1)), threads,
             [&](int64_t r0, int64_t r1) { lossless_ct_rows(p, w, kw, r0, r1, acc.data()); });
  } else {
    const uint32_t* w = static_cast<const uint32_t*>(data);
    for_rows((n + 15) / 16, 1, threads, [&](int64_t b0, int64_t b1) { lossless_gptq_rows(p, w, n, b0, b1, acc.data()); });
  }
  int64_t worst = kOk;
  for (int i = 0; i < 5; ++i) tot[i] = 0.0;
  for (int64_t r = 0; r < n; ++r) {
    worst = std::max(worst, acc[r].status);
    for (int i = 0; i < 4; ++i) tot[i] += acc[r].v[i];
    tot[4] = std::max(tot[4], acc[r].v[4]);
  }
  return worst;
}

}  // namespace i4p
