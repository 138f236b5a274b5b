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

#include "convert_kernels.h"

namespace i4p {

constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: (t + kMagic) - kMagic rounds half to even, |t| <= 2^22
constexpr float kTiny = 1.1754943508222875e-38f;  // 2^-126, scale_search.TINY
constexpr double kU = 0x1p-53;  // float64 unit roundoff
constexpr uint8_t kAmbiguous = 1, kNonFinite = 2, kZero = 4;

// histogram batches searched in float32 and in float64 (hist::search), for tests and benchmarks;
// g_search64 forces the float64 search (tests compare both with the oracle)
std::atomic<int64_t> g_batches32{0}, g_batches64{0};
std::atomic<bool> g_search64{false};

// ------------------------------------------------------------------------------------ requant

struct Req {
  const float* w = nullptr;  // float source [N, K], or
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

// ---- element evaluation: any float group (float source, g_idx, a group spanning source groups)

I4P_INLINE void element_group(const Req& p, Search& w, int64_t r, int64_t j, const float* xg, ReqRow& acc) {
  const int64_t k = p.k, g = p.g, groups = k / g;
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
  if (!(chk == 0.0f)) {
    non_finite_group(p, r, j);
    return;
  }
  {
    // past the guard of Decision::begin the float32 squares under/overflow: the sum again in double
    // (torch decides such a group, but ww is taken from here)
    const float amax = std::max(wmax, -wmin);
    if (amax != 0.0f && !(amax >= 1e-18f && amax <= 1e17f)) {
      xx = 0;
      for (int64_t t = 0; t < g; ++t) xx += static_cast<double>(xg[t]) * xg[t];
    }
  }
  Decision& dec = w.d;
  const float best_s = w.decide(p, dec, wmin, wmax, [&](const float* cand, double* err, int m)
                                                            I4P_LAMBDA_INLINE {
    for (int i = 0; i < m; ++i) err[i] = group_sse(xg, g, cand[i]);
  });
  const double base_e = dec.base_e;
  const uint8_t flag = dec.flag;
  // final q, and the statistics against the float source
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

// ---- histogram evaluation: int4 codes, the group inside one source group
//
// Such a group holds at most 16 distinct values x_c = (c - z) * s, so every candidate's error is
// sum_c count[c] * d_c^2 with d_c the exact float64 difference the element loop computes for x_c.
// The weighted sum rounds differently from the element loop's (and torch's) sum, within the
// bound of TieRule, which still guards every decision. The final q is a 16-entry table code -> q.

namespace hist {

typedef uint8_t u8x32_unaligned __attribute__((vector_size(32), aligned(1)));

// the table tricks below read bytes of wider lanes: little-endian only (else the element path)
constexpr bool kEnabled = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;

#if defined(__clang__)
#define I4P_UNROLL16 _Pragma("unroll 16")
#else
#define I4P_UNROLL16 _Pragma("GCC unroll 16")
#endif

// four rounds of "interleave two vectors, add" (bytes, pairs, quads, halves; each 128-bit half
// on its own, as the unpack instructions work) sum 16 vectors across the bytes of each half
I4P_INLINE u8x32 zip8(u8x32 a, u8x32 b) { return lo8(a, b) + hi8(a, b); }
I4P_INLINE u8x32 zip16(u8x32 a, u8x32 b) { return lo16(a, b) + hi16(a, b); }
I4P_INLINE u8x32 zip32(u8x32 a, u8x32 b) { return lo32(a, b) + hi32(a, b); }
I4P_INLINE u8x32 zip64(u8x32 a, u8x32 b) { return lo64(a, b) + hi64(a, b); }

// byte v of each 128-bit half: how many of the 32 * M bytes at c equal v (M <= 4: every count
// <= 128 fits a byte); orv collects the bits of every byte (codes above 15 are caught later).
// keys[v] holds 32 bytes v (from memory: GCC builds constant ones with broadcasts, and spills them)
template <int M>
I4P_INLINE u8x32 count_block(const uint8_t* c, const uint8_t (*keys)[32], u8x32& orv) {
  u8x32 ch[M];
  for (int t = 0; t < M; ++t) {
    ch[t] = *reinterpret_cast<const u8x32_unaligned*>(c + 32 * t);
    orv |= ch[t];
  }
  u8x32 a[16];
  for (int v = 0; v < 16; ++v) {
    const u8x32 key = *reinterpret_cast<const u8x32_unaligned*>(keys[v]);
    u8x32 n = {};
    for (int t = 0; t < M; ++t) n -= (u8x32)(ch[t] == key);  // a match is -1
    a[v] = n;
  }
  u8x32 b[8], q[4], h[2];
  for (int i = 0; i < 8; ++i) b[i] = zip8(a[2 * i], a[2 * i + 1]);  // byte 2m + t (per half): a[2i + t]
  for (int i = 0; i < 4; ++i) q[i] = zip16(b[2 * i], b[2 * i + 1]);  // byte 4m + t: a[4i + t]
  for (int i = 0; i < 2; ++i) h[i] = zip32(q[2 * i], q[2 * i + 1]);  // byte 8m + t: a[8i + t]
  const u8x32 r = zip64(h[0], h[1]);  // byte t of each half: that half's count of code t
  return r + I4P_SHUF8(r, r, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
                       0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

// count_block's bytes (both halves alike) as float lanes: codes 0..7 and 8..15
I4P_INLINE void counts_float(u8x32 w, v8f& c0, v8f& c1) {
  const u8x32 low = (u8x32)(i32x8{} + 0xFF);
  const u8x32 b0 = I4P_SHUF8(w, w, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                             20, 20, 20, 20, 21, 21, 21, 21, 22, 22, 22, 22, 23, 23, 23, 23);
  const u8x32 b1 = I4P_SHUF8(w, w, 8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11,
                             28, 28, 28, 28, 29, 29, 29, 29, 30, 30, 30, 30, 31, 31, 31, 31);
  c0 = __builtin_convertvector((i32x8)(b0 & low), v8f);
  c1 = __builtin_convertvector((i32x8)(b1 & low), v8f);
}

// how many of c[0..n) equal each code (float lanes, codes 0..7 and 8..15); false when some
// code is above 15
I4P_INLINE bool count_codes(const uint8_t* c, int64_t n, const uint8_t (*keys)[32], v8f& c0, v8f& c1) {
  u8x32 orv = {};
  c0 = c1 = v8f{};
  int64_t i = 0;
  auto add = [&](u8x32 w) I4P_LAMBDA_INLINE {
    v8f a, b;
    counts_float(w, a, b);
    c0 += a;
    c1 += b;
  };
  if (n == 128) {  // the usual target group, without the loops
    add(count_block<4>(c, keys, orv));
    i = 128;
  }
  for (; i + 128 <= n; i += 128) add(count_block<4>(c + i, keys, orv));
  switch ((n - i) / 32) {
    case 3: add(count_block<3>(c + i, keys, orv)); i += 96; break;
    case 2: add(count_block<2>(c + i, keys, orv)); i += 64; break;
    case 1: add(count_block<1>(c + i, keys, orv)); i += 32; break;
    default: break;
  }
  uint32_t ors = 0;
  for (; i < n; ++i) {
    ors |= c[i];
    if (c[i] < 8) {
      c0[c[i]] += 1.0f;
    } else if (c[i] < 16) {
      c1[c[i] - 8] += 1.0f;
    }
  }
  const u64x4 o = (u64x4)orv;
  return (((o[0] | o[1]) | (o[2] | o[3])) & 0xF0F0F0F0F0F0F0F0ull) == 0 && (ors & 0xF0u) == 0;
}

I4P_INLINE float hmax(v8f a) {
  v8f b = I4P_SHUF(i32x8, a, a, 4, 5, 6, 7, 0, 1, 2, 3);
  a = a > b ? a : b;
  b = I4P_SHUF(i32x8, a, a, 2, 3, 0, 1, 6, 7, 4, 5);
  a = a > b ? a : b;
  b = I4P_SHUF(i32x8, a, a, 1, 0, 3, 2, 5, 4, 7, 6);
  a = a > b ? a : b;
  return a[0];
}
#ifdef I4P_HAS_SHUFFLEVECTOR
typedef double f64x4 __attribute__((vector_size(32)));
typedef double f64x2 __attribute__((vector_size(16)));
// in halves as vectors: picking lanes one by one costs twice the instructions
I4P_INLINE double hsum8(f64x8 a) {
  const f64x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f64x2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
}
// the three sums at once
I4P_INLINE void hsum3(f64x8 a, f64x8 b, f64x8 c, double& sa, double& sb, double& sc) {
  const f64x4 a4 = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f64x4 b4 = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  const f64x4 c4 = __builtin_shufflevector(c, c, 0, 1, 2, 3) + __builtin_shufflevector(c, c, 4, 5, 6, 7);
  // [a0 + a1, b0 + b1, a2 + a3, b2 + b3] and [c0 + c1, c0 + c1, c2 + c3, c2 + c3]
  const f64x4 ab = __builtin_shufflevector(a4, b4, 0, 4, 2, 6) + __builtin_shufflevector(a4, b4, 1, 5, 3, 7);
  const f64x4 cc = c4 + __builtin_shufflevector(c4, c4, 1, 0, 3, 2);
  const f64x4 t = __builtin_shufflevector(ab, cc, 0, 1, 4, 5) + __builtin_shufflevector(ab, cc, 2, 3, 6, 7);
  sa = t[0];
  sb = t[1];
  sc = t[2];
}
#else
I4P_INLINE double hsum8(f64x8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }
I4P_INLINE void hsum3(f64x8 a, f64x8 b, f64x8 c, double& sa, double& sb, double& sc) {
  sa = hsum8(a);
  sb = hsum8(b);
  sc = hsum8(c);
}
#endif

I4P_INLINE v8f qclamp(v8f t) {
  const v8f lo = splat(-8.0f), hi = splat(7.0f);
  t = t < lo ? lo : t;
  return t > hi ? hi : t;
}

// 8 groups side by side, one in each lane, for the search (every step of it is then vector work
// over the groups, where one group alone is a chain of scalar steps). prepare() stores what each
// group is (counts of its codes, zero point, scale); values() builds the lanes from them for the
// whole batch at once (building them group by group was a fifth of the requant time, most of it
// scalar stores into the lanes). The value of code c is x_c = (c - z) * s; an absent code takes a
// present code's value (count 0), so that every lane is finite when the group is
struct Batch {
  static constexpr int kLanes = 8;
  int n = 0;
  int64_t r[kLanes], j[kLanes];  // the groups (of any rows)
  // (plain arrays: see Search::bcand)
  float cnt[kLanes][16];  // count of each code
  float z[kLanes], s[kLanes], fill[kLanes];  // zero point, scale, the first code's value
  bool bad[kLanes];  // a group holding a NaN/Inf: handled by values(), nothing left to write
  float wf[16][kLanes];  // counts, groups in lanes
  float xs[16][kLanes];  // x_c, groups in lanes
  double xd[16][kLanes];  // both in float64, for the float64 search only (widen)
  double ws[16][kLanes];
  // -8 and 7 for qround, read from memory: GCC 12 clamps to a constant with a compare and a blend
  // each, to a loaded bound with one vmaxps / vminps (the same values: t < lo ? lo : t)
  float qlo[kLanes], qhi[kLanes];
  uint8_t keys[16][32];  // keys[v]: 32 bytes v, for count_block (also read from memory on purpose)
  Batch() {
    for (int l = 0; l < kLanes; ++l) {
      qlo[l] = -8.0f;
      qhi[l] = 7.0f;
    }
    for (int v = 0; v < 16; ++v) std::memset(keys[v], v, sizeof(keys[v]));
  }
};

I4P_INLINE f64x8 load8d(const double* p) {
  f64x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
I4P_INLINE void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
I4P_INLINE void store8d(double* p, f64x8 v) { std::memcpy(p, &v, sizeof(v)); }

// qround of two vectors, with the bounds lo, hi (from Batch::qlo / qhi) and kMagic in mg
I4P_INLINE void qround2(v8f& ta, v8f& tb, v8f lo, v8f hi, v8f mg) {
  ta = ta < lo ? lo : ta;
  tb = tb < lo ? lo : tb;
  ta = ta > hi ? hi : ta;
  tb = tb > hi ? hi : tb;
  ta = (ta + mg) - mg;
  tb = (tb + mg) - mg;
}

// sum over each lane's group of (s * clamp(round(x / s)) - x)^2 at that lane's scale s: group_sse's
// float64 difference of each code (q from float32), squared and weighted by its count
I4P_INLINE f64x8 batch_sse(const Batch& b, v8f s) {
  const v8f r = splat(1.0f) / s;  // torch: s.reciprocal()
  const v8f lo = load8(b.qlo), hi = load8(b.qhi), mg = splat(kMagic);
  const f64x8 sd = __builtin_convertvector(s, f64x8);
  f64x8 a0 = {}, a1 = {};
  // unrolled: GCC keeps a 64-byte vector carried around a loop in memory (AVX2 has 32 bytes)
  I4P_UNROLL16
  for (int c = 0; c < 16; c += 2) {
    const v8f xa = load8(b.xs[c]), xb = load8(b.xs[c + 1]);
    v8f ta = xa * r, tb = xb * r;
    qround2(ta, tb, lo, hi, mg);
    const f64x8 qa = __builtin_convertvector(ta, f64x8), qb = __builtin_convertvector(tb, f64x8);
    const f64x8 ea = qa * sd - load8d(b.xd[c]), eb = qb * sd - load8d(b.xd[c + 1]);
    a0 += ea * ea * load8d(b.ws[c]);
    a1 += eb * eb * load8d(b.ws[c + 1]);
  }
  return a0 + a1;
}

enum Prepared { kQueued, kElements };

// group j of row r from its codes: its histogram, zero point and scale into lane b.n (kQueued);
// kElements for a code above 15
I4P_INLINE Prepared prepare(const Req& p, Batch& b, int64_t r, int64_t j, int64_t sg) {
  const int64_t k = p.k, g = p.g;
  const uint8_t* c = p.codes + (r - p.codes_r0) * k + j * g;
  v8f c0, c1;
  if (!count_codes(c, g, b.keys, c0, c1)) return kElements;
  const float zz = p.zeros ? static_cast<float>(p.zeros[r * p.src_groups + sg]) : 8.0f;
  const float sj = p.sscale[r * p.src_groups + sg];
  const int l = b.n++;
  b.r[l] = r;
  b.j[l] = j;
  b.z[l] = zz;
  b.s[l] = sj;
  b.fill[l] = (static_cast<float>(c[0]) - zz) * sj;  // the first code is present
  b.bad[l] = false;
  store8(b.cnt[l], c0);
  store8(b.cnt[l] + 8, c1);
  for (int v = 0; v < 8; ++v) {
    b.wf[v][l] = c0[v];
    b.wf[v + 8][l] = c1[v];
  }
  return kQueued;
}

// x_c of code c (0..15) of every lane: (codes.float() - z) * s, an absent code's the fill
I4P_INLINE v8f lane_values(const Batch& b, int c, v8f vz, v8f vs, v8f fill) {
  return load8(b.wf[c]) == splat(0.0f) ? fill : (splat(static_cast<float>(c)) - vz) * vs;
}

// the lanes' values xs, and their min and max over each group. A group holding a NaN/Inf is
// handled here (non_finite_group) and its lane becomes a zero group that run() skips
I4P_INLINE void values(const Req& p, Batch& b, v8f& wmin, v8f& wmax) {
  const v8f vz = load8(b.z), vs = load8(b.s), fill = load8(b.fill);
  v8f mn = fill, mx = fill, fin = {};
  for (int c = 0; c < 16; ++c) {
    const v8f x = lane_values(b, c, vz, vs, fill);
    store8(b.xs[c], x);
    mn = x < mn ? x : mn;
    mx = x > mx ? x : mx;
    fin += x * splat(0.0f);  // NaN where some value is not finite
  }
  if (!(hsum(fin) == 0.0f)) {
    for (int l = 0; l < b.n; ++l) {
      if (fin[l] == 0.0f) continue;
      non_finite_group(p, b.r[l], b.j[l]);
      b.bad[l] = true;
      mn[l] = mx[l] = 0.0f;
      for (int c = 0; c < 16; ++c) b.xs[c][l] = b.wf[c][l] = 0.0f;
    }
  }
  wmin = mn;
  wmax = mx;
}

// xd and ws, for the float64 search
I4P_INLINE void widen(Batch& b) {
  for (int c = 0; c < 16; ++c) {
    store8d(b.xd[c], __builtin_convertvector(load8(b.xs[c]), f64x8));
    store8d(b.ws[c], __builtin_convertvector(load8(b.wf[c]), f64x8));
  }
}

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
constexpr float kClearMin = 0x1p-40f, kClearMax = 0x1p40f;

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

// the winner of float32 errors err[0..m) ([candidate][lane]) in every lane: its scale, index (w)
// and error (ew); false when a lane is neither clear and inside nor zero (whose decision is moot)
I4P_INLINE bool pick32(const float* cand, const float* err, int m, i32x8 inside, i32x8 zero, v8f& cw, i32x8& w,
                       v8f& ew) {
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
  i32x8 clear = inside;
  for (int c = 0; c < m; ++c) clear &= (load8(cand + L * c) == cw) | (load8(err + L * c) > bound);
  ew = mn;
  const u64x4 all = (u64x4)(clear | zero);
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

#undef I4P_UNROLL16

}  // namespace hist

// x86-64 (GCC): requant_rows is built for x86-64-v3 (AVX2, FMA, BMI2) only, not as target clones:
// the baseline SSE2 clone of its 32-byte vector code was 0.5 MB of code that took GCC 57 of the
// file's 70 s to compile. requant_supported() says whether this CPU runs it; where not (x86-64
// CPUs from before 2013), the callers take the pure-torch requant.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define I4P_REQUANT_V3 1
#define I4P_REQUANT_TARGET __attribute__((target("arch=x86-64-v3")))
#else
#define I4P_REQUANT_TARGET
#endif

bool requant_supported() {
#ifdef I4P_REQUANT_V3
  static const bool ok = __builtin_cpu_supports("x86-64-v3");
  return ok;
#else
  return true;
#endif
}

I4P_REQUANT_TARGET void requant_rows(const Req& p, int64_t r0, int64_t r1) {
  const int64_t k = p.k, g = p.g, groups = k / g;
  // the histogram evaluation takes the codes of a group lying in one source group; whatever
  // else (float source, g_idx, a group across source groups, a code above 15) is dequantised
  std::vector<uint8_t> inside(groups, 0);
  bool all_inside = hist::kEnabled && p.codes != nullptr && p.gidx == nullptr;
  for (int64_t j = 0; j < groups && all_inside; ++j)
    inside[j] = (j * g) / p.src_group == ((j + 1) * g - 1) / p.src_group;
  for (int64_t j = 0; j < groups; ++j) all_inside = all_inside && inside[j];
  std::vector<float> row(k);
  Search w(p);
  hist::Batch batch;  // filled across rows: a row of 6 groups (K = 768) would leave lanes idle
  static_assert(hist::Batch::kLanes == Search::kSlots, "one batch, one lane a group");
  for (int64_t r = r0; r < r1; ++r) {
    float* x = row.data();
    if (p.w) {
      std::memcpy(x, p.w + r * k, k * sizeof(float));
    } else if (!all_inside) {
      dequant_range(p, r, 0, k, x);
    }
    ReqRow acc{p.rowstats + r * 6};
    for (int i = 0; i < 6; ++i) acc.st[i] = 0.0;
    for (int64_t j = 0; j < groups; ++j) {
      if (inside[j]) {
        const hist::Prepared st = hist::prepare(p, batch, r, j, (j * g) / p.src_group);
        if (st != hist::kElements) {
          if (batch.n == Search::kSlots) hist::run(p, w, batch);
          continue;
        }
        if (all_inside) dequant_range(p, r, j * g, (j + 1) * g, x);
      }
      element_group(p, w, r, j, x + j * g, acc);
    }
  }
  if (batch.n > 0) hist::run(p, w, batch);
  g_batches32 += w.batches32;
  g_batches64 += w.batches64;
}


// The requant path in one call (twin: w4a8._requant_torch after w4a8.check_scales): the checks of
// the source scales, the codes unpacked from the packed words 64 rows at a time into a buffer
// that stays in cache (or the codes, or float values, as given), the scale search, the error sums.
int64_t requant_job(const JobArgs& a, int8_t* q, float* s, uint8_t* flags, double* tot, int64_t* counts,
                    int64_t* report, int64_t threads) {
  I4P_CHECK(requant_supported(), "requant_job: this CPU lacks AVX2/FMA (x86-64-v3)");
  check_job(a, kFloat, "requant_job");
  const int64_t n = a.n, k = a.k, g = a.g, layout = a.layout;
  bool zero_seen = false;
  if (layout != kFloat) {
    const int64_t st = check_source_scales(a, report, zero_seen);
    if (st != kDone) return st;
  }
  Req p;
  p.n = n;
  p.k = k;
  if (layout == kFloat) {
    p.w = static_cast<const float*>(a.data);
  } else {
    p.sscale = a.sscale;
    p.src_groups = a.src_groups;
    p.zeros = a.zeros;
    p.gidx = a.gidx;
    p.src_group = a.gidx ? 1 : a.src_group;
  }
  p.g = g;
  p.bf16 = a.bf16 != 0;
  p.search = a.search != 0;
  p.search64 = g_search64.load();
  p.coarse.assign(a.coarse, a.coarse + a.n_coarse);
  p.fine.assign(a.fine, a.fine + a.n_fine);
  p.q = q;
  p.s = s;
  p.flags = flags;
  std::vector<double> rowstats(n * 6);
  p.rowstats = rowstats.data();
  std::vector<int64_t> erased(zero_seen ? n : 0, -1);
  for_rows((n + kJobRows - 1) / kJobRows, 1, threads, [&](int64_t b0, int64_t b1) {
    Req pb = p;
    const bool packed = layout != kCodes && layout != kFloat;
    std::vector<uint8_t> buf(packed ? kJobRows * k : 0);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * kJobRows, r1 = std::min(n, r0 + kJobRows);
      if (layout == kCodes) {
        pb.codes = static_cast<const uint8_t*>(a.data);
      } else if (packed) {
        unpack_block(a, r0, r1, buf.data());
        pb.codes = buf.data();
        pb.codes_r0 = r0;
      }
      if (zero_seen) {
        for (int64_t r = r0; r < r1; ++r) erased[r] = erased_in_row(a, r, pb.codes + (r - pb.codes_r0) * k, -1);
      }
      requant_rows(pb, r0, r1);
    }
  });
  for (int64_t r = 0; r < static_cast<int64_t>(erased.size()); ++r) {
    if (erased[r] >= 0) {
      report[0] = r;
      report[1] = erased[r];
      report[2] = 0;
      return kScaleErases;
    }
  }
  const int64_t nf = n * (k / g);
  int64_t zero_groups = 0, close_calls = 0;
  for (int64_t i = 0; i < nf; ++i) {
    if (flags[i] & kNonFinite) {
      report[0] = i / (k / g);
      report[1] = i % (k / g);
      report[2] = 0;
      return kWeightNotFinite;
    }
    zero_groups += (flags[i] & kZero) != 0;
    close_calls += (flags[i] & kAmbiguous) != 0;
  }
  for (int i = 0; i < 6; ++i) tot[i] = 0.0;
  for (int64_t r = 0; r < n; ++r) {
    for (int i = 0; i < 5; ++i) tot[i] += rowstats[r * 6 + i];
    tot[5] = std::max(tot[5], rowstats[r * 6 + 5]);
  }
  counts[0] = zero_groups;
  counts[1] = close_calls;
  return kDone;
}


void search_batches(int64_t* out) {
  out[0] = g_batches32.load();
  out[1] = g_batches64.load();
}

bool force_search64(bool on) { return g_search64.exchange(on); }

}  // namespace i4p
