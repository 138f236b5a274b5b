// The element path's search, eight groups side by side in float32 (a float source: bf16, FP8, FP4,
// MLX and GGUF values). element_group evaluates each candidate of one group in float64, a value at
// a time, and sums across lanes: 13 such passes per group of 32 were most of a float source's
// convert. Here the groups of a row are transposed eight at a time into a Batch (value t of group
// l at xs[t][l]) and every candidate is evaluated for the eight in float32, without a horizontal
// sum, as hist::search32 does for codes. The decision is taken from those errors only where it is
// clear by a margin that covers their rounding (below); a group that is not clear, zero, outside
// [2^-40, 2^40], or holds a NaN goes through element_group as before. A group decided here gets
// the same scale, q, flags and statistics as element_group gives it (its extremes and sum of
// squares as element_scan takes them, the baseline error as lane_sse32 sums it, q and the rest as
// element_finish): only the work differs, eight groups a vector instead of a horizontal sum each.
//
// The bound: with s split into sh (s less its 4 low mantissa bits) and sl = s - sh, q * sh and
// q * sl are exact (|q| <= 8), so d = (q * sh - x) + q * sl is within 3 u |d| (u = 2^-24; see
// hist::batch_sse32), its square within 7 u, and four accumulators of at most kMaxG / 4 = 32 terms
// each, then their sum, add 33 u: each error e lies within b = 40 u E + 2^-122 of the exact E (with
// FMA the differences round as often, the squares and sums less often: the bound holds). A
// decision is taken where every candidate with another scale than the smallest e's has e > min e *
// kClear + kAbs (kClear = 1 + 2^-16): then the exact errors of those scales exceed the winner's by
// more than 2^-16 - 2b > 2^-19 relative, far outside TieRule's tie (2^-30) and its rounding margin,
// so first_within_tie (torch's, or TieRule's in float64) picks the same scale, and the first
// candidate of that scale, as here.
#pragma once

#include "requant_element.h"
#include "requant_hist_search.h"

namespace i4p {
namespace elem32 {

constexpr int kLanes = 8;

// ---- the eight-lane operations of this file: AVX2/FMA instructions on x86-64 under GCC (which
// builds a compare and a blend for each select below, and two 128-bit halves for a widening, from
// plain vector code), plain vector code elsewhere. Every function here is built for requant_rows'
// target (I4P_V3), the one function they are inlined into.
#define I4P_V3 I4P_REQUANT_TARGET I4P_INLINE
using hist::f64x4;

#ifdef I4P_REQUANT_V3
I4P_V3 v8f vmin(v8f a, v8f b) { return (v8f)_mm256_min_ps((__m256)a, (__m256)b); }  // a < b ? a : b
I4P_V3 v8f vmax(v8f a, v8f b) { return (v8f)_mm256_max_ps((__m256)a, (__m256)b); }  // a > b ? a : b
// to nearest, ties to even (for |t| <= 2^22 the same integer as (t + kMagic) - kMagic)
I4P_V3 v8f round_even(v8f t) {
  return (v8f)_mm256_round_ps((__m256)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
I4P_V3 v8f fmsub(v8f a, v8f b, v8f c) { return (v8f)_mm256_fmsub_ps((__m256)a, (__m256)b, (__m256)c); }
I4P_V3 v8f fmadd(v8f a, v8f b, v8f c) { return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c); }
I4P_V3 f64x4 widen_lo(v8f v) { return (f64x4)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)v)); }
I4P_V3 f64x4 widen_hi(v8f v) { return (f64x4)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)v, 1)); }
#else
typedef float v4f __attribute__((vector_size(16)));
I4P_V3 v8f vmin(v8f a, v8f b) { return a < b ? a : b; }
I4P_V3 v8f vmax(v8f a, v8f b) { return a > b ? a : b; }
I4P_V3 v8f round_even(v8f t) { return (t + splat(kMagic)) - splat(kMagic); }
I4P_V3 v8f fmsub(v8f a, v8f b, v8f c) { return a * b - c; }  // two roundings (fused: one)
I4P_V3 v8f fmadd(v8f a, v8f b, v8f c) { return a * b + c; }
I4P_V3 f64x4 widen_lo(v8f v) {
  v4f a;
  std::memcpy(&a, &v, sizeof(a));
  return __builtin_convertvector(a, f64x4);
}
I4P_V3 f64x4 widen_hi(v8f v) {
  v4f a;
  std::memcpy(&a, reinterpret_cast<const char*>(&v) + sizeof(a), sizeof(a));
  return __builtin_convertvector(a, f64x4);
}
#endif

// qround: clamp to [-8, 7], then round half to even, exactly as qround does
I4P_V3 v8f qround8(v8f t) {
  return (vmin(splat(7.0f), vmax(splat(-8.0f), t)) + splat(kMagic)) - splat(kMagic);
}

// whether some lane of a mask is set
I4P_V3 bool any(i32x8 m) {
#ifdef I4P_REQUANT_V3
  return _mm256_movemask_ps((__m256)m) != 0;
#else
  const u64x4 a = (u64x4)m;
  return ((a[0] | a[1]) | (a[2] | a[3])) != 0;
#endif
}

// hsum's order over the eight chunk lanes a[0..8) of every lane
template <class V>
I4P_V3 V fold8(const V* a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// the queued groups of one row (the row's buffer holds their values until the row's flush, which
// transposes them into xs)
struct Batch {
  int n = 0;
  int64_t j[kLanes];
  const float* x[kLanes];
  float wmin[kLanes], wmax[kLanes];
  double xx[kLanes];
  alignas(32) float xs[kMaxG][kLanes];
  std::vector<float> cand, err, cand2, err2;  // [candidate][lane]
  int64_t decided = 0, handed = 0;  // groups decided here, and sent through element_group
  int64_t evaluated = 0, skipped = 0;  // candidates (eight lanes each) evaluated, and skipped by errors32's bound
};

// whether a job's element groups can go through the batch: the groups of lane_baseline, not forced
// into float64
I4P_INLINE bool usable(const Req& p) { return lane_baseline(p) && !p.search64; }

// xs[t][l] = x[l][t] for t < g (an 8 x 8 transpose of each eight columns)
I4P_V3 void transpose8(float (*xs)[kLanes], const float* const* x, int64_t g) {
  int64_t t = 0;
#ifdef I4P_REQUANT_V3
  for (; t + 8 <= g; t += 8) {
    __m256 r[8], u[8], v[8];
    for (int l = 0; l < 8; ++l) r[l] = _mm256_loadu_ps(x[l] + t);
    for (int l = 0; l < 8; l += 2) {
      u[l] = _mm256_unpacklo_ps(r[l], r[l + 1]);
      u[l + 1] = _mm256_unpackhi_ps(r[l], r[l + 1]);
    }
    for (int l = 0; l < 8; l += 4) {
      v[l] = _mm256_shuffle_ps(u[l], u[l + 2], 0x44);
      v[l + 1] = _mm256_shuffle_ps(u[l], u[l + 2], 0xEE);
      v[l + 2] = _mm256_shuffle_ps(u[l + 1], u[l + 3], 0x44);
      v[l + 3] = _mm256_shuffle_ps(u[l + 1], u[l + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
      _mm256_store_ps(xs[t + i], _mm256_permute2f128_ps(v[i], v[i + 4], 0x20));
      _mm256_store_ps(xs[t + i + 4], _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
    }
  }
#endif
  for (; t < g; ++t)
    for (int l = 0; l < kLanes; ++l) xs[t][l] = x[l][t];
}

// ---- the search

// the float32 error of every lane at scale s (r = 1 / s): the q of qround (x * r clamped only on a
// side some value of the batch reaches: every t in [-8.5, 7.5) rounds into -8..7 by itself, t = 7.5
// would round to 8), the difference q * s - x fused (q * s, or q * sh and q * sl, is exact: it rounds
// once either way), its square fused into the sum
template <bool kLo, bool kHi, bool kSplit>
I4P_V3 v8f sse32(const Batch& b, int64_t g, v8f s, v8f r) {
  const v8f sh = kSplit ? (v8f)((u32x8)s & 0xFFFFFFF0u) : s, sl = s - sh;
  v8f a[4] = {};
  for (int64_t t = 0; t < g; t += 4) {
    for (int u = 0; u < 4; ++u) {
      const v8f x = load8(b.xs[t + u]);
      v8f q = x * r;
      if (kLo) q = vmax(q, splat(-8.0f));
      if (kHi) q = vmin(q, splat(7.0f));
      q = round_even(q);
      v8f d = fmsub(q, sh, x);
      if (kSplit) d = fmadd(q, sl, d);
      a[u] = fmadd(d, d, a[u]);
    }
  }
  return (a[0] + a[1]) + (a[2] + a[3]);
}

// err[c] = the float32 errors of the lanes at the scales cand[c], c < m ([candidate][lane]), the last
// first. A candidate c >= keep that clips some lane's extremes is evaluated only where it might win:
// the clipped extremes alone cost (wmax - 7 s)^2 and (wmin + 8 s)^2 (q clamps to 7 where x r >= 7.5,
// to -8 where x r <= -8.5), a lower bound of its exact error. Where that bound exceeds, in every lane
// of `care`, the clear margin (first_min32's bound) over the least error so far (mn, updated), its
// exact error exceeds the final bound too: no lane can take it, and each lane's decision is clear of
// it, so it is not evaluated and its errors are +inf (groups of 32 never win at 0.70 and rarely at
// 0.76: most batches skip both). The bound is taken 2^-16 low: its own rounding is under 2^-19.
template <bool kSplit>
I4P_V3 void errors32(Batch& b, int64_t g, const float* cand, int m, float* err, int keep, i32x8 care, v8f& mn) {
  const v8f wmin = load8(b.wmin), wmax = load8(b.wmax);
  for (int c = m - 1; c >= 0; --c) {
    const v8f s = load8(cand + kLanes * c);
    const v8f r = splat(1.0f) / s;  // torch: s.reciprocal()
    // x * r is monotonic in x: the group's extremes give its extremes (a NaN clamps)
    const i32x8 clo = ~(wmin * r >= splat(-8.5f)), chi = ~(wmax * r < splat(7.5f));
    const bool lo = any(clo), hi = any(chi);
    if (c >= keep && (lo || hi)) {
      const v8f dh = wmax - splat(7.0f) * s, dl = wmin + splat(8.0f) * s;
      const v8f lb = ((v8f)(chi & (i32x8)(dh * dh)) + (v8f)(clo & (i32x8)(dl * dl))) * splat(1.0f - 0x1p-16f);
      if (!any(care & ~(lb > mn * splat(hist::kClear) + splat(hist::kAbs)))) {
        hist::store8(err + kLanes * c, splat(__builtin_inff()));
        ++b.skipped;
        continue;
      }
    }
    v8f e;
    if (lo && hi) {
      e = sse32<true, true, kSplit>(b, g, s, r);
    } else if (lo) {
      e = sse32<true, false, kSplit>(b, g, s, r);
    } else if (hi) {
      e = sse32<false, true, kSplit>(b, g, s, r);
    } else {
      e = sse32<false, false, kSplit>(b, g, s, r);
    }
    hist::store8(err + kLanes * c, e);
    ++b.evaluated;
    mn = vmin(e, mn);  // a NaN lane (never cared for) keeps mn
  }
}

// the first candidate of the smallest float32 error in every lane: its scale (cw), index (w) and
// error (ew); returns the lanes where that decision is clear
I4P_V3 i32x8 pick(const float* cand, const float* err, int m, v8f& cw, i32x8& w, v8f& ew) {
  static_assert(kLanes == hist::Batch::kLanes, "one lane count for both float32 searches");
  return hist::first_min32(cand, err, m, ~i32x8{}, cw, w, ew);
}

// Decision's search for the batch's lanes in float32: the clear lanes and their scales (b.err's first
// candidate is RTN's: its errors are the lanes' baselines)
template <bool kSplit>
I4P_V3 i32x8 search(const Req& p, Batch& b, int nc, int nf, v8f& best_s) {
  constexpr int L = kLanes;
  const int64_t g = p.g;
  const v8f wmin = load8(b.wmin), wmax = load8(b.wmax);
  const v8f amax = wmax < -wmin ? -wmin : wmax;  // std::max(wmax, -wmin)
  const v8f rtn = amax / splat(7.0f);
  v8f base = wmax / splat(7.0f), b8 = wmin / splat(-8.0f);
  base = base < b8 ? b8 : base;  // std::max(wmax / 7, wmin / -8)
  base = base > splat(0.0f) ? base : splat(1.0f);
  const v8f ratio0 = rtn / base;
  const i32x8 inside = (amax >= splat(kClearMin)) & (amax <= splat(kClearMax));
  float* cand = b.cand.data();
  float* err = b.err.data();
  hist::store8(cand, ship8(p, base * ratio0));
  for (int c = 1; c < nc; ++c) hist::store8(cand + L * c, ship8(p, base * p.coarse[c - 1]));
  v8f mn = splat(__builtin_inff());
  errors32<kSplit>(b, g, cand, nc, err, 1, inside, mn);  // RTN's error always: the baseline
  i32x8 wi;
  v8f ew;
  i32x8 ok = inside & pick(cand, err, nc, best_s, wi, ew);
  if (nf > 0 && nc > 2) {
    v8f rho = ratio0;
    for (int c = 1; c < nc; ++c) rho = wi == c ? splat(p.coarse[c - 1]) : rho;
    float* cand2 = b.cand2.data();
    float* err2 = b.err2.data();
    hist::store8(cand2, best_s);
    hist::store8(err2, ew);
    for (int f = 0; f < nf; ++f) hist::store8(cand2 + L * (f + 1), ship8(p, base * (rho + p.fine[f])));
    v8f mn2 = ew;  // the fine points are skipped against the coarse winner's error
    errors32<kSplit>(b, g, cand2 + L, nf, err2 + L, 0, inside, mn2);
    ok &= pick(cand2, err2, nf + 1, best_s, wi, ew);
  }
  return ok;
}

// ---- each lane's group as element_scan, group_sse and element_finish see it, eight lanes at a time:
// the group's value t = 8c + i, which they take in chunk lane i of a vector, in accumulator i of its
// own lane; their horizontal sums (hsum's order) then fold8 over the accumulators

// element_scan of every lane: its extremes and sum of squares into b.wmin, wmax, xx; the lanes whose
// float32 sum of squares is finite: those whose values are all finite, less any lane so large that
// its squares overflow (amax from about 2^61 on: none is decided here, element_group takes it)
I4P_V3 i32x8 scan8(Batch& b, int64_t g) {
  const int64_t full = g / 8 * 8;
  const v8f first = load8(b.xs[0]);
  v8f lo[8], hi[8], ss[8];
  for (int i = 0; i < 8; ++i) {
    v8f l = first, h = first, a = {};
    for (int64_t t = i; t < full; t += 8) {
      const v8f x = load8(b.xs[t]);
      l = vmin(x, l);
      h = vmax(x, h);
      a += x * x;
    }
    lo[i] = l;
    hi[i] = h;
    ss[i] = a;
  }
  v8f wmin = first, wmax = first, tz = {};
  f64x4 xx0 = {}, xx1 = {};  // the tail in float64, from 0.0
  for (int64_t t = full; t < g; ++t) {
    const v8f x = load8(b.xs[t]);
    wmin = vmin(x, wmin);
    wmax = vmax(x, wmax);
    const f64x4 a = widen_lo(x), c = widen_hi(x);
    xx0 += a * a;
    xx1 += c * c;
    tz += x * splat(0.0f);
  }
  for (int i = 0; i < 8; ++i) {
    wmin = vmin(lo[i], wmin);
    wmax = vmax(hi[i], wmax);
  }
  const v8f sum = fold8(ss);
  tz += sum * splat(0.0f);  // NaN where a square is NaN or infinite
  xx0 += widen_lo(sum);
  xx1 += widen_hi(sum);
  hist::store8(b.wmin, wmin);
  hist::store8(b.wmax, wmax);
  std::memcpy(b.xx, &xx0, sizeof(xx0));
  std::memcpy(b.xx + 4, &xx1, sizeof(xx1));
  const v8f amax = vmax(wmax, -wmin);
  const i32x8 far = (amax != splat(0.0f)) & ~((amax >= splat(1e-18f)) & (amax <= splat(1e17f)));
  if (any(far)) {  // element_scan's sum again in double, past Decision::begin's guard
    for (int l = 0; l < kLanes; ++l) {
      if (!far[l]) continue;
      double xx = 0;
      for (int64_t t = 0; t < g; ++t) xx += static_cast<double>(b.xs[t][l]) * b.xs[t][l];
      b.xx[l] = xx;
    }
  }
  return tz == splat(0.0f);
}

// element_finish's statistics of every lane at scale s: gdd, gvv, gwv, gmax [lane]
struct Sums {
  double dd[kLanes], vv[kLanes], wv[kLanes], mx[kLanes];
};

I4P_V3 void finish8(const Batch& b, int64_t g, v8f s, Sums& o) {
  const v8f rs = splat(1.0f) / s;  // element_finish's 1.0f / best_s
  const v8f sign = (v8f)(i32x8{} + static_cast<int32_t>(0x80000000u));
  const int64_t full = g / 8 * 8;
  v8f add[8], avv[8], awv[8], amx[8];
  for (int i = 0; i < 8; ++i) {
    v8f a = {}, vv = {}, wv = {}, mx = {};
    for (int64_t t = i; t < full; t += 8) {
      const v8f x = load8(b.xs[t]);
      const v8f v = qround8(x * rs) * s;  // torch: dequantize_w4a8, then v - w in float
      const v8f d = v - x;
      a += d * d;
      vv += v * v;
      wv += v * x;
      mx = vmax((v8f)((i32x8)d & ~(i32x8)sign), mx);  // |d| (a zero's sign aside: it never is the max)
    }
    add[i] = a;
    avv[i] = vv;
    awv[i] = wv;
    amx[i] = mx;
  }
  // the tail in float64, from 0.0, then the float32 sums added (element_finish's order)
  f64x4 dd[2] = {}, vv[2] = {}, wv[2] = {}, mx[2] = {};
  for (int64_t t = full; t < g; ++t) {
    const v8f x = load8(b.xs[t]);
    const v8f v = qround8(x * rs) * s, d = v - x, ad = (v8f)((i32x8)d & ~(i32x8)sign);
    const f64x4 xd[2] = {widen_lo(x), widen_hi(x)}, vd[2] = {widen_lo(v), widen_hi(v)};
    const f64x4 e[2] = {widen_lo(d), widen_hi(d)}, a[2] = {widen_lo(ad), widen_hi(ad)};
    for (int h = 0; h < 2; ++h) {
      dd[h] += e[h] * e[h];
      vv[h] += vd[h] * vd[h];
      wv[h] += vd[h] * xd[h];
      mx[h] = a[h] > mx[h] ? a[h] : mx[h];
    }
  }
  v8f m = amx[0];
  for (int i = 1; i < 8; ++i) m = vmax(amx[i], m);  // the largest |d| is the largest in any order
  const v8f sd = fold8(add), sv = fold8(avv), sw = fold8(awv);
  const f64x4 fd[2] = {widen_lo(sd), widen_hi(sd)}, fv[2] = {widen_lo(sv), widen_hi(sv)};
  const f64x4 fw[2] = {widen_lo(sw), widen_hi(sw)}, fm[2] = {widen_lo(m), widen_hi(m)};
  for (int h = 0; h < 2; ++h) {
    const f64x4 a = dd[h] + fd[h], v = vv[h] + fv[h], w = wv[h] + fw[h], x = fm[h] > mx[h] ? fm[h] : mx[h];
    std::memcpy(o.dd + 4 * h, &a, sizeof(a));
    std::memcpy(o.vv + 4 * h, &v, sizeof(v));
    std::memcpy(o.wv + 4 * h, &w, sizeof(w));
    std::memcpy(o.mx + 4 * h, &x, sizeof(x));
  }
}

// element_finish's q of one group at 1 / s = rs, written 32 codes at a time: the low byte of
// clamp(x * rs) + 1.5 * 2^23 is qround's integer in two's complement
I4P_V3 void store_q(int8_t* qg, const float* x, int64_t g, float rs) {
  const v8f vr = splat(rs), mg = splat(kMagic);
  int64_t t = 0;
  for (; t + 32 <= g; t += 32) {
    u8x32 m[4];
    for (int c = 0; c < 4; ++c) m[c] = (u8x32)(vmin(splat(7.0f), vmax(splat(-8.0f), load8(x + t + 8 * c) * vr)) + mg);
    const u8x32 a = I4P_SHUF8(m[0], m[1], 0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60,
                              0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const u8x32 c = I4P_SHUF8(m[2], m[3], 0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60,
                              0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    std::memcpy(qg + t, &a, 16);
    std::memcpy(qg + t + 16, &c, 16);
  }
  for (; t < g; ++t) qg[t] = static_cast<int8_t>(qround1(x[t] * rs));
}

// the row's queued groups: scanned, searched here, then finished in their order (the row's
// statistics add up in the same order as element_group's); a group not decided here (not clear,
// or not finite: element_group marks it) goes through element_group
I4P_V3 void flush(const Req& p, Search& w, Batch& b, int64_t r) {
  if (b.n == 0) return;
  const int64_t g = p.g, groups = p.k / g;
  alignas(32) static const float kZeros[kMaxG] = {};
  for (int l = b.n; l < kLanes; ++l) b.x[l] = kZeros;  // unused lanes: zero groups (never clear: not inside)
  transpose8(b.xs, b.x, g);
  const i32x8 finite = scan8(b, g);
  for (int l = 0; l < kLanes; ++l) {
    if (!finite[l]) b.wmin[l] = b.wmax[l] = 0.0f;  // a zero group: not decided here
  }
  const size_t a = static_cast<size_t>(w.nc) * kLanes, c = static_cast<size_t>(w.nf + 1) * kLanes;
  if (b.cand.size() < a) b.cand.resize(a), b.err.resize(a);
  if (b.cand2.size() < c) b.cand2.resize(c), b.err2.resize(c);
  v8f best_s;
  const i32x8 ok = finite & (p.bf16 ? search<false>(p, b, w.nc, w.nf, best_s) : search<true>(p, b, w.nc, w.nf, best_s));
  const float* base = b.err.data();  // candidate 0 (RTN): the baseline (lane_sse32, as element_group takes it)
  Sums st;
  if (any(ok)) finish8(b, g, best_s, st);
  ReqRow acc{p.rowstats + r * 6};
  for (int l = 0; l < b.n; ++l) {
    const int64_t j = b.j[l];
    if (ok[l]) {
      store_q(p.q + r * p.k + j * g, b.x[l], g, 1.0f / best_s[l]);
      acc.add(0, st.dd[l], b.xx[l], st.vv[l], st.wv[l], base[l], st.mx[l]);
      p.s[r * groups + j] = best_s[l];
      p.flags[r * groups + j] = 0;
      ++b.decided;
    } else {
      element_group(p, w, r, j, b.x[l], acc);
      ++b.handed;
    }
  }
  b.n = 0;
}

// group j of row r (values at xg, alive until the row's flush) into the batch; every group of the
// row goes through here, in order
I4P_V3 void add(const Req& p, Search& w, Batch& b, int64_t r, int64_t j, const float* xg) {
  const int l = b.n++;
  b.j[l] = j;
  b.x[l] = xg;
  if (b.n == kLanes) flush(p, w, b, r);
}

#undef I4P_V3

}  // namespace elem32
}  // namespace i4p
