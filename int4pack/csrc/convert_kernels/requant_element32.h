// The element path's search, eight groups side by side in float32 (a float source: bf16, FP8, FP4,
// MLX and GGUF values). element_group evaluates each candidate of one group in float64, a value at
// a time, and sums across lanes: 13 such passes per group of 32 were most of a float source's
// convert. Here the groups of a row are transposed eight at a time into a Batch (value t of group
// l at xs[t][l]) and every candidate is evaluated for the eight in float32, without a horizontal
// sum, as hist::search32 does for codes. The decision is taken from those errors only where it is
// clear by a margin that covers their rounding (below); a group that is not clear, zero, outside
// [2^-40, 2^40], or holds a NaN goes through element_group as before. A group decided here gets
// the same scale, q, flags and statistics as element_group gives it (the baseline error is
// element_group's own float64 sum at the RTN candidate): only the work differs.
//
// The bound: with s split into sh (s less its 4 low mantissa bits) and sl = s - sh, q * sh and
// q * sl are exact (|q| <= 8), so d = (q * sh - x) + q * sl is within 3 u |d| (u = 2^-24; see
// hist::batch_sse32), its square within 7 u, and four accumulators of at most kMaxG / 4 = 32 terms
// each, then their sum, add 33 u: each error e lies within b = 40 u E + 2^-122 of the exact E. A
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
constexpr int64_t kMaxG = 128;  // the bound above holds for groups of at most this many values

// the queued groups of one row (the row's buffer holds their values until the row's flush)
struct Batch {
  int n = 0;
  int64_t j[kLanes];
  const float* x[kLanes];
  float wmin[kLanes], wmax[kLanes];
  double xx[kLanes];
  alignas(32) float xs[kMaxG][kLanes];
  std::vector<float> cand, err, cand2, err2;  // [candidate][lane]
  int64_t decided = 0, handed = 0;  // groups decided here, and sent through element_group
};

// whether a job's element groups can go through the batch: a search of groups of at most kMaxG
// values, a multiple of 4 (the accumulators), not forced into float64
I4P_INLINE bool usable(const Req& p) { return p.search && !p.search64 && p.g <= kMaxG && p.g % 4 == 0; }

template <bool kSplit>
I4P_INLINE v8f sse32(const Batch& b, int64_t g, v8f s) {
  const v8f r = splat(1.0f) / s;  // torch: s.reciprocal()
  const v8f sh = kSplit ? (v8f)((u32x8)s & 0xFFFFFFF0u) : s, sl = s - sh;
  v8f a[4] = {};
  for (int64_t t = 0; t < g; t += 4) {
    for (int u = 0; u < 4; ++u) {
      const v8f x = load8(b.xs[t + u]);
      const v8f q = qround(x * r);
      const v8f d = kSplit ? (q * sh - x) + q * sl : q * s - x;
      a[u] += d * d;
    }
  }
  return (a[0] + a[1]) + (a[2] + a[3]);
}

#ifdef I4P_REQUANT_V3
// sse32 in AVX2/FMA instructions (GCC builds none from vector code under -ffp-contract=off). The
// same q: x * r, clamped where some value of the batch reaches a bound (round gives -8..7 by itself
// to every t in [-8.5, 7.5): t = 7.5 would round to 8), rounded to nearest even. The differences
// q * s - x (q * sh - x, + q * sl) fused: q * s is exact, so the fused difference rounds once, as
// the plain one does. The square fused into the sum: one rounding fewer than sse32, inside the bound
// above. So the errors differ from sse32's only within that bound: the decisions taken are the same.
template <bool kLo, bool kHi, bool kSplit>
I4P_REQUANT_TARGET I4P_INLINE __m256 sse32_v3(const Batch& b, int64_t g, __m256 s, __m256 r) {
  const __m256 sh = kSplit ? _mm256_and_ps(s, _mm256_castsi256_ps(_mm256_set1_epi32(~0xF))) : s;
  const __m256 sl = _mm256_sub_ps(s, sh), lo = _mm256_set1_ps(-8.0f), hi = _mm256_set1_ps(7.0f);
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t t = 0; t < g; t += 4) {
    for (int u = 0; u < 4; ++u) {
      const __m256 x = _mm256_load_ps(b.xs[t + u]);
      __m256 q = _mm256_mul_ps(x, r);
      if (kLo) q = _mm256_max_ps(q, lo);
      if (kHi) q = _mm256_min_ps(q, hi);
      q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m256 d = _mm256_fmsub_ps(q, sh, x);
      if (kSplit) d = _mm256_fmadd_ps(q, sl, d);
      a[u] = _mm256_fmadd_ps(d, d, a[u]);
    }
  }
  return _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
}

template <bool kSplit>
I4P_REQUANT_TARGET __attribute__((noinline)) void errors32_v3(const Batch& b, int64_t g, const float* cand, int m,
                                                               float* err) {
  const __m256 wmin = _mm256_loadu_ps(b.wmin), wmax = _mm256_loadu_ps(b.wmax);
  for (int c = 0; c < m; ++c) {
    const __m256 s = _mm256_loadu_ps(cand + kLanes * c);
    const __m256 r = _mm256_div_ps(_mm256_set1_ps(1.0f), s);  // torch: s.reciprocal()
    // x * r is monotonic in x: the group's extremes give its extremes
    const bool lo = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_mul_ps(wmin, r), _mm256_set1_ps(-8.5f), _CMP_NGE_UQ));
    const bool hi = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_mul_ps(wmax, r), _mm256_set1_ps(7.5f), _CMP_NLT_UQ));
    __m256 e;
    if (lo && hi) {
      e = sse32_v3<true, true, kSplit>(b, g, s, r);
    } else if (lo) {
      e = sse32_v3<true, false, kSplit>(b, g, s, r);
    } else if (hi) {
      e = sse32_v3<false, true, kSplit>(b, g, s, r);
    } else {
      e = sse32_v3<false, false, kSplit>(b, g, s, r);
    }
    _mm256_storeu_ps(err + kLanes * c, e);
  }
}
#endif

// err[c] = the float32 errors of the lanes at the scales cand[c], c < m ([candidate][lane])
template <bool kSplit>
I4P_INLINE void errors32(const Batch& b, int64_t g, const float* cand, int m, float* err) {
#ifdef I4P_REQUANT_V3
  errors32_v3<kSplit>(b, g, cand, m, err);
#else
  for (int c = 0; c < m; ++c) hist::store8(err + kLanes * c, sse32<kSplit>(b, g, load8(cand + kLanes * c)));
#endif
}

// the first candidate of the smallest float32 error in every lane: its scale (cw), index (w) and
// error (ew); returns the lanes where that decision is clear
I4P_INLINE i32x8 pick(const float* cand, const float* err, int m, v8f& cw, i32x8& w, v8f& ew) {
  static_assert(kLanes == hist::Batch::kLanes, "one lane count for both float32 searches");
  return hist::first_min32(cand, err, m, ~i32x8{}, cw, w, ew);
}

// Decision's search for the batch's lanes in float32: the clear lanes, their scales, and the RTN
// candidate of each lane (cand0)
template <bool kSplit>
I4P_INLINE i32x8 search(const Req& p, Batch& b, int nc, int nf, v8f& best_s, v8f& cand0) {
  constexpr int L = kLanes;
  const int64_t g = p.g;
  const v8f wmin = load8(b.wmin), wmax = load8(b.wmax);
  const v8f amax = wmax < -wmin ? -wmin : wmax;  // std::max(wmax, -wmin)
  const v8f rtn = amax / splat(7.0f);
  v8f base = wmax / splat(7.0f), b8 = wmin / splat(-8.0f);
  base = base < b8 ? b8 : base;  // std::max(wmax / 7, wmin / -8)
  base = base > splat(0.0f) ? base : splat(1.0f);
  const v8f ratio0 = rtn / base;
  const i32x8 inside = (amax >= splat(hist::kClearMin)) & (amax <= splat(hist::kClearMax));
  float* cand = b.cand.data();
  float* err = b.err.data();
  cand0 = ship8(p, base * ratio0);
  hist::store8(cand, cand0);
  for (int c = 1; c < nc; ++c) hist::store8(cand + L * c, ship8(p, base * p.coarse[c - 1]));
  errors32<kSplit>(b, g, cand, nc, err);
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
    errors32<kSplit>(b, g, cand2 + L, nf, err2 + L);
    ok &= pick(cand2, err2, nf + 1, best_s, wi, ew);
  }
  return ok;
}

// ---- a decided lane's outputs, eight lanes at a time: the same operations, in the same order, as
// group_sse (the baseline error) and element_finish (q, statistics) run on one group, the group's
// value t of chunk lane i (t = 8c + i) now in accumulator i of its own lane

typedef float v4f __attribute__((vector_size(16)));
using hist::f64x4;

// the eight lanes as two halves of doubles
I4P_INLINE void widen2(v8f v, f64x4& lo, f64x4& hi) {
  v4f a, b;
  std::memcpy(&a, &v, sizeof(a));
  std::memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof(a), sizeof(b));
  lo = __builtin_convertvector(a, f64x4);
  hi = __builtin_convertvector(b, f64x4);
}

// hsum's order over the eight chunk lanes a[0..8) of every lane
template <class V>
I4P_INLINE V fold8(const V* a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// group_sse(lane l's values, g, s[l]) for every lane into out[l]
I4P_INLINE void base8(const Batch& b, int64_t g, v8f s, double* out) {
  const v8f r = splat(1.0f) / s;  // group_sse's 1.0f / s
  f64x4 sl, sh;
  widen2(s, sl, sh);
  const int64_t full = g / 8 * 8;
  f64x4 lo[8], hi[8];
  for (int i = 0; i < 8; ++i) {
    f64x4 a0 = {}, a1 = {};
    for (int64_t t = i; t < full; t += 8) {
      const v8f x = load8(b.xs[t]);
      f64x4 q0, q1, x0, x1;
      widen2(qround(x * r), q0, q1);
      widen2(x, x0, x1);
      const f64x4 d0 = q0 * sl - x0, d1 = q1 * sh - x1;
      a0 += d0 * d0;
      a1 += d1 * d1;
    }
    lo[i] = a0;
    hi[i] = a1;
  }
  f64x4 t0 = {}, t1 = {};  // group_sse's tail, from 0.0
  for (int64_t t = full; t < g; ++t) {
    const v8f x = load8(b.xs[t]);
    f64x4 q0, q1, x0, x1;
    widen2(qround(x * r), q0, q1);
    widen2(x, x0, x1);
    const f64x4 d0 = q0 * sl - x0, d1 = q1 * sh - x1;
    t0 += d0 * d0;
    t1 += d1 * d1;
  }
  const f64x4 e0 = fold8(lo) + t0, e1 = fold8(hi) + t1;
  std::memcpy(out, &e0, sizeof(e0));
  std::memcpy(out + 4, &e1, sizeof(e1));
}

// element_finish's statistics of every lane at scale s: gdd, gvv, gwv, gmax [lane]
struct Sums {
  double dd[kLanes], vv[kLanes], wv[kLanes], mx[kLanes];
};

I4P_INLINE void finish8(const Batch& b, int64_t g, v8f s, Sums& o) {
  const v8f rs = splat(1.0f) / s;  // element_finish's 1.0f / best_s
  const int64_t full = g / 8 * 8;
  v8f add[8], avv[8], awv[8], amx[8];
  for (int i = 0; i < 8; ++i) {
    v8f a = {}, vv = {}, wv = {}, mx = {};
    for (int64_t t = i; t < full; t += 8) {
      const v8f x = load8(b.xs[t]);
      const v8f v = qround(x * rs) * s;  // torch: dequantize_w4a8, then v - w in float
      const v8f d = v - x;
      a += d * d;
      vv += v * v;
      wv += v * x;
      const v8f ad = d < splat(0.0f) ? -d : d;
      mx = ad > mx ? ad : mx;
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
    const v8f v = qround(x * rs) * s, d = v - x;
    f64x4 xd[2], vd[2], dd2[2], ad[2];
    widen2(x, xd[0], xd[1]);
    widen2(v, vd[0], vd[1]);
    widen2(d, dd2[0], dd2[1]);
    widen2(d < splat(0.0f) ? -d : d, ad[0], ad[1]);
    for (int h = 0; h < 2; ++h) {
      dd[h] += dd2[h] * dd2[h];
      vv[h] += vd[h] * vd[h];
      wv[h] += vd[h] * xd[h];
      mx[h] = ad[h] > mx[h] ? ad[h] : mx[h];
    }
  }
  v8f m = amx[0];
  for (int i = 1; i < 8; ++i) m = amx[i] > m ? amx[i] : m;  // the largest |d| is the largest in any order
  f64x4 sd[2], sv[2], sw[2], sm[2];
  widen2(fold8(add), sd[0], sd[1]);
  widen2(fold8(avv), sv[0], sv[1]);
  widen2(fold8(awv), sw[0], sw[1]);
  widen2(m, sm[0], sm[1]);
  for (int h = 0; h < 2; ++h) {
    const f64x4 a = dd[h] + sd[h], v = vv[h] + sv[h], w = wv[h] + sw[h], x = sm[h] > mx[h] ? sm[h] : mx[h];
    std::memcpy(o.dd + 4 * h, &a, sizeof(a));
    std::memcpy(o.vv + 4 * h, &v, sizeof(v));
    std::memcpy(o.wv + 4 * h, &w, sizeof(w));
    std::memcpy(o.mx + 4 * h, &x, sizeof(x));
  }
}

// element_finish's q of one group at 1 / s = rs, written 32 codes at a time: the low byte of
// clamp(x * rs) + 1.5 * 2^23 is qround's integer in two's complement
I4P_INLINE void store_q(int8_t* qg, const float* x, int64_t g, float rs) {
  const v8f vr = splat(rs), mg = splat(kMagic);
  int64_t t = 0;
  for (; t + 32 <= g; t += 32) {
    u8x32 m[4];
    for (int c = 0; c < 4; ++c) m[c] = (u8x32)(hist::qclamp(load8(x + t + 8 * c) * vr) + mg);
    const u8x32 a = I4P_SHUF8(m[0], m[1], 0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60,
                              0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const u8x32 c = I4P_SHUF8(m[2], m[3], 0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60,
                              0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    std::memcpy(qg + t, &a, 16);
    std::memcpy(qg + t + 16, &c, 16);
  }
  for (; t < g; ++t) qg[t] = static_cast<int8_t>(qround1(x[t] * rs));
}

// the row's queued groups: searched here, then finished in their order (the row's statistics add
// up in the same order as element_group's); a group not decided here goes through element_group
I4P_INLINE void flush(const Req& p, Search& w, Batch& b, int64_t r) {
  if (b.n == 0) return;
  const int64_t g = p.g, groups = p.k / g;
  for (int l = b.n; l < kLanes; ++l) {  // unused lanes: zero groups (never clear: not inside)
    b.wmin[l] = b.wmax[l] = 0.0f;
    for (int64_t t = 0; t < g; ++t) b.xs[t][l] = 0.0f;
  }
  const size_t a = static_cast<size_t>(w.nc) * kLanes, c = static_cast<size_t>(w.nf + 1) * kLanes;
  if (b.cand.size() < a) b.cand.resize(a), b.err.resize(a);
  if (b.cand2.size() < c) b.cand2.resize(c), b.err2.resize(c);
  v8f best_s, cand0;
  const i32x8 ok = p.bf16 ? search<false>(p, b, w.nc, w.nf, best_s, cand0)
                          : search<true>(p, b, w.nc, w.nf, best_s, cand0);
  alignas(32) double base[kLanes];
  Sums st;
  const u64x4 any = (u64x4)ok;
  if ((any[0] | any[1]) | (any[2] | any[3])) {
    base8(b, g, cand0, base);  // the baseline: element_group's float64 error at the RTN candidate
    finish8(b, g, best_s, st);
  }
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

// group j of row r (values at xg, alive until the row's flush) into the batch, or through
// element_group at once where the batch cannot decide it; every group of the row goes through
// here, in order
I4P_INLINE void add(const Req& p, Search& w, Batch& b, int64_t r, int64_t j, const float* xg) {
  float wmin, wmax;
  double xx;
  if (!element_scan(xg, p.g, wmin, wmax, xx)) {  // element_group marks it (after the queued ones)
    flush(p, w, b, r);
    ReqRow acc{p.rowstats + r * 6};
    element_group(p, w, r, j, xg, acc);
    ++b.handed;
    return;
  }
  const int l = b.n++;
  b.j[l] = j;
  b.x[l] = xg;
  b.wmin[l] = wmin;
  b.wmax[l] = wmax;
  b.xx[l] = xx;
  for (int64_t t = 0; t < p.g; ++t) b.xs[t][l] = xg[t];
  if (b.n == kLanes) flush(p, w, b, r);
}

}  // namespace elem32
}  // namespace i4p
