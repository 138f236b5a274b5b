// The requant job: the scale search of every target group of a tensor, row blocks over threads
// (twin: w4a8._requant_torch). The search itself: requant_search.h, and its two evaluations,
// requant_element.h (eight groups at a time in float32 first: requant_element32.h) and
// requant_hist.h / requant_hist_search.h.

#include "requant_element32.h"

namespace i4p {

// histogram batches searched in float32 and in float64 (hist::search), for tests and benchmarks;
// g_search64 forces the float64 search (tests compare both with the oracle)
std::atomic<int64_t> g_batches32{0}, g_batches64{0};
// element groups decided in float32 batches (requant_element32.h), and through element_group
std::atomic<int64_t> g_elem32{0}, g_elem64{0};
// candidates of those batches evaluated, and skipped by their lower bound (requant_element32.h, errors32)
std::atomic<int64_t> g_evaluated{0}, g_skipped{0};
std::atomic<bool> g_search64{false};

// requant_supported() says whether this CPU runs requant_rows, built for x86-64-v3 only on x86-64
// (I4P_REQUANT_V3, requant_search.h); where not (x86-64 CPUs from before 2013), the callers take
// the pure-torch requant.
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
  bool any_inside = false;
  for (int64_t j = 0; j < groups; ++j) {
    all_inside = all_inside && inside[j];
    any_inside = any_inside || inside[j];
  }
  // a row of element groups only (a float source, a g_idx, ...): eight at a time in float32; where
  // histogram groups share the row, each group as before (the row's sums keep their order)
  const bool batched = !any_inside && elem32::usable(p);
  std::unique_ptr<elem32::Batch> eb(batched ? new elem32::Batch : nullptr);
  std::vector<float> row(k);
  Search w(p);
  int64_t one_by_one = 0;  // element groups outside the float32 batches
  hist::Batch batch;  // filled across rows: a row of 6 groups (K = 768) would leave lanes idle
  static_assert(hist::Batch::kLanes == Search::kSlots, "one batch, one lane a group");
  for (int64_t r = r0; r < r1; ++r) {
    float* x = row.data();
    if (p.w) {
      std::memcpy(x, p.w + r * k, k * sizeof(float));
    } else if (p.rows) {
      p.rows->row(r, x);
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
      if (batched) {
        elem32::add(p, w, *eb, r, j, x + j * g);
      } else {
        element_group(p, w, r, j, x + j * g, acc);
        ++one_by_one;
      }
    }
    if (batched) elem32::flush(p, w, *eb, r);
  }
  if (batch.n > 0) hist::run(p, w, batch);
  g_batches32 += w.batches32;
  g_batches64 += w.batches64;
  g_elem32 += eb ? eb->decided : 0;
  g_elem64 += one_by_one + (eb ? eb->handed : 0);
  g_evaluated += eb ? eb->evaluated : 0;
  g_skipped += eb ? eb->skipped : 0;
}


// The requant path in one call (twin: w4a8._requant_torch after w4a8.check_scales): the checks of
// the source scales, the codes unpacked from the packed words 64 rows at a time into a buffer
// that stays in cache (or the codes, or float values, as given), the scale search, the error sums.
int64_t requant_job(const JobArgs& a, int8_t* q, float* s, uint8_t* flags, double* tot, int64_t* counts,
                    int64_t* report, int64_t threads, const FloatRows* rows) {
  I4P_CHECK(requant_supported(), "requant_job: this CPU lacks AVX2/FMA (x86-64-v3)");
  check_job(a, kFloat, "requant_job");
  I4P_CHECK(a.layout == kFloat ? (a.data != nullptr) != (rows != nullptr) : rows == nullptr,
            "requant_job: float values or their rows, one of them");
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
    p.rows = rows;
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

void element_groups(int64_t* out) {
  out[0] = g_elem32.load();
  out[1] = g_elem64.load();
}

void element_candidates(int64_t* out) {
  out[0] = g_evaluated.load();
  out[1] = g_skipped.load();
}

bool force_search64(bool on) { return g_search64.exchange(on); }

}  // namespace i4p

