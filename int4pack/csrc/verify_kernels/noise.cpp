// verify's predicted activation-quantisation error of one expert (moe.propagated_noise with
// activations on and no weight term) in one call: per routed row m,
//   v_x = step(x_m)^2 / 12, v_a = step(act_m)^2 / 12 (step: the row's int8 step, moe.int8_step),
//   tot_m = sum_i (dg^2 v_x sq13[i] + du^2 v_x sq13[I + i] + v_a) sq2[i],
// dg, du the activation's derivatives by gate and up at (gate, up) = y13[m, i], y13[m, I + i]
// (moe._act_jacobian). float32 inputs, the sum over i in double: the prediction, not bits, is what
// the check uses (the torch formula sums in float32 in another order; they agree to ~1e-6).

#include "../common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace i4p {
namespace {

constexpr float kSwigluAlpha = 1.702f, kSwigluLimit = 7.0f;

inline double step2_12(const float* row, int64_t n) {
  float lo = 0.0f, hi = 0.0f;  // min(0, min row), max(0, max row)
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, row[i]);
    hi = std::max(hi, row[i]);
  }
  const double step = (static_cast<double>(hi) - static_cast<double>(lo)) / 255.0;
  return step * step / 12.0;
}

inline double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

}  // namespace

void act_noise(const float* x, int64_t M, int64_t H, const float* y13, const float* act, int64_t I,
               const float* sq13, const float* sq2, int64_t kind, float* out) {
  I4P_CHECK(kind >= 0 && kind <= 2, "act_noise: activation kind ", kind);
  for (int64_t m = 0; m < M; ++m) {
    const double vx = step2_12(x + m * H, H), va = step2_12(act + m * I, I);
    const float* gate = y13 + m * 2 * I;
    const float* up = gate + I;
    double tot = 0.0;
    for (int64_t i = 0; i < I; ++i) {
      const double g = gate[i], u = up[i];
      double dg, du;
      if (kind == 1) {
        const double gc = std::min(g, static_cast<double>(kSwigluLimit));
        const double s = sigmoid(gc * kSwigluAlpha);
        const double uc = std::min(std::max(u, -static_cast<double>(kSwigluLimit)), static_cast<double>(kSwigluLimit));
        dg = g < kSwigluLimit ? (uc + 1.0) * (s + kSwigluAlpha * gc * s * (1.0 - s)) : 0.0;
        du = std::fabs(u) < kSwigluLimit ? gc * s : 0.0;
      } else {
        const double s = sigmoid(g);
        dg = u * s * (1.0 + g * (1.0 - s));
        du = g * s;
      }
      tot += (dg * dg * vx * sq13[i] + du * du * vx * sq13[I + i] + va) * sq2[i];
    }
    out[m] = static_cast<float>(tot);
  }
}

}  // namespace i4p
