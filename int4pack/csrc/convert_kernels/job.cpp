// What the two tensor jobs share: the checks of their inputs, the refusals of w4a8.check_scales
// (twin) with their place, and the source's codes a block of rows at a time.

#include "convert_kernels.h"

namespace i4p {

void check_job(const JobArgs& a, int64_t last, const char* what) {
  const int64_t n = a.n, k = a.k, layout = a.layout, d0 = a.d0, d1 = a.d1;
  I4P_CHECK(n >= 0 && k >= 0, what, ": bad shape");
  I4P_CHECK(layout >= kCodes && layout <= last, "job data: layout ", layout, " is not read here");
  bool ok;
  switch (layout) {
    case kCodes:
    case kFloat: ok = d0 == n && d1 == k; break;
    case kCt: ok = d0 == n && d1 * 8 >= k; break;
    case kGptq: ok = d1 == n && d0 * 8 == k; break;
    default: ok = d0 == k && d1 * 8 == n; break;
  }
  I4P_CHECK(ok, layout == kCodes ? "codes: expected uint8 [N, K]"
                : layout == kFloat ? "w: expected float32 [N, K]"
                                   : "packed words: shape does not match [N, K] for their layout");
  I4P_CHECK(a.g > 0 && k % a.g == 0, what, ": group ", a.g, " does not divide K=", k);
  I4P_CHECK(a.n_coarse >= 0 && a.n_fine >= 0 && (a.n_coarse == 0 || a.coarse) && (a.n_fine == 0 || a.fine),
            what, ": bad search points");
  if (layout == kFloat) return;
  I4P_CHECK(a.sscale != nullptr && a.src_groups > 0, what, ": no source scales");
  if (a.gidx != nullptr) {
    for (int64_t i = 0; i < k; ++i) I4P_CHECK(a.gidx[i] >= 0 && a.gidx[i] < a.src_groups, "g_idx out of range");
  } else {
    I4P_CHECK(a.src_group > 0 && (k + a.src_group - 1) / a.src_group <= a.src_groups, what,
              ": bad source group ", a.src_group);
  }
}

int64_t check_source_scales(const JobArgs& a, int64_t* report, bool& zero_seen) {
  const float* s = a.sscale;
  const int64_t total = a.n * a.src_groups;
  int64_t bad = 0, neg = 0, first_bad = -1, first_neg = -1;
  bool zero = false;
  for (int64_t i = 0; i < total; ++i) {  // one pass: the common case finds nothing
    const float v = s[i];
    if (!std::isfinite(v)) {
      first_bad = bad++ ? first_bad : i;
    } else if (v < 0.0f) {
      first_neg = neg++ ? first_neg : i;
    } else {
      zero |= v == 0.0f;
    }
  }
  zero_seen = zero;
  const int64_t at = bad ? first_bad : first_neg;
  if (at < 0) return kDone;
  report[0] = at / a.src_groups;
  report[1] = at % a.src_groups;
  report[2] = (bad ? bad : neg) - 1;
  return bad ? kScaleNotFinite : kScaleNegative;
}

void unpack_block(const JobArgs& a, int64_t r0, int64_t r1, uint8_t* buf) {
  const uint32_t* w = static_cast<const uint32_t*>(a.data);
  switch (a.layout) {
    case kCt: unpack_ct_rows(w, a.d1, a.k, buf, r0, r1, r0); break;
    case kGptq: unpack_gptq_rows(w, buf, a.n, a.k / 8, r0, r1, r0); break;
    case kAwq: unpack_awq_words(w, buf, a.k, a.n / 8, r0 / 8, r1 / 8, r0); break;
    default: fail("unpack_block: layout ", a.layout, " holds no packed words");
  }
}

int64_t erased_in_row(const JobArgs& a, int64_t r, const uint8_t* values, int zero) {
  const float* s = a.sscale + r * a.src_groups;
  const uint8_t* z = a.zeros ? a.zeros + r * a.src_groups : nullptr;
  for (int64_t i = 0; i < a.k; ++i) {
    const int64_t sg = a.gidx ? a.gidx[i] : i / a.src_group;
    if (s[sg] != 0.0f) continue;
    const int at = zero >= 0 ? zero : (z ? z[sg] : 8);
    if (values[i] != at) return sg;
  }
  return -1;
}

}  // namespace i4p
