// Hot loops of `int4pack convert` (issue 5): nibble unpacking, the lossless int8 re-emit with
// its error statistics, and the requantisation scale search.
//
// Every function here has a pure-torch twin (int4pack/formats/_common.py, int4pack/w4a8.py) that
// stays the oracle: tests/test_kernels.py compares the bytes.
//
// The requant search follows w4a8._search_chunk candidate for candidate: the same float32
// operations produce the same candidate scales and the same q. The one thing that cannot be
// copied is the order in which torch sums each candidate's squared error (it depends on the
// CPU's vector width), so a decision is taken here only when the two errors compared differ by
// more than a rigorous bound on the rounding of either sum; a group where some comparison is
// closer than that is flagged (bit 0 of `flags`) and the caller redoes it with the torch code.
// The result is then byte-identical to the oracle whatever torch's summation order is.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// an AVX2/FMA build of the heavy loops next to the baseline one, picked at load time
#define I4P_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define I4P_CLONES
#endif

constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: (t + kMagic) - kMagic rounds half to even, |t| <= 2^22
constexpr float kTiny = 1.1754943508222875e-38f;  // 2^-126, w4a8.TINY
constexpr double kU = 5.9604644775390625e-08;  // 2^-24, float32 unit roundoff
constexpr uint8_t kAmbiguous = 1, kNonFinite = 2, kZero = 4;

template <class F>
void for_rows(int64_t n, int64_t grain, int64_t threads, const F& f) {
  if (threads <= 1 || n <= grain) {
    f(0, n);
  } else {
    at::parallel_for(0, n, grain, f);
  }
}

// byte i of the result = nibble i of w
inline uint64_t spread_nibbles(uint32_t w) {
  uint64_t v = w;
  v = (v | (v << 16)) & 0x0000FFFF0000FFFFull;
  v = (v | (v << 8)) & 0x00FF00FF00FF00FFull;
  v = (v | (v << 4)) & 0x0F0F0F0F0F0F0F0Full;
  return v;
}

void check_words(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2, what, ": expected a 2-D tensor");
  TORCH_CHECK(t.scalar_type() == at::kInt, what, ": expected int32 words");
  TORCH_CHECK(t.is_contiguous(), what, ": expected a contiguous tensor");
}

// ------------------------------------------------------------------------------------ unpacking

// GPTQ qweight [K/8, N], packed along K -> codes uint8 [N, K]
at::Tensor unpack_gptq(const at::Tensor& qweight, int64_t threads) {
  check_words(qweight, "qweight");
  const int64_t kw = qweight.size(0), n = qweight.size(1), k = kw * 8;
  auto out = at::empty({n, k}, at::kByte);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>());
  uint8_t* o = out.data_ptr<uint8_t>();
  constexpr int64_t NB = 64;
  for_rows((n + NB - 1) / NB, 1, threads, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * NB, r1 = std::min(n, r0 + NB);
      for (int64_t j = 0; j < kw; ++j) {
        const uint32_t* src = w + j * n;
        for (int64_t r = r0; r < r1; ++r) {
          const uint64_t v = spread_nibbles(src[r]);
          std::memcpy(o + r * k + 8 * j, &v, 8);
        }
      }
    }
  });
  return out;
}

// compressed-tensors weight_packed [N, ceil(K/8)], packed along K -> codes uint8 [N, K]
at::Tensor unpack_ct(const at::Tensor& packed, int64_t k, int64_t threads) {
  check_words(packed, "weight_packed");
  const int64_t n = packed.size(0), kw = packed.size(1);
  TORCH_CHECK(k >= 0 && k <= kw * 8, "weight_packed: K=", k, " does not fit ", kw, " words");
  auto out = at::empty({n, k}, at::kByte);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t full = k / 8;
  for_rows(n, 16, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint32_t* src = w + r * kw;
      uint8_t* dst = o + r * k;
      for (int64_t j = 0; j < full; ++j) {
        const uint64_t v = spread_nibbles(src[j]);
        std::memcpy(dst + 8 * j, &v, 8);
      }
      if (full * 8 < k) {
        const uint64_t v = spread_nibbles(src[full]);
        std::memcpy(dst + 8 * full, &v, k - 8 * full);
      }
    }
  });
  return out;
}

// AWQ GEMM qweight [K, N/8], packed along N; logical column 8j + order[i] in nibble i of word j
at::Tensor unpack_awq(const at::Tensor& qweight, int64_t threads) {
  check_words(qweight, "qweight");
  static const int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  int inv[8];
  for (int i = 0; i < 8; ++i) inv[kOrder[i]] = i;
  const int64_t k = qweight.size(0), nw = qweight.size(1), n = nw * 8;
  auto out = at::empty({n, k}, at::kByte);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>());
  uint8_t* o = out.data_ptr<uint8_t>();
  for_rows(nw, 4, threads, [&](int64_t j0, int64_t j1) {
    uint8_t tile[8][8];
    for (int64_t j = j0; j < j1; ++j) {
      int64_t c = 0;
      for (; c + 8 <= k; c += 8) {
        for (int t = 0; t < 8; ++t) {
          const uint64_t v = spread_nibbles(w[(c + t) * nw + j]);
          std::memcpy(tile[t], &v, 8);
        }
        for (int m = 0; m < 8; ++m) {
          uint8_t row[8];
          for (int t = 0; t < 8; ++t) row[t] = tile[t][inv[m]];
          std::memcpy(o + (8 * j + m) * k + c, row, 8);
        }
      }
      for (; c < k; ++c) {
        const uint32_t v = w[c * nw + j];
        for (int m = 0; m < 8; ++m) o[(8 * j + m) * k + c] = (v >> (4 * inv[m])) & 0xF;
      }
    }
  });
  return out;
}

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

std::vector<at::Tensor> lossless(const at::Tensor& codes, int64_t g, int64_t threads) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes: expected contiguous uint8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(g > 0 && k % g == 0, "lossless: group ", g, " does not divide K=", k);
  auto q = at::empty({n, k}, at::kChar);
  auto sq = at::empty({n, k / g}, at::kInt);
  auto mq = at::empty({n, k / g}, at::kInt);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  int8_t* qp = q.data_ptr<int8_t>();
  int32_t* s = sq.data_ptr<int32_t>();
  int32_t* m = mq.data_ptr<int32_t>();
  for_rows(n, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(k, 1)), threads,
           [&](int64_t r0, int64_t r1) { lossless_rows(c, qp, s, m, r0, r1, k, g); });
  return {q, sq, mq};
}

// ------------------------------------------------------------------------------------ requant

inline float ship_bf16(float x) {
  // float32 -> bfloat16 (round to nearest even) -> float32, as c10::BFloat16 does for finite x
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  u &= 0xFFFF0000u;
  float y;
  std::memcpy(&y, &u, 4);
  return y;
}

struct Req {
  const float* w = nullptr;  // float source [N, K], or
  const uint8_t* codes = nullptr;  // codes [N, K] with
  const uint8_t* zeros = nullptr;  // zeros [N, Gs] (null: 8)
  const float* sscale = nullptr;  // source scales [N, Gs]
  const int64_t* gidx = nullptr;  // [K] (null: k / src_group)
  int64_t src_groups = 1, src_group = 1;
  int64_t n = 0, k = 0, g = 0;  // g: target group width (K for channel)
  bool bf16 = true, search = true;
  std::vector<float> coarse, fine;
  int8_t* q = nullptr;
  float* s = nullptr;
  uint8_t* flags = nullptr;
  double* rowstats = nullptr;  // [N, 6]: dd, ww, vv, wv, baseline sse, max_abs
};

inline float ship(const Req& p, float x) {
  const float y = p.bf16 ? ship_bf16(x) : x;
  return y < kTiny ? kTiny : y;  // clamp_min(TINY)
}

// 8 floats; GCC/Clang vector extensions: plain SIMD on every target (SSE2 pairs, AVX2, NEON)
typedef float v8f __attribute__((vector_size(32)));

inline v8f splat(float x) { return x - v8f{}; }
inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline float hsum(v8f a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

// clamp to [-8, 7] first, then round half to even: the same integers as torch's round_().clamp_()
inline v8f qround(v8f t) {
  const v8f lo = splat(-8.0f), hi = splat(7.0f), mg = splat(kMagic);
  t = t < lo ? lo : t;
  t = t > hi ? hi : t;
  return (t + mg) - mg;
}
inline float qround1(float t) {
  t = t < -8.0f ? -8.0f : t;
  t = t > 7.0f ? 7.0f : t;
  return (t + kMagic) - kMagic;
}

// sum over the group of (s * clamp(round(x / s)) - x)^2, in the oracle's float operations
inline float group_sse(const float* x, int64_t n, float s) {
  const float r = 1.0f / s;  // torch: s.reciprocal()
  const v8f vr = splat(r), vs = splat(s);
  v8f a0 = {}, a1 = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v8f x0 = load8(x + i), x1 = load8(x + i + 8);
    const v8f d0 = qround(x0 * vr) * vs - x0, d1 = qround(x1 * vr) * vs - x1;
    a0 += d0 * d0;
    a1 += d1 * d1;
  }
  float tail = 0.0f;
  for (; i < n; ++i) {
    const float d = qround1(x[i] * r) * s - x[i];
    tail += d * d;
  }
  return hsum(a0 + a1) + tail;
}

struct Group {
  int64_t n;
  double xx;  // sum x^2
  double k = 0;  // the sqrt term of the bound at the largest error compared (one sqrt per group)
  // rounding bound on one computed sum of squared errors (torch's or ours), doubled for the
  // difference of two: |computed - exact| <= (n + 2) u e2 + 2 u sqrt(e2 * sum (q s)^2), and
  // sum (q s)^2 <= 2 xx + 2 e2; the sqrt term is taken at the largest e2 of the candidates
  void set_max(double emax) { k = 8.0 * kU * std::sqrt(emax * (2.0 * xx + 2.0 * emax)) + 1e-300; }
  double bound(double e2) const { return (2.0 * static_cast<double>(n) + 16.0) * kU * e2 + k; }
};

// first minimum, and whether every other candidate with a different scale is clearly worse
inline int pick(const float* cand, const float* e, int m, const Group& gr, bool& ambiguous) {
  int best = 0;
  for (int i = 1; i < m; ++i)
    if (e[i] < e[best]) best = i;
  const double bb = gr.bound(e[best]);
  for (int i = 0; i < m; ++i) {
    if (i == best || cand[i] == cand[best]) continue;
    const double d = static_cast<double>(e[i]) - static_cast<double>(e[best]);
    if (!(d > gr.bound(e[i]) + bb)) ambiguous = true;
  }
  return best;
}

I4P_CLONES void requant_rows(const Req& p, int64_t r0, int64_t r1) {
  const int64_t k = p.k, g = p.g, groups = k / g;
  std::vector<float> row(k);
  const int nc = 1 + static_cast<int>(p.coarse.size()), nf = static_cast<int>(p.fine.size());
  std::vector<float> cand(nc), err(nc), ratio(nc), cand2(std::max(nf, 1)), err2(std::max(nf, 1));
  for (int64_t r = r0; r < r1; ++r) {
    float* x = row.data();
    if (p.w) {
      std::memcpy(x, p.w + r * k, k * sizeof(float));
    } else {
      const uint8_t* c = p.codes + r * k;
      const float* sc = p.sscale + r * p.src_groups;
      const uint8_t* z = p.zeros ? p.zeros + r * p.src_groups : nullptr;
      if (p.gidx) {
        for (int64_t i = 0; i < k; ++i) {
          const int64_t gi = p.gidx[i];
          const float zz = z ? static_cast<float>(z[gi]) : 8.0f;
          x[i] = (static_cast<float>(c[i]) - zz) * sc[gi];
        }
      } else {
        for (int64_t j = 0; j * p.src_group < k; ++j) {
          const int64_t i0 = j * p.src_group, i1 = std::min(k, i0 + p.src_group);
          const float zz = z ? static_cast<float>(z[j]) : 8.0f;
          const float sj = sc[j];
          for (int64_t i = i0; i < i1; ++i) x[i] = (static_cast<float>(c[i]) - zz) * sj;
        }
      }
    }
    double dd = 0, ww = 0, vv = 0, wv = 0, base_sse = 0, max_abs = 0;
    for (int64_t j = 0; j < groups; ++j) {
      const float* xg = x + j * g;
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
      uint8_t flag = 0;
      if (!(chk == 0.0f)) {  // a NaN or Inf: the caller lets the torch path raise
        p.flags[r * groups + j] = kNonFinite;
        p.s[r * groups + j] = std::numeric_limits<float>::quiet_NaN();
        std::memset(p.q + r * k + j * g, 0, g);
        continue;
      }
      const float amax = std::max(wmax, -wmin);
      const bool zero = amax == 0.0f;
      const float rtn = amax / 7.0f;
      Group gr{g, xx};
      // far outside any real weight the float32 sums could under/overflow: let torch decide
      if (!zero && (amax < 1e-18f || amax > 1e17f)) flag |= kAmbiguous;
      float best_s, best_e, base_e;
      bool amb = false;
      if (!p.search) {
        best_s = ship(p, rtn);
        best_e = base_e = group_sse(xg, g, best_s);
      } else {
        float base = std::max(wmax / 7.0f, wmin / -8.0f);
        if (!(base > 0.0f)) base = 1.0f;
        ratio[0] = rtn / base;
        for (int c = 1; c < nc; ++c) ratio[c] = p.coarse[c - 1];
        for (int c = 0; c < nc; ++c) {
          cand[c] = ship(p, base * ratio[c]);
          err[c] = group_sse(xg, g, cand[c]);
        }
        float emax = 0.0f;
        for (int c = 0; c < nc; ++c) emax = std::max(emax, err[c]);
        gr.set_max(emax);
        const int ib = pick(cand.data(), err.data(), nc, gr, amb);
        best_s = cand[ib];
        best_e = err[ib];
        base_e = err[0];
        if (nf > 0 && nc > 2) {
          const float rho = ratio[ib];
          for (int f = 0; f < nf; ++f) {
            cand2[f] = ship(p, base * (rho + p.fine[f]));
            err2[f] = group_sse(xg, g, cand2[f]);
            emax = std::max(emax, err2[f]);
          }
          gr.set_max(emax);
          bool ambf = false;
          const int jb = pick(cand2.data(), err2.data(), nf, gr, ambf);
          if (cand2[jb] != best_s) {
            const double d = static_cast<double>(err2[jb]) - static_cast<double>(best_e);
            const double b = gr.bound(err2[jb]) + gr.bound(best_e);
            if (d > b) {
              // every fine candidate loses to the coarse winner: which of them is the fine
              // argmin (ambf) does not matter (bound(e) = A e + k with A < 1: e - bound(e) grows)
            } else if (-d > b) {
              best_s = cand2[jb];
              best_e = err2[jb];
              amb = amb || ambf;
            } else {
              amb = true;
            }
          } else {
            amb = amb || ambf;  // a near-tied fine candidate might be torch's argmin and beat it
          }
        }
      }
      if (zero) {
        best_s = 1.0f;
        flag |= kZero;
        amb = false;
      }
      if (amb) flag |= kAmbiguous;
      // final q, and the statistics against the float source
      const float rs = 1.0f / best_s;
      int8_t* qg = p.q + r * k + j * g;
      double gdd = 0, gvv = 0, gwv = 0, gmax = 0;
      {
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
      }
      dd += gdd;
      vv += gvv;
      wv += gwv;
      ww += xx;
      max_abs = std::max(max_abs, gmax);
      base_sse += static_cast<double>(base_e);  // already a sum of squares
      p.s[r * groups + j] = best_s;
      p.flags[r * groups + j] = flag;
      (void)best_e;
    }
    double* st = p.rowstats + r * 6;
    st[0] = dd;
    st[1] = ww;
    st[2] = vv;
    st[3] = wv;
    st[4] = base_sse;
    st[5] = max_abs;
  }
}

std::vector<at::Tensor> requant(const at::Tensor& w, const at::Tensor& codes, const at::Tensor& zeros,
                                const at::Tensor& sscale, const at::Tensor& gidx, int64_t src_group, int64_t g,
                                bool bf16, bool search, const at::Tensor& coarse, const at::Tensor& fine,
                                int64_t threads) {
  Req p;
  if (w.defined() && w.numel() > 0) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(),
                "w: expected contiguous float32 [N, K]");
    p.n = w.size(0);
    p.k = w.size(1);
    p.w = w.data_ptr<float>();
  } else {
    TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
                "codes: expected contiguous uint8 [N, K]");
    p.n = codes.size(0);
    p.k = codes.size(1);
    p.codes = codes.data_ptr<uint8_t>();
    TORCH_CHECK(sscale.dim() == 2 && sscale.size(0) == p.n && sscale.scalar_type() == at::kFloat &&
                    sscale.is_contiguous(), "scales: expected contiguous float32 [N, G]");
    p.src_groups = sscale.size(1);
    p.sscale = sscale.data_ptr<float>();
    if (zeros.defined() && zeros.numel() > 0) {
      TORCH_CHECK(zeros.scalar_type() == at::kByte && zeros.is_contiguous() && zeros.size(0) == p.n &&
                      zeros.size(1) == p.src_groups, "zeros: expected contiguous uint8 [N, G]");
      p.zeros = zeros.data_ptr<uint8_t>();
    }
    if (gidx.defined() && gidx.numel() > 0) {
      TORCH_CHECK(gidx.scalar_type() == at::kLong && gidx.is_contiguous() && gidx.numel() == p.k,
                  "g_idx: expected contiguous int64 [K]");
      const int64_t* gp = gidx.data_ptr<int64_t>();
      for (int64_t i = 0; i < p.k; ++i)
        TORCH_CHECK(gp[i] >= 0 && gp[i] < p.src_groups, "g_idx out of range");
      p.gidx = gp;
    } else {
      TORCH_CHECK(src_group > 0 && (p.k + src_group - 1) / src_group <= p.src_groups, "bad source group");
      p.src_group = src_group;
    }
  }
  TORCH_CHECK(g > 0 && p.k % g == 0, "requant: group ", g, " does not divide K=", p.k);
  p.g = g;
  p.bf16 = bf16;
  p.search = search;
  auto cc = coarse.to(at::kFloat).contiguous();
  auto ff = fine.to(at::kFloat).contiguous();
  p.coarse.assign(cc.data_ptr<float>(), cc.data_ptr<float>() + cc.numel());
  p.fine.assign(ff.data_ptr<float>(), ff.data_ptr<float>() + ff.numel());
  auto q = at::empty({p.n, p.k}, at::kChar);
  auto s = at::empty({p.n, p.k / g}, at::kFloat);
  auto flags = at::empty({p.n, p.k / g}, at::kByte);
  auto rowstats = at::empty({p.n, 6}, at::kDouble);
  p.q = q.data_ptr<int8_t>();
  p.s = s.data_ptr<float>();
  p.flags = flags.data_ptr<uint8_t>();
  p.rowstats = rowstats.data_ptr<double>();
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(p.k, 1));
  for_rows(p.n, grain, threads, [&](int64_t r0, int64_t r1) { requant_rows(p, r0, r1); });
  return {q, s, flags, rowstats};
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
  int64_t gs_count = 1, src_group = 1, k = 0, g = 0;
  bool bf16 = true;
  int8_t* q = nullptr;
  float* out_s = nullptr;  // [N, K/g] shipped values
};

// row accumulators: dd, ww, vv, wv, max_abs
struct RowAcc {
  double v[5] = {0, 0, 0, 0, 0};
  int64_t status = kOk;
};

// target group j of row r, whose q^2 sum and max are sq and m: check, cast, accumulate
inline void lossless_group(const Lossless& p, int64_t r, int64_t j, int32_t sq, int32_t m, RowAcc& a) {
  if (a.status != kOk) return;
  const int64_t groups = p.k / p.g, sg = (j * p.g) / p.src_group;
  if (((j + 1) * p.g - 1) / p.src_group != sg || sg >= p.gs_count) {
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
  a.v[0] += diff * diff * w;
  a.v[1] += sd * sd * w;
  a.v[2] += sbd * sbd * w;
  a.v[3] += sd * sbd * w;
  a.v[4] = std::max(a.v[4], std::fabs(diff) * std::sqrt(static_cast<double>(m)));
}

// 8 codes (one word) -> 8 int8 q = u - 8
inline void word_q(uint32_t w, int8_t* dst) {
  // u + 0x78 never carries out of its byte (u <= 15); ^ 0x80 then subtracts 0x80 mod 256: u - 8
  const uint64_t q = (spread_nibbles(w) + 0x7878787878787878ull) ^ 0x8080808080808080ull;
  std::memcpy(dst, &q, 8);
}

// sum and max of q^2 over g int8 values (a plain loop the compiler vectorises; faster than
// per-nibble tables on the packed words)
inline void q_stats(const int8_t* q, int64_t g, int32_t& sq, int32_t& m) {
  int32_t s = 0, mx = 0;
  for (int64_t i = 0; i < g; ++i) {
    const int32_t v = q[i];
    s += v * v;
    mx = std::max(mx, v * v);
  }
  sq = s;
  m = mx;
}

I4P_CLONES void lossless_codes_rows(const Lossless& p, const uint8_t* c, int64_t r0, int64_t r1, RowAcc* acc) {
  const int64_t k = p.k, g = p.g, groups = k / g;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < groups && acc[r].status == kOk; ++j) {
      const uint8_t* src = c + r * k + j * g;
      int8_t* dst = p.q + r * k + j * g;
      for (int64_t i = 0; i < g; ++i) dst[i] = static_cast<int8_t>(static_cast<int32_t>(src[i]) - 8);
      int32_t sq, m;
      q_stats(dst, g, sq, m);
      lossless_group(p, r, j, sq, m, acc[r]);
    }
  }
}

// compressed-tensors weight_packed [N, K/8]: row r's words are contiguous
I4P_CLONES void lossless_ct_rows(const Lossless& p, const uint32_t* w, int64_t kw, int64_t r0, int64_t r1,
                                 RowAcc* acc) {
  const int64_t k = p.k, g = p.g, groups = k / g, wpg = g / 8;
  for (int64_t r = r0; r < r1; ++r) {
    const uint32_t* src = w + r * kw;
    int8_t* dst = p.q + r * k;
    for (int64_t j = 0; j < groups && acc[r].status == kOk; ++j) {
      for (int64_t t = j * wpg; t < (j + 1) * wpg; ++t) word_q(src[t], dst + 8 * t);
      int32_t sq, m;
      q_stats(dst + j * g, g, sq, m);
      lossless_group(p, r, j, sq, m, acc[r]);
    }
  }
}

// GPTQ qweight [K/8, N]: word (t, r) holds columns 8t..8t+7 of row r; blocks of rows keep the
// writes of one block inside a few KB
I4P_CLONES void lossless_gptq_rows(const Lossless& p, const uint32_t* w, int64_t n, int64_t b0, int64_t b1,
                                   int64_t nb, RowAcc* acc) {
  const int64_t k = p.k, g = p.g, wpg = g / 8;
  // one target group of nb rows is built in a contiguous tile, then each row's g bytes are copied
  // out whole: writing 8 bytes at a time straight into rows K bytes apart thrashed L1 when K is a
  // multiple of 2 KB (every row's line falls in the same few sets)
  std::vector<int8_t> tile(nb * g);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t r0 = b * nb, r1 = std::min(n, r0 + nb);
    for (int64_t j = 0; j * g < k; ++j) {
      for (int64_t t = 0; t < wpg; ++t) {
        const uint32_t* src = w + (j * wpg + t) * n;
        for (int64_t r = r0; r < r1; ++r) word_q(src[r], tile.data() + (r - r0) * g + 8 * t);
      }
      for (int64_t r = r0; r < r1; ++r) {
        const int8_t* row = tile.data() + (r - r0) * g;
        std::memcpy(p.q + r * k + j * g, row, g);
        int32_t sq, m;
        q_stats(row, g, sq, m);
        lossless_group(p, r, j, sq, m, acc[r]);
      }
    }
  }
}

// layout: 0 codes uint8 [N, K]; 1 compressed-tensors words [N, K/8]; 2 GPTQ words [K/8, N].
// Source scales [N, Gs] (any float dtype), zeros uint8 [N, Gs] or empty, source groups of src_group
// contiguous columns, target group g (K: channel), bf16 (else fp32) target scales.
// Returns (status [1] int64, q int8 [N, K], scales [N, K/g] float32 holding the shipped values,
// stats [5] float64: dd, ww, vv, wv, max_abs).
std::vector<at::Tensor> lossless_job(int64_t layout, const at::Tensor& data, int64_t n, int64_t k,
                                     const at::Tensor& sscale, const at::Tensor& zeros, int64_t src_group, int64_t g,
                                     bool bf16, int64_t threads) {
  TORCH_CHECK(data.is_contiguous() && data.dim() == 2, "lossless_job: expected a contiguous 2-D tensor");
  if (layout == 0) {
    TORCH_CHECK(data.scalar_type() == at::kByte && data.size(0) == n && data.size(1) == k,
                "codes: expected uint8 [N, K]");
  } else {
    TORCH_CHECK(data.scalar_type() == at::kInt, "packed words: expected int32");
    const bool ok = layout == 1 ? (data.size(0) == n && data.size(1) * 8 >= k)
                                : (layout == 2 && data.size(1) == n && data.size(0) * 8 == k);
    TORCH_CHECK(ok, "packed words: shape does not match [N, K] for layout ", layout);
  }
  TORCH_CHECK(g > 0 && k % g == 0, "lossless_job: group ", g, " does not divide K=", k);
  TORCH_CHECK(src_group > 0, "lossless_job: bad source group ", src_group);
  auto sf = sscale.to(at::kFloat).contiguous();
  TORCH_CHECK(sf.dim() == 2 && sf.size(0) == n, "scales: expected [N, G]");
  Lossless p;
  p.gs_count = sf.size(1);
  if (zeros.defined() && zeros.numel() > 0) {
    TORCH_CHECK(zeros.scalar_type() == at::kByte && zeros.is_contiguous() && zeros.size(0) == n &&
                    zeros.size(1) == p.gs_count, "zeros: expected contiguous uint8 [N, G]");
    p.z = zeros.data_ptr<uint8_t>();
  }
  p.ss = sf.data_ptr<float>();
  p.src_group = src_group;
  p.k = k;
  p.g = g;
  p.bf16 = bf16;
  auto q = at::empty({n, k}, at::kChar);
  auto s = at::empty({n, k / g}, at::kFloat);
  p.q = q.data_ptr<int8_t>();
  p.out_s = s.data_ptr<float>();
  std::vector<RowAcc> acc(n);
  const bool packed_ok = layout == 0 || (k % 8 == 0 && g % 8 == 0);
  if (!packed_ok) {
    acc.assign(n, RowAcc{});
    if (n) acc[0].status = kSpans;
  } else if (layout == 0) {
    const uint8_t* c = data.data_ptr<uint8_t>();
    for_rows(n, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(k, 1)), threads,
             [&](int64_t r0, int64_t r1) { lossless_codes_rows(p, c, r0, r1, acc.data()); });
  } else if (layout == 1) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(data.data_ptr<int32_t>());
    const int64_t kw = data.size(1);
    for_rows(n, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(k, 1)), threads,
             [&](int64_t r0, int64_t r1) { lossless_ct_rows(p, w, kw, r0, r1, acc.data()); });
  } else {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(data.data_ptr<int32_t>());
    constexpr int64_t NB = 64;
    for_rows((n + NB - 1) / NB, 1, threads,
             [&](int64_t b0, int64_t b1) { lossless_gptq_rows(p, w, n, b0, b1, NB, acc.data()); });
  }
  auto tot = at::zeros({5}, at::kDouble);
  int64_t worst = kOk;
  double* t = tot.data_ptr<double>();
  for (int64_t r = 0; r < n; ++r) {
    worst = std::max(worst, acc[r].status);
    for (int i = 0; i < 4; ++i) t[i] += acc[r].v[i];
    t[4] = std::max(t[4], acc[r].v[4]);
  }
  auto st = at::full({1}, worst, at::kLong);
  return {st, q, s, tot};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("unpack_gptq", &unpack_gptq, "GPTQ qweight [K/8, N] -> codes uint8 [N, K]", nogil);
  m.def("unpack_awq", &unpack_awq, "AWQ GEMM qweight [K, N/8] -> codes uint8 [N, K]", nogil);
  m.def("unpack_ct", &unpack_ct, "compressed-tensors weight_packed [N, K/8] -> codes uint8 [N, K]", nogil);
  m.def("lossless", &lossless, "codes -> (q int8, sum q^2 per group, max q^2 per group)", nogil);
  m.def("lossless_job", &lossless_job, "one lossless job: checks, q, cast scales, error (see w4a8.lossless_fast)",
        nogil);
  m.def("requant", &requant, "scale-search requantisation (see w4a8.requantize)", nogil);
}
