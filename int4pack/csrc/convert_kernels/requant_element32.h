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
  for (int c = 0; c < nc; ++c) hist::store8(err + L * c, sse32<kSplit>(b, g, load8(cand + L * c)));
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
    for (int f = 0; f < nf; ++f) {
      const v8f s = ship8(p, base * (rho + p.fine[f]));
      hist::store8(cand2 + L * (f + 1), s);
      hist::store8(err2 + L * (f + 1), sse32<kSplit>(b, g, s));
    }
    ok &= pick(cand2, err2, nf + 1, best_s, wi, ew);
  }
  return ok;
}

// the row's queued groups: searched here, then finished in their order (the row's statistics add
// up in the same order as element_group's); a group not decided here goes through element_group
I4P_INLINE void flush(const Req& p, Search& w, Batch& b, int64_t r) {
  if (b.n == 0) return;
  const int64_t g = p.g;
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
  ReqRow acc{p.rowstats + r * 6};
  for (int l = 0; l < b.n; ++l) {
    if (ok[l]) {
      element_finish(p, r, b.j[l], b.x[l], best_s[l], 0, group_sse(b.x[l], g, cand0[l]), b.xx[l], acc);
      ++b.decided;
    } else {
      element_group(p, w, r, b.j[l], b.x[l], acc);
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
