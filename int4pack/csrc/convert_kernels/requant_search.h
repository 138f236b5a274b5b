// The requantisation scale search (twin: scale_search.search_chunk, driven by w4a8.requantize).
//
// The requant search follows scale_search.search_chunk candidate for candidate: the same float32
// operations produce the same candidate scales and the same q, and each candidate's error is
// the float64 sum of (s * q - x)^2, whose differences are exact (see TieRule). Only the order of
// that sum differs from torch's, so the decision is the tie rule of scale_search.first_within_tie (the
// first candidate within 2^-30 of the smallest error), taken here unless some error lies within
// the rounding bound of the rule's threshold; such a group (in practice none) is flagged (bit 0
// of `flags`) and the caller redoes it with the torch code. The result is byte-identical to the
// oracle whatever torch's summation order is.
// From int4 codes, a target group inside one source group takes at most 16 values: its errors
// come from the histogram of its codes, 8 groups at a time (namespace hist), in float32 where
// the decision is clear by a margin that covers float32 rounding, else in float64 as above
// (hist::search32); anything else goes through the values one by one (element_group).
//
// This header holds what both evaluations share: the numbers, the 8-lane float helpers, the
// tie rule, one group's decision (Decision) and the scratch of a thread (Search). The requant
// job (requant.cpp) is the one source that includes it and the evaluations: their helpers are
// forced inline into requant_rows, whatever target it is built for.
#pragma once

#include "convert_kernels.h"

// x86-64 (GCC): requant_rows (requant.cpp) is built for x86-64-v3 (AVX2, FMA, BMI2) only, not as
// target clones: a baseline SSE2 clone of its 32-byte vector code is large and most of the build's
// compile time. Its hottest loop (requant_element32.h, errors32) is written with AVX2/FMA
// intrinsics there; elsewhere every loop is plain vector code.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define I4P_REQUANT_V3 1
#define I4P_REQUANT_TARGET __attribute__((target("arch=x86-64-v3")))
#else
#define I4P_REQUANT_TARGET
#endif

namespace i4p {

constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: (t + kMagic) - kMagic rounds half to even, |t| <= 2^22
constexpr float kTiny = 1.1754943508222875e-38f;  // 2^-126, scale_search.TINY
constexpr double kU = 0x1p-53;  // float64 unit roundoff
constexpr uint8_t kAmbiguous = 1, kNonFinite = 2, kZero = 4;
// the float32 searches (hist::search32, elem32) decide groups whose amax lies in this range only:
// there their rounding bounds hold (no overflow, underflow within 2^-122)
constexpr float kClearMin = 0x1p-40f, kClearMax = 0x1p40f;

// ------------------------------------------------------------------------------------ requant

struct Req {
  const float* w = nullptr;  // float source [N, K], or its rows decoded one at a time, or
  const FloatRows* rows = nullptr;
  const uint8_t* codes = nullptr;  // codes [N, K] (rows from codes_r0 on: requant_job's blocks) with
  int64_t codes_r0 = 0;
  const uint8_t* zeros = nullptr;  // zeros [N, Gs] (null: 8)
  const float* sscale = nullptr;  // source scales [N, Gs]
  const int64_t* gidx = nullptr;  // [K] (null: k / src_group)
  int64_t src_groups = 1, src_group = 1;
  int64_t n = 0, k = 0, g = 0;  // g: target group width (K for channel)
  bool bf16 = true, search = true;
  bool search64 = false;  // g_search64 when the call began
  std::vector<float> coarse, fine;
  int8_t* q = nullptr;
  float* s = nullptr;
  uint8_t* flags = nullptr;
  double* rowstats = nullptr;  // [N, 6]: dd, ww, vv, wv, baseline sse, max_abs (see ReqRow)
};

I4P_INLINE float ship(const Req& p, float x) {
  const float y = p.bf16 ? ship_bf16(x) : x;
  return y < kTiny ? kTiny : y;  // clamp_min(TINY)
}

// 8 floats; GCC/Clang vector extensions: plain SIMD on every target (SSE2 pairs, AVX2, NEON)
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint64_t u64x4 __attribute__((vector_size(32)));

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define I4P_HAS_SHUFFLEVECTOR 1
#endif
#endif
#ifdef I4P_HAS_SHUFFLEVECTOR
// x in every lane; not written {x, x, ...}: GCC 12 assembles that lane by lane (through the stack)
// in target_clones functions, where a shuffle of lane 0 gives one broadcast
typedef float v4f_splat __attribute__((vector_size(16)));
I4P_INLINE v8f splat(float x) {
  const v4f_splat v = {x, 0.0f, 0.0f, 0.0f};
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
}
#else
I4P_INLINE v8f splat(float x) { return x - v8f{}; }
#endif
I4P_INLINE v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
I4P_INLINE float hsum(v8f a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

// clamp to [-8, 7] first, then round half to even: the same integers as torch's round_().clamp_()
I4P_INLINE v8f qround(v8f t) {
  const v8f lo = splat(-8.0f), hi = splat(7.0f), mg = splat(kMagic);
  t = t < lo ? lo : t;
  t = t > hi ? hi : t;
  return (t + mg) - mg;
}
I4P_INLINE float qround1(float t) {
  t = t < -8.0f ? -8.0f : t;
  t = t > 7.0f ? 7.0f : t;
  return (t + kMagic) - kMagic;
}

typedef double f64x8 __attribute__((vector_size(64)));

// sum over the group of (s * clamp(round(x / s)) - x)^2 as the oracle takes it: q in float32,
// then s * q - x in float64 (exact: see TieRule), squared and summed in float64
I4P_INLINE double group_sse(const float* x, int64_t n, float s) {
  const float r = 1.0f / s;  // torch: s.reciprocal()
  const v8f vr = splat(r);
  const double sd = s;
  f64x8 a = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f x0 = load8(x + i);
    const f64x8 d = __builtin_convertvector(qround(x0 * vr), f64x8) * sd - __builtin_convertvector(x0, f64x8);
    a += d * d;
  }
  double tail = 0.0;
  for (; i < n; ++i) {
    const double d = static_cast<double>(qround1(x[i] * r)) * sd - static_cast<double>(x[i]);
    tail += d * d;
  }
  return (((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))) + tail;
}


constexpr double kTie = 0x1p-30;  // scale_search.TIE

// Rounding bound on one computed sum of squared errors e2 of a group of n values (torch's or
// ours). Each difference s * q - x is exact in float64: q * s has at most 28 significant bits,
// and where q != 0, |x| >= s / 2 and |x| <= 12 s (every candidate is >= 0.64 * base >= amax / 13)
// keep the difference within 53 bits; where q = 0 it is -x. So only the squares and the sum round:
// |computed - exact| <= (n + 2) u e2 in any summation order; A = (2n + 16) u leaves room.
// Groups outside [1e-18, 1e17] go to torch anyway (Decision::begin's guard).
//
// The decision of scale_search.first_within_tie on errors that may differ from torch's by that bound:
// the first candidate within kTie of the smallest error (t = min (1 + kTie)). It is torch's
// decision too unless the winner lies near t (e > t (1 - a4)) or an earlier candidate with
// another scale does (e < t (1 + a4)); a4 = 4 A covers both sides' roundings, and
// keeping a4 far below kTie means exact ties (e == min, as bf16 scales on a grid of codes
// give) are never near t. Such a close call is flagged: torch decides the group.
struct TieRule {
  double a4 = 0.0;
  bool never = true;  // a4 too near kTie (groups of ~2^19 and more): everything is a close call
  explicit TieRule(int64_t n) {
    a4 = 4.0 * (2.0 * static_cast<double>(n) + 16.0) * kU;
    never = !(8.0 * a4 < kTie);
  }
  // the winner's index; amb is set on a close call
  I4P_INLINE int pick(const float* cand, const double* e, int m, bool& amb) const {
    double mn = e[0];
    for (int i = 1; i < m; ++i) mn = e[i] < mn ? e[i] : mn;
    const double t = mn * (1.0 + kTie);
    int w = 0;
    while (w < m - 1 && !(e[w] <= t)) ++w;
    bool a = never || e[w] > t * (1.0 - a4);
    for (int i = 0; i < w; ++i) a |= (cand[i] != cand[w]) & (e[i] < t * (1.0 + a4));
    amb = amb || a;
    return w;
  }
};

// ---- requant, shared by both evaluations

// ship() on 8 lanes
I4P_INLINE v8f ship8(const Req& p, v8f x) {
  if (p.bf16) {
    u32x8 u = (u32x8)x;
    u += 0x7FFFu + ((u >> 16) & 1u);
    x = (v8f)(u & 0xFFFF0000u);
  }
  return x < splat(kTiny) ? splat(kTiny) : x;
}

// scale_search.search_chunk for one group of the element path (Search::decide runs the steps):
//   m = begin(...)      the scales to evaluate, cand[0..m)
//   err[0..m) = the group's sum of squared errors at each (group_sse)
//   m2 = coarse(...)    the fine pass's scales, cand2[1..m2] (none: 0); cand2[0] is the coarse winner
//   err2[1..m2] = the errors there; fine(m2)
//   finish()            the shipped scale; flag holds the flag bits, base_e the RTN error.
// The candidate arrays are padded so that 8 lanes can be read and written at any candidate.
// hist::search is the same search with 8 groups in the lanes of every step: keep them alike.
struct Decision {
  float* cand = nullptr;
  double* err = nullptr;
  float* ratio = nullptr;  // ratio[1..nc) = the coarse ratios, set once
  float* cand2 = nullptr;
  double* err2 = nullptr;
  TieRule tie{0};  // for the n of the groups (set by Search)
  float base = 1.0f, best_s = 0.0f;
  double base_e = 0.0;
  bool zero = false, amb = false;
  uint8_t flag = 0;

  // a group of n values in [wmin, wmax]
  I4P_INLINE int begin(const Req& p, int nc, float wmin, float wmax) {
    const float amax = std::max(wmax, -wmin);
    zero = amax == 0.0f;
    const float rtn = amax / 7.0f;
    flag = 0;
    amb = false;
    // far outside any real weight (the exactness argument of TieRule needs normal floats): torch decides
    if (!zero && (amax < 1e-18f || amax > 1e17f)) flag |= kAmbiguous;
    if (!p.search) {
      cand[0] = ship(p, rtn);
      return 1;
    }
    base = std::max(wmax / 7.0f, wmin / -8.0f);
    if (!(base > 0.0f)) base = 1.0f;
    ratio[0] = rtn / base;
    for (int c = 0; c < nc; c += 8) {  // cand[c] = ship(p, base * ratio[c])
      const v8f t = ship8(p, splat(base) * load8(ratio + c));
      std::memcpy(cand + c, &t, sizeof(t));
    }
    return nc;
  }

  I4P_INLINE int coarse(const Req& p, int nc, int nf, const float* fine) {
    base_e = err[0];
    if (!p.search) {
      best_s = cand[0];
      return 0;
    }
    const int ib = tie.pick(cand, err, nc, amb);
    best_s = cand[ib];
    if (!(nf > 0 && nc > 2)) return 0;
    cand2[0] = best_s;
    err2[0] = err[ib];
    const float rho = ratio[ib];
    for (int f = 0; f < nf; f += 8) {  // cand2[1 + f] = ship(p, base * (rho + fine[f]))
      const v8f t = ship8(p, splat(base) * (splat(rho) + load8(fine + f)));
      std::memcpy(cand2 + 1 + f, &t, sizeof(t));
    }
    return nf;
  }

  I4P_INLINE void fine(int nf) { best_s = cand2[tie.pick(cand2, err2, nf + 1, amb)]; }

  I4P_INLINE float finish() {
    if (zero) {
      best_s = 1.0f;
      flag |= kZero;
      amb = false;
    }
    if (amb) flag |= kAmbiguous;
    return best_s;
  }
};

// the candidate search's scratch (one per thread): the element path's Decision, and the
// candidates of a histogram batch
struct Search {
  static constexpr int kSlots = 8;  // groups in a batch of the histogram path
  int nc = 0, nf = 0;
  std::vector<float> fine, pool;
  std::vector<double> epool;
  // the batch's candidates and errors, [candidate][lane] (plain arrays: a vector type in memory
  // may be less aligned than the AVX2 clone assumes, so vectors go through load8 / store8)
  std::vector<float> bcand, bcand2;
  std::vector<double> berr, berr2;
  std::vector<float> berr32, berr32b;  // float32 errors of hist::search32
  int64_t batches32 = 0, batches64 = 0;  // added to g_batches* by requant_rows
  Decision d;
  TieRule tie;
  static int padded(int m) { return (m + 7) / 8 * 8 + 8; }
  explicit Search(const Req& p)
      : nc(1 + static_cast<int>(p.coarse.size())), nf(static_cast<int>(p.fine.size())),
        fine(padded(nf), 0.0f), tie(p.g) {
    std::copy(p.fine.begin(), p.fine.end(), fine.begin());
    const int a = padded(nc), b = padded(nf + 1);
    pool.assign(static_cast<size_t>(2 * a + b), 1.0f);
    epool.assign(static_cast<size_t>(a + b), 0.0);
    bcand.assign(static_cast<size_t>(a) * kSlots, 1.0f);
    berr.assign(bcand.size(), 0.0);
    bcand2.assign(static_cast<size_t>(b) * kSlots, 1.0f);
    berr2.assign(bcand2.size(), 0.0);
    berr32.assign(bcand.size(), 0.0f);
    berr32b.assign(bcand2.size(), 0.0f);
    float* q = pool.data();
    d.tie = tie;
    d.cand = q;
    d.ratio = q + a;
    d.cand2 = q + 2 * a;
    d.err = epool.data();
    d.err2 = epool.data() + a;
    std::copy(p.coarse.begin(), p.coarse.end(), d.ratio + 1);
  }
  // the whole search for one group, sse(cand, err, m) evaluating
  template <class Sse>
  I4P_INLINE float decide(const Req& p, Decision& s, float wmin, float wmax, const Sse& sse) {
    sse(s.cand, s.err, s.begin(p, nc, wmin, wmax));
    const int m2 = s.coarse(p, nc, nf, fine.data());
    if (m2 > 0) {
      sse(s.cand2 + 1, s.err2 + 1, m2);
      s.fine(m2);
    }
    return s.finish();
  }
};

// one row's statistics against the float source, added into p.rowstats (zeroed when the row
// starts). A group handed to torch (kAmbiguous) adds only what does not depend on its decision
// (ww, base_sse): kernels.redo_close_calls adds the rest.
struct ReqRow {
  double* st;  // dd, ww, vv, wv, base_sse, max_abs
  I4P_INLINE void add(uint8_t flag, double gdd, double gww, double gvv, double gwv, double base_e, double gmax) {
    st[1] += gww;
    st[4] += base_e;  // already a sum of squares
    if (flag & kAmbiguous) return;
    st[0] += gdd;
    st[2] += gvv;
    st[3] += gwv;
    st[5] = std::max(st[5], gmax);
  }
};

// a group holding a NaN or Inf: the caller lets the torch path raise
I4P_INLINE void non_finite_group(const Req& p, int64_t r, int64_t j) {
  const int64_t groups = p.k / p.g;
  p.flags[r * groups + j] = kNonFinite;
  p.s[r * groups + j] = std::numeric_limits<float>::quiet_NaN();
  std::memset(p.q + r * p.k + j * p.g, 0, p.g);
}

// x[i] for i in [i0, i1): the source dequantised as w4a8._source_rows does ((codes - z) * s)
I4P_INLINE void dequant_range(const Req& p, int64_t r, int64_t i0, int64_t i1, float* x) {
  const uint8_t* c = p.codes + (r - p.codes_r0) * p.k;
  const float* sc = p.sscale + r * p.src_groups;
  const uint8_t* z = p.zeros ? p.zeros + r * p.src_groups : nullptr;
  if (p.gidx) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t gi = p.gidx[i];
      const float zz = z ? static_cast<float>(z[gi]) : 8.0f;
      x[i] = (static_cast<float>(c[i]) - zz) * sc[gi];
    }
    return;
  }
  for (int64_t j = i0 / p.src_group; j * p.src_group < i1; ++j) {
    const int64_t a = std::max(i0, j * p.src_group), b = std::min(i1, (j + 1) * p.src_group);
    const float zz = z ? static_cast<float>(z[j]) : 8.0f;
    const float sj = sc[j];
    for (int64_t i = a; i < b; ++i) x[i] = (static_cast<float>(c[i]) - zz) * sj;
  }
}

}  // namespace i4p
