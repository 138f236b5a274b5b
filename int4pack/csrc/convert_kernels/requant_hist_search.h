// The histogram evaluation's search (see requant_hist.h): a batch of 8 groups decided lane by
// lane as Decision decides one group, in float32 where the decision is clear, else in float64;
// then each group's q from a 16-entry table and its statistics.
#pragma once

#include "requant_hist.h"

namespace i4p {
namespace hist {

typedef double f64x4 __attribute__((vector_size(32)));
typedef int64_t i64x4 __attribute__((vector_size(32)));

I4P_INLINE f64x4 load4d(const double* p) {
  f64x4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// the 8 lanes of two 4-lane masks (or small integers) as 32-bit lanes
I4P_INLINE i32x8 narrow(i64x4 a, i64x4 b) {
  return I4P_SHUF(i32x8, (i32x8)a, (i32x8)b, 0, 2, 4, 6, 8, 10, 12, 14);
}

// TieRule::pick in every lane of [candidate][lane] arrays: the winner's scale, its index in w and
// its error in ew, close calls or'ed into amb. The float64 steps run on 4-lane halves (an 8-lane
// select of doubles is split lane by lane by GCC)
I4P_INLINE v8f pick8(const TieRule& tie, const float* cand, const double* err, int m, i32x8& w, double* ew,
                     i32x8& amb) {
  constexpr int L = Batch::kLanes;
  f64x4 mn[2] = {load4d(err), load4d(err + 4)};
  for (int c = 1; c < m; ++c) {
    for (int h = 0; h < 2; ++h) {
      const f64x4 e = load4d(err + L * c + 4 * h);
      mn[h] = e < mn[h] ? e : mn[h];
    }
  }
  f64x4 t[2], hi[2], ewh[2] = {};
  i64x4 found[2] = {}, wh[2] = {}, a[2];
  for (int h = 0; h < 2; ++h) {
    t[h] = mn[h] * (1.0 + kTie);
    hi[h] = t[h] * (1.0 + tie.a4);
    for (int c = 0; c < m; ++c) {
      const f64x4 e = load4d(err + L * c + 4 * h);
      i64x4 take = (e <= t[h]) & ~found[h];
      if (c == m - 1) take = ~found[h];
      ewh[h] = take ? e : ewh[h];
      wh[h] = take ? i64x4{} + c : wh[h];
      found[h] |= take;
    }
    a[h] = ewh[h] > t[h] * (1.0 - tie.a4);
  }
  std::memcpy(ew, ewh, sizeof(ewh));
  w = narrow(wh[0], wh[1]);
  v8f cw = load8(cand);
  for (int c = 1; c < m; ++c) cw = w == c ? load8(cand + L * c) : cw;
  i32x8 am = narrow(a[0], a[1]);
  for (int c = 0; c < m; ++c) {
    const i32x8 near = narrow(load4d(err + L * c) < hi[0], load4d(err + L * c + 4) < hi[1]);
    am |= (i32x8{} + c < w) & (load8(cand + L * c) != cw) & near;
  }
  amb |= tie.never ? ~i32x8{} : am;
  return cw;
}

// ---- the search in float32, where its decision is clear
//
// The decision needs the order of the candidates' exact errors E only where two scales' errors lie
// within kTie of each other (TieRule). In float32 (8 lanes an instruction, no conversions) each
// lane's error e lies within 20 u E + 2^-122 of E (u = 2^-24, see batch_sse32). So where every
// candidate with another scale than the smallest e's has e > min e * kClear + kAbs, the exact errors
// of those scales exceed the winner's by more than 2^-19 relative: no tie rule or summation order
// (torch's included) picks another scale, and the first candidate of the winner's scale is the
// decision. A batch where some lane is not that clear, or holds a group outside [2^-40, 2^40]
// (where the bounds need not hold), runs the float64 search instead (search below).
constexpr float kClear = 1.0f + 0x1p-16f;
constexpr float kAbs = 0x1p-120f;

// batch_sse in float32. d = (q * sh - x) + q * sl with sh = s less its 4 low mantissa bits, sl =
// s - sh: both products are exact (|q| <= 8), and q * sh - x is exact where the two lie within a
// factor 2 of each other (Sterbenz: q = 0 gives -x; an unclamped q, or a clamped one with |x| <=
// 12.6 s, see TieRule), else its rounding is relative to a difference larger than half of either:
// d is within 3 u |d|. Squares, weights and the 16 sums add 17 u (whatever the compiler fuses
// into FMAs only drops roundings); with amax in [2^-40, 2^40], underflow adds at most 2^-122 and
// nothing overflows.
I4P_INLINE v8f batch_sse32(const Batch& b, const v8f* wf, v8f s) {
  const v8f r = splat(1.0f) / s;  // torch: s.reciprocal()
  const v8f lo = load8(b.qlo), hi = load8(b.qhi), mg = splat(kMagic);
  const v8f sh = (v8f)((u32x8)s & 0xFFFFFFF0u), sl = s - sh;
  v8f a0 = {}, a1 = {};
  for (int c = 0; c < 16; c += 2) {
    const v8f xa = load8(b.xs[c]), xb = load8(b.xs[c + 1]);
    v8f qa = xa * r, qb = xb * r;
    qround2(qa, qb, lo, hi, mg);
    const v8f da = (qa * sh - xa) + qa * sl, db = (qb * sh - xb) + qb * sl;
    a0 += da * da * wf[c];
    a1 += db * db * wf[c + 1];
  }
  return a0 + a1;
}

// the first candidate of the smallest float32 error err[0..m) ([candidate][lane]) in every lane: its
// scale (cw), index (w) and error (ew); returns the lanes of ``clear`` where that decision is clear
// (every other candidate equal in scale or worse by more than float32 rounding can explain)
I4P_INLINE i32x8 first_min32(const float* cand, const float* err, int m, i32x8 clear, v8f& cw, i32x8& w, v8f& ew) {
  constexpr int L = Batch::kLanes;
  v8f mn = load8(err);
  for (int c = 1; c < m; ++c) mn = load8(err + L * c) < mn ? load8(err + L * c) : mn;
  i32x8 found = {};
  w = i32x8{};
  cw = load8(cand);
  for (int c = 0; c < m; ++c) {
    const i32x8 take = (load8(err + L * c) == mn) & ~found;
    w = take ? i32x8{} + c : w;
    cw = take ? load8(cand + L * c) : cw;
    found |= take;
  }
  const v8f bound = mn * splat(kClear) + splat(kAbs);
  for (int c = 0; c < m; ++c) clear &= (load8(cand + L * c) == cw) | (load8(err + L * c) > bound);
  ew = mn;
  return clear;
}

// first_min32 over the lanes inside; false when a lane is neither clear and inside nor zero (whose
// decision is moot)
I4P_INLINE bool pick32(const float* cand, const float* err, int m, i32x8 inside, i32x8 zero, v8f& cw, i32x8& w,
                       v8f& ew) {
  const u64x4 all = (u64x4)(first_min32(cand, err, m, inside, cw, w, ew) | zero);
  return ((all[0] & all[1]) & (all[2] & all[3])) == ~0ull;
}

// search's candidates, evaluated in float32; false (and nothing decided) where a lane is not clear
I4P_INLINE bool search32(const Req& p, Search& w, const Batch& b, v8f base, v8f ratio0, i32x8 inside, i32x8 zero,
                         v8f& best_s) {
  constexpr int L = Batch::kLanes;
  const int nc = w.nc, nf = w.nf;
  v8f wf[16];
  for (int c = 0; c < 16; ++c) wf[c] = load8(b.wf[c]);
  float* cand = w.bcand.data();  // [candidate][lane]
  float* err = w.berr32.data();
  store8(cand, ship8(p, base * ratio0));
  for (int c = 1; c < nc; ++c) store8(cand + L * c, ship8(p, base * p.coarse[c - 1]));
  for (int c = 0; c < nc; ++c) store8(err + L * c, batch_sse32(b, wf, load8(cand + L * c)));
  i32x8 wi;
  v8f ew;
  if (!pick32(cand, err, nc, inside, zero, best_s, wi, ew)) return false;
  if (nf > 0 && nc > 2) {
    v8f rho = ratio0;
    for (int c = 1; c < nc; ++c) rho = wi == c ? splat(p.coarse[c - 1]) : rho;
    float* cand2 = w.bcand2.data();
    float* err2 = w.berr32b.data();
    store8(cand2, best_s);
    store8(err2, ew);
    for (int f = 0; f < nf; ++f) {
      const v8f s = ship8(p, base * (rho + p.fine[f]));
      store8(cand2 + L * (f + 1), s);
      store8(err2 + L * (f + 1), batch_sse32(b, wf, s));
    }
    if (!pick32(cand2, err2, nf + 1, inside, zero, best_s, wi, ew)) return false;
  }
  return true;
}

// the float64 search of the batch's lanes (TieRule's decision; close calls or'ed into amb)
I4P_INLINE void search64(const Req& p, Search& w, const Batch& b, v8f base, v8f ratio0, v8f& best_s, f64x8& base_e,
                         i32x8& amb) {
  constexpr int L = Batch::kLanes;
  const int nc = w.nc, nf = w.nf;
  float* cand = w.bcand.data();  // [candidate][lane]
  double* err = w.berr.data();
  store8(cand, ship8(p, base * ratio0));
  for (int c = 1; c < nc; ++c) store8(cand + L * c, ship8(p, base * p.coarse[c - 1]));
  for (int c = 0; c < nc; ++c) store8d(err + L * c, batch_sse(b, load8(cand + L * c)));
  base_e = load8d(err);
  i32x8 wi;
  double* err2 = w.berr2.data();  // its first row: the coarse winner's error
  best_s = pick8(w.tie, cand, err, nc, wi, err2, amb);
  if (nf > 0 && nc > 2) {
    v8f rho = ratio0;
    for (int c = 1; c < nc; ++c) rho = wi == c ? splat(p.coarse[c - 1]) : rho;
    // the coarse winner first, then the fine candidates (Decision::coarse)
    float* cand2 = w.bcand2.data();
    store8(cand2, best_s);
    for (int f = 0; f < nf; ++f) store8(cand2 + L * (f + 1), ship8(p, base * (rho + p.fine[f])));
    for (int f = 0; f < nf; ++f) store8d(err2 + L * (f + 1), batch_sse(b, load8(cand2 + L * (f + 1))));
    alignas(64) double ew[L];
    best_s = pick8(w.tie, cand2, err2, nf + 1, wi, ew, amb);
  }
}

// Decision (the scalar search of the element path) for the batch's groups, a group in each lane:
// the same operations lane by lane, the same results
I4P_INLINE void search(const Req& p, Search& w, Batch& b, float* best, double* base_out, uint8_t* flags) {
  constexpr int L = Batch::kLanes;
  for (int l = b.n; l < L; ++l) {  // unused lanes: zero groups, finite throughout
    b.z[l] = b.s[l] = b.fill[l] = 0.0f;
    for (int v = 0; v < 16; ++v) b.wf[v][l] = 0.0f;
  }
  v8f wmin, wmax;
  values(p, b, wmin, wmax);
  const v8f amax = wmax < -wmin ? -wmin : wmax;  // std::max(wmax, -wmin)
  const i32x8 zero = amax == splat(0.0f);
  const v8f rtn = amax / splat(7.0f);
  // far outside any real weight (the exactness argument of TieRule needs normal floats): torch decides
  const i32x8 guard = ~zero & ((amax < splat(1e-18f)) | (amax > splat(1e17f)));
  v8f best_s;
  f64x8 base_e;
  i32x8 amb = {};
  if (!p.search) {
    best_s = ship8(p, rtn);
    widen(b);
    base_e = batch_sse(b, best_s);
  } else {
    v8f base = wmax / splat(7.0f), b8 = wmin / splat(-8.0f);
    base = base < b8 ? b8 : base;  // std::max(wmax / 7, wmin / -8)
    base = base > splat(0.0f) ? base : splat(1.0f);
    const v8f ratio0 = rtn / base;
    const i32x8 inside = (amax >= splat(kClearMin)) & (amax <= splat(kClearMax));
    if (!p.search64 && !w.tie.never && search32(p, w, b, base, ratio0, inside, zero, best_s)) {
      // cand[0] is the RTN scale: its float32 error is the baseline's (reported only; within 2^-19)
      base_e = __builtin_convertvector(load8(w.berr32.data()), f64x8);
      ++w.batches32;
    } else {
      widen(b);
      search64(p, w, b, base, ratio0, best_s, base_e, amb);
      ++w.batches64;
    }
  }
  best_s = zero ? splat(1.0f) : best_s;
  amb &= ~zero;
  const i32x8 fl = (zero & static_cast<int32_t>(kZero)) | ((amb | guard) & static_cast<int32_t>(kAmbiguous));
  std::memcpy(best, &best_s, sizeof(best_s));
  store8d(base_out, base_e);
  for (int l = 0; l < L; ++l) flags[l] = static_cast<uint8_t>(fl[l]);
}

// the batch's searches, then each group's q and statistics
I4P_INLINE void run(const Req& p, Search& w, Batch& b) {
  const int64_t k = p.k, g = p.g, groups = k / g;
  alignas(32) float best[Batch::kLanes];
  alignas(64) double base_e[Batch::kLanes];
  uint8_t flags[Batch::kLanes];
  search(p, w, b, best, base_e, flags);
  const v8f iota = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f};
  for (int i = 0; i < b.n; ++i) {
    if (b.bad[i]) continue;
    const int64_t r = b.r[i], j = b.j[i];
    ReqRow acc{p.rowstats + r * 6};
    const float best_s = best[i];
    const uint8_t flag = flags[i];
    // the group's values as lane_values makes them, codes in lanes
    const v8f c0 = load8(b.cnt[i]), c1 = load8(b.cnt[i] + 8);
    const v8f vz = splat(b.z[i]), vs = splat(b.s[i]), fill = splat(b.fill[i]);
    const v8f x0 = c0 == splat(0.0f) ? fill : (iota - vz) * vs;
    const v8f x1 = c1 == splat(0.0f) ? fill : ((iota + splat(8.0f)) - vz) * vs;
    const f64x8 w0 = __builtin_convertvector(c0, f64x8), w1 = __builtin_convertvector(c1, f64x8);
    // the final q of each code, and the statistics against the float source
    const float rs = 1.0f / best_s;
    const v8f vrs = splat(rs), vb = splat(best_s), mg = splat(kMagic);
    const v8f m0 = qclamp(x0 * vrs) + mg, m1 = qclamp(x1 * vrs) + mg;  // q in the low mantissa bits
    const v8f u0 = m0 - mg, u1 = m1 - mg;  // = qround(x * rs)
    const v8f v0 = u0 * vb, v1 = u1 * vb;  // torch: dequantize_w4a8, then v - w in float
    const v8f d0 = v0 - x0, d1 = v1 - x1;
    const f64x8 e0 = __builtin_convertvector(d0, f64x8), e1 = __builtin_convertvector(d1, f64x8);
    const f64x8 t0 = __builtin_convertvector(v0, f64x8), t1 = __builtin_convertvector(v1, f64x8);
    const f64x8 y0 = __builtin_convertvector(x0, f64x8), y1 = __builtin_convertvector(x1, f64x8);
    const v8f a0 = (v8f)((u32x8)d0 & 0x7FFFFFFFu), a1 = (v8f)((u32x8)d1 & 0x7FFFFFFFu);  // |d|
    double gdd, gvv, gwv;
    hsum3(e0 * e0 * w0 + e1 * e1 * w1, t0 * t0 * w0 + t1 * t1 * w1, t0 * y0 * w0 + t1 * y1 * w1, gdd, gvv, gwv);
    acc.add(flag, gdd, hsum8(y0 * y0 * w0 + y1 * y1 * w1), gvv, gwv, base_e[i], hmax(a0 > a1 ? a0 : a1));
    // code -> q table: the low byte of each lane of m0, m1 (q + 1.5 * 2^23 holds q in two's complement)
    const u8x32 tb = I4P_SHUF8((u8x32)m0, (u8x32)m1, 0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56,
                               60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    u8x16 lut;
    std::memcpy(&lut, &tb, sizeof(lut));
    const uint8_t* c = p.codes + (r - p.codes_r0) * k + j * g;
    int8_t* qg = p.q + r * k + j * g;
    int64_t t = 0;
#if defined(__GNUC__) && !defined(__clang__)
    for (; t + 16 <= g; t += 16) {
      u8x16 cv;
      std::memcpy(&cv, c + t, 16);
      const u8x16 o = __builtin_shuffle(lut, cv);  // o[l] = lut[cv[l] & 15]; every code is <= 15 here
      std::memcpy(qg + t, &o, 16);
    }
#endif
    for (; t < g; ++t) qg[t] = static_cast<int8_t>(lut[c[t]]);
    p.s[r * groups + j] = best_s;
    p.flags[r * groups + j] = flag;
  }
  b.n = 0;
}

}  // namespace hist
}  // namespace i4p
