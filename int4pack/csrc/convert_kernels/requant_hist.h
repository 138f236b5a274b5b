// The requant search's histogram evaluation: int4 codes, the group inside one source group.
//
// Such a group holds at most 16 distinct values x_c = (c - z) * s, so every candidate's error is
// sum_c count[c] * d_c^2 with d_c the exact float64 difference the element loop computes for x_c.
// The weighted sum rounds differently from the element loop's (and torch's) sum, within the
// bound of TieRule, which still guards every decision. The final q is a 16-entry table code -> q.
//
// This header: a group's codes counted, 8 groups side by side in a Batch, their values in
// lanes; requant_hist_search.h searches the batch.
#pragma once

#include "requant_search.h"

namespace i4p {
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
// whole batch at once (group by group, they would be built by scalar stores into the lanes). The value of code c is x_c = (c - z) * s; an absent code takes a
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

#undef I4P_UNROLL16

}  // namespace hist
}  // namespace i4p
