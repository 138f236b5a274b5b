// The lossless path in one pass (twin: w4a8._lossless_torch after w4a8.check_scales): q = codes - 8,
// target scales cast from the source group holding each target group, and the error of that cast.
// Works on unpacked codes, or straight on the packed words (GPTQ [K/8, N] or compressed-tensors
// [N, K/8]: the codes are never materialised; AWQ words and a compressed-tensors K off whole words
// a block of rows at a time).

#include "convert_kernels.h"

namespace i4p {

struct Lossless {
  const float* ss = nullptr;  // source scales [N, Gs]
  const int64_t* sg = nullptr;  // source group of each target group
  int64_t gs_count = 1, k = 0, g = 0;
  bool bf16 = true;
  int8_t* q = nullptr;
  float* out_s = nullptr;  // [N, K/g] shipped values
};

// row accumulators: dd, ww, vv, wv, max_abs (a local copy per row, so they stay in registers)
struct RowAcc {
  double v[5] = {0, 0, 0, 0, 0};
  bool cast_not_finite = false;
};

// sqrt(m) for the largest q^2 of a group, exact: m is a square (q^2 <= 64 for 4-bit codes)
constexpr double kRoots[65] = {0, 1, 0, 0, 2, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0,
                               0, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8};

// target group j of row r, whose q^2 sum and max are sq and m: cast, accumulate (the scales were
// checked before: finite, and zero only where the check of erased weights looks)
I4P_INLINE void lossless_group(const Lossless& p, int64_t r, int64_t j, int32_t sq, int32_t m, RowAcc& a) {
  const int64_t groups = p.k / p.g;
  const float s = p.ss[r * p.gs_count + p.sg[j]];
  const float sb = p.bf16 ? ship_bf16(s) : s;
  a.cast_not_finite |= !std::isfinite(sb);
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
    for (int64_t j = 0; j < groups; ++j) {
      int32_t sq, m;
      q4_stats(p.q + r * k + j * g, g, sq, m);
      lossless_group(p, r, j, sq, m, a);
    }
    acc[r] = a;
  }
}

// codes uint8 (row r at c + (r - c0) * K)
I4P_CLONES void lossless_codes_rows(const Lossless& p, const uint8_t* c, int64_t c0, int64_t r0, int64_t r1,
                                    RowAcc* acc) {
  const int64_t k = p.k, g = p.g, groups = k / g;
  for (int64_t r = r0; r < r1; ++r) {
    RowAcc a = acc[r];
    for (int64_t j = 0; j < groups; ++j) {
      const uint8_t* src = c + (r - c0) * k + j * g;
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
    // (a load spanning two stores is not forwarded)
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

// the job (see convert_kernels.h): checks, then rows in parallel, then the sums in row order
int64_t lossless_job(const JobArgs& a, int8_t* q, float* s, double* tot, int64_t* report, int64_t threads) {
  check_job(a, kAwq, "lossless_job");
  const int64_t n = a.n, k = a.k, g = a.g, groups = k / g;
  if (a.zeros != nullptr) {
    const int64_t nz = n * a.src_groups;
    I4P_CHECK(std::all_of(a.zeros, a.zeros + nz, [](uint8_t z) { return z == 8; }),
              "lossless_job: a zero point other than 8 (not a lossless source)");
  }
  bool zero_seen = false;
  const int64_t st = check_source_scales(a, report, zero_seen);
  if (st != kDone) return st;
  // each target group's source group, once per job rather than two divisions per group
  std::vector<int64_t> sgs(groups);
  for (int64_t j = 0; j < groups; ++j) {
    const int64_t c0 = j * g, c1 = c0 + g - 1;
    int64_t sg = a.gidx ? a.gidx[c0] : c0 / a.src_group;
    if (a.gidx) {
      for (int64_t i = c0; i <= c1; ++i) sg = a.gidx[i] == sg ? sg : -1;
    } else if (c1 / a.src_group != sg) {
      sg = -1;
    }
    I4P_CHECK(sg >= 0, "lossless_job: target group ", j, " spans two source groups (not a lossless source)");
    sgs[j] = sg;
  }
  Lossless p;
  p.gs_count = a.src_groups;
  p.ss = a.sscale;
  p.sg = sgs.data();
  p.k = k;
  p.g = g;
  p.bf16 = a.bf16 != 0;
  p.q = q;
  p.out_s = s;
  std::vector<RowAcc> acc(n);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(k, 1));
  if (a.layout == kCodes) {
    const uint8_t* c = static_cast<const uint8_t*>(a.data);
    for_rows(n, grain, threads, [&](int64_t r0, int64_t r1) { lossless_codes_rows(p, c, 0, r0, r1, acc.data()); });
  } else if (a.layout == kCt && k % 8 == 0) {
    const uint32_t* w = static_cast<const uint32_t*>(a.data);
    for_rows(n, grain, threads, [&](int64_t r0, int64_t r1) { lossless_ct_rows(p, w, a.d1, r0, r1, acc.data()); });
  } else if (a.layout == kGptq) {
    const uint32_t* w = static_cast<const uint32_t*>(a.data);
    for_rows((n + 15) / 16, 1, threads, [&](int64_t b0, int64_t b1) { lossless_gptq_rows(p, w, n, b0, b1, acc.data()); });
  } else {
    for_rows((n + kJobRows - 1) / kJobRows, 1, threads, [&](int64_t b0, int64_t b1) {
      std::vector<uint8_t> buf(kJobRows * k);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t r0 = b * kJobRows, r1 = std::min(n, r0 + kJobRows);
        unpack_block(a, r0, r1, buf.data());
        lossless_codes_rows(p, buf.data(), r0, r0, r1, acc.data());
      }
    });
  }
  if (zero_seen) {  // q = 0 where the code is 8: a zero scale erases nothing there
    for (int64_t r = 0; r < n; ++r) {
      const int64_t sg = erased_in_row(a, r, reinterpret_cast<const uint8_t*>(q + r * k), 0);
      if (sg >= 0) {
        report[0] = r;
        report[1] = sg;
        report[2] = 0;
        return kScaleErases;
      }
    }
  }
  for (int i = 0; i < 5; ++i) tot[i] = 0.0;
  bool cast_not_finite = false;
  for (int64_t r = 0; r < n; ++r) {
    cast_not_finite |= acc[r].cast_not_finite;
    for (int i = 0; i < 4; ++i) tot[i] += acc[r].v[i];
    tot[4] = std::max(tot[4], acc[r].v[4]);
  }
  return cast_not_finite ? kCastNotFinite : kDone;
}

}  // namespace i4p
