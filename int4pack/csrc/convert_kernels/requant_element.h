// The requant search's element evaluation: any float group, one value at a time (a float
// source, a g_idx, a target group across source groups, a code above 15). See requant_search.h;
// requant_element32.h searches eight such groups side by side in float32 first.
#pragma once

#include "requant_search.h"

namespace i4p {

namespace elem32 {

constexpr int64_t kMaxG = 128;  // elem32's bounds hold for groups of at most this many values

// the groups elem32 searches (the float32 batches of requant_element32.h): a search of groups of at
// most kMaxG values, a multiple of 4 (its accumulators). Their baseline error (plain RTN's, reported
// only) is the float32 error of elem32::sse32 at the RTN scale, wherever the group is decided, so
// that a batch does not sum it again in float64: lane_sse32.
I4P_INLINE bool lane_baseline(const Req& p) { return p.search && p.g <= kMaxG && p.g % 4 == 0; }

// one lane of elem32::sse32 (same operations, same order): the float32 error of the g values at xg
// at scale s, s split into sh + sl where the scale is not bf16. Fused where sse32 fuses (its
// fmsub / fmadd are FMA instructions on x86-64-v3, a product and a sum elsewhere).
I4P_INLINE float lane_sse32(const float* xg, int64_t g, float s, bool split) {
#ifdef I4P_REQUANT_V3
  const auto fma = [](float a, float b, float c) I4P_LAMBDA_INLINE { return std::fma(a, b, c); };
#else
  const auto fma = [](float a, float b, float c) I4P_LAMBDA_INLINE { return a * b + c; };
#endif
  const float r = 1.0f / s;
  uint32_t u;
  std::memcpy(&u, &s, 4);
  u &= 0xFFFFFFF0u;
  float sh = s;
  if (split) std::memcpy(&sh, &u, 4);
  const float sl = s - sh;
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t t = 0; t < g; t += 4) {
    for (int k = 0; k < 4; ++k) {
      const float x = xg[t + k], q = qround1(x * r);  // sse32 clamps only where a lane needs it: the same q
      float d = fma(q, sh, -x);
      if (split) d = fma(q, sl, d);
      a[k] = fma(d, d, a[k]);
    }
  }
  return (a[0] + a[1]) + (a[2] + a[3]);
}

}  // namespace elem32

// one pass over a group of the element path: its extremes, its sum of squares (float64, as the
// statistics take it) and whether every value is finite
I4P_INLINE bool element_scan(const float* xg, int64_t g, float& wmin_out, float& wmax_out, double& xx_out) {
  v8f lo = splat(xg[0]), hi = lo, ss = {}, nanchk = {};
  float wmin = xg[0], wmax = xg[0], chk = 0.0f;
  double xx = 0;
  int64_t i = 0;
  for (; i + 8 <= g; i += 8) {
    const v8f v = load8(xg + i);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
    ss += v * v;
    nanchk += v * splat(0.0f);
  }
  for (; i < g; ++i) {
    const float v = xg[i];
    wmin = v < wmin ? v : wmin;
    wmax = v > wmax ? v : wmax;
    xx += static_cast<double>(v) * v;
    chk += v * 0.0f;
  }
  for (int l = 0; l < 8; ++l) {
    wmin = lo[l] < wmin ? lo[l] : wmin;
    wmax = hi[l] > wmax ? hi[l] : wmax;
    chk += nanchk[l];
  }
  xx += hsum(ss);
  if (!(chk == 0.0f)) return false;
  {
    // past the guard of Decision::begin the float32 squares under/overflow: the sum again in double
    // (torch decides such a group, but ww is taken from here)
    const float amax = std::max(wmax, -wmin);
    if (amax != 0.0f && !(amax >= 1e-18f && amax <= 1e17f)) {
      xx = 0;
      for (int64_t t = 0; t < g; ++t) xx += static_cast<double>(xg[t]) * xg[t];
    }
  }
  wmin_out = wmin;
  wmax_out = wmax;
  xx_out = xx;
  return true;
}

// a group's final q at scale best_s, and its statistics against the float source
I4P_INLINE void element_finish(const Req& p, int64_t r, int64_t j, const float* xg, float best_s, uint8_t flag,
                               double base_e, double xx, ReqRow& acc) {
  const int64_t k = p.k, g = p.g, groups = k / g;
  const float rs = 1.0f / best_s;
  int8_t* qg = p.q + r * k + j * g;
  double gdd = 0, gvv = 0, gwv = 0, gmax = 0;
  const v8f vrs = splat(rs), vb = splat(best_s);
  v8f add = {}, avv = {}, awv = {}, amx = {};
  int64_t t = 0;
  for (; t + 8 <= g; t += 8) {
    const v8f x0 = load8(xg + t);
    const v8f u = qround(x0 * vrs);
    for (int l = 0; l < 8; ++l) qg[t + l] = static_cast<int8_t>(u[l]);
    const v8f v = u * vb;  // torch: dequantize_w4a8, then v - w in float
    const v8f d = v - x0;
    add += d * d;
    avv += v * v;
    awv += v * x0;
    const v8f ad = d < splat(0.0f) ? -d : d;
    amx = ad > amx ? ad : amx;
  }
  for (; t < g; ++t) {
    const float u = qround1(xg[t] * rs);
    qg[t] = static_cast<int8_t>(u);
    const float v = u * best_s, d = v - xg[t];
    gdd += static_cast<double>(d) * d;
    gvv += static_cast<double>(v) * v;
    gwv += static_cast<double>(v) * xg[t];
    gmax = std::max(gmax, static_cast<double>(std::fabs(d)));
  }
  gdd += hsum(add);
  gvv += hsum(avv);
  gwv += hsum(awv);
  for (int l = 0; l < 8; ++l) gmax = std::max(gmax, static_cast<double>(amx[l]));
  acc.add(flag, gdd, xx, gvv, gwv, base_e, gmax);
  p.s[r * groups + j] = best_s;
  p.flags[r * groups + j] = flag;
}

// one group of the element path: any float group, one value at a time
I4P_INLINE void element_group(const Req& p, Search& w, int64_t r, int64_t j, const float* xg, ReqRow& acc) {
  const int64_t g = p.g;
  float wmin, wmax;
  double xx;
  if (!element_scan(xg, g, wmin, wmax, xx)) {
    non_finite_group(p, r, j);
    return;
  }
  Decision& dec = w.d;
  const float best_s = w.decide(p, dec, wmin, wmax, [&](const float* cand, double* err, int m)
                                                            I4P_LAMBDA_INLINE {
    for (int i = 0; i < m; ++i) err[i] = group_sse(xg, g, cand[i]);
  });
  double base_e = dec.base_e;
  const float amax = std::max(wmax, -wmin);
  if (elem32::lane_baseline(p) && amax >= kClearMin && amax <= kClearMax)
    base_e = elem32::lane_sse32(xg, g, dec.cand[0], !p.bf16);
  element_finish(p, r, j, xg, best_s, dec.flag, base_e, xx, acc);
}

}  // namespace i4p
