// The lossless path of many modules in one call (twin: convert's per-module path, run_job +
// blobs.job_packer, which int4pack/batch.py falls back to): each module's packed words, scales,
// zero points and g_idx read in place from the mapped source shard, the lossless job (lossless.cpp),
// the output tensors written at their places in one buffer (the default format's int8 weight and
// scales, or the KleidiAI blob), and the checksums the writer (CRC-32C) and the packed format's
// provenance (zlib's CRC-32) record. A module this path does not take as given (a zero point other
// than 8, a g_idx that is not arange(K) / group, words off their alignment) or that its job refuses
// gets a status and no output: the caller runs it through the per-module path, which converts it
// or words the refusal.

#include "convert_kernels.h"

namespace i4p {

void kleidiai_pack(const int8_t* q, int64_t E, int64_t N, int64_t K, const void* scales, bool scales_bf16,
                   const float* bias, int64_t group_size, uint8_t* out, int64_t bytes, int64_t threads);

namespace {

// The checks both batch kinds make of a descriptor row: its shape, scale type, and that its source
// tensors lie inside the mapping and its outputs inside the buffer.
void check_row(const int64_t* d, int64_t m, const char* what, int64_t src_len, int64_t out_len) {
  const int64_t n = d[kbN], k = d[kbK], gs = d[kbSrcGroups], g = d[kbG];
  I4P_CHECK(n > 0 && k > 0 && gs > 0 && g > 0 && k % g == 0, what, ": module ", m, ": bad shape");
  I4P_CHECK(d[kbScaleType] >= kScaleF32 && d[kbScaleType] <= kScaleBf16, what, ": scale dtype");
  const int64_t item = d[kbScaleType] == kScaleF32 ? 4 : 2;
  I4P_CHECK(in_range(d[kbWords], d[kbD0] * d[kbD1] * 4, src_len) && in_range(d[kbScales], n * gs * item, src_len),
            what, ": module ", m, ": source outside the mapping");
  I4P_CHECK(d[kbGidx] < 0 || in_range(d[kbGidx], k * d[kbGidxItem], src_len), what, ": g_idx outside");
  const int64_t sbytes = n * (k / g) * (d[kbBf16] ? 2 : 4);
  if (d[kbOutBlob] >= 0) {
    I4P_CHECK(in_range(d[kbOutBlob], d[kbBlobBytes], out_len), what, ": blob outside the buffer");
  } else {
    I4P_CHECK(in_range(d[kbOutQ], n * k, out_len) && in_range(d[kbOutS], sbytes, out_len),
              what, ": outputs outside the buffer");
  }
}

// Whether a row's g_idx (if stored) is the trivial arange(K) / group, the only one the batches take.
bool trivial_gidx(const int64_t* d, const uint8_t* src, const char* what) {
  const uint8_t* p = src + d[kbGidx];
  const int64_t grp = d[kbGidxGroup], k = d[kbK];
  I4P_CHECK(grp > 0, what, ": g_idx group");
  for (int64_t i = 0; i < k; ++i) {
    const int64_t v = d[kbGidxItem] == 8 ? load<int64_t>(p + 8 * i) : load<int32_t>(p + 4 * i);
    if (v != i / grp) return false;
  }
  return true;
}

// A row's job arguments read from the source: words, shapes, groups, its scales as float32 (into sscale).
JobArgs source_args(const int64_t* d, const uint8_t* src, std::vector<float>& sscale) {
  const int64_t n = d[kbN], gs = d[kbSrcGroups];
  sscale.resize(n * gs);
  scales_to_float(src + d[kbScales], n, gs, d[kbScaleType], d[kbScalesKN] != 0, sscale.data());
  JobArgs a{};
  a.layout = d[kbLayout];
  a.data = src + d[kbWords];
  a.d0 = d[kbD0];
  a.d1 = d[kbD1];
  a.n = n;
  a.k = d[kbK];
  a.sscale = sscale.data();
  a.src_groups = gs;
  a.src_group = d[kbSrcGroup];
  a.g = d[kbG];
  a.bf16 = d[kbBf16] != 0;
  return a;
}

// Where a row's int8 weight goes: in place in the output (default format) or a scratch buffer (packed).
int8_t* q_target(const int64_t* d, bool packed, std::vector<int8_t>& qbuf, uint8_t* out) {
  if (!packed) return reinterpret_cast<int8_t*>(out + d[kbOutQ]);
  qbuf.resize(d[kbN] * d[kbK]);
  return qbuf.data();
}

// One module's output as the descriptor places it, and its CRCs in r: the packed blob (from q and
// the scales), or the scales beside the int8 weight already written at kbOutQ. bf16 scales are
// rounded to nearest even as torch casts them (exact for values that are bf16 already).
void ship(const int64_t* d, int64_t* r, const int8_t* q, const std::vector<float>& s, std::vector<uint16_t>& bits,
          bool bf16, bool packed, int64_t n, int64_t k, int64_t g, int64_t sbytes, uint8_t* out, int64_t threads) {
  const uint8_t* sb = reinterpret_cast<const uint8_t*>(s.data());
  if (bf16) {
    bits.resize(s.size());
    for (size_t i = 0; i < s.size(); ++i) {
      uint32_t w;
      std::memcpy(&w, &s[i], 4);
      bits[i] = static_cast<uint16_t>((w + 0x7FFFu + ((w >> 16) & 1u)) >> 16);
    }
    sb = reinterpret_cast<const uint8_t*>(bits.data());
  }
  if (packed) {
    uint8_t* blob = out + d[kbOutBlob];
    kleidiai_pack(q, 1, n, k, sb, bf16, nullptr, g, blob, d[kbBlobBytes], threads);
    r[kbCrcA] = crc32c_extend(0, blob, d[kbBlobBytes]);
    r[kbZlibQ] = crc32_extend(0, reinterpret_cast<const uint8_t*>(q), n * k);
    r[kbZlibS] = crc32_extend(0, sb, sbytes);
    r[kbZlibBlob] = crc32_extend(0, blob, d[kbBlobBytes]);
  } else {
    std::memcpy(out + d[kbOutS], sb, sbytes);
    r[kbCrcA] = crc32c_extend(0, reinterpret_cast<const uint8_t*>(q), n * k);
    r[kbCrcB] = crc32c_extend(0, out + d[kbOutS], sbytes);
  }
}

// the checks of a float-source row: its shape and its outputs inside the buffer (float_rows checks its source)
void check_float_row(const int64_t* d, int64_t m, int64_t out_len) {
  const int64_t n = d[kbN], k = d[kbK], g = d[kbG];
  I4P_CHECK(n > 0 && k > 0 && g > 0 && k % g == 0, "requant_batch: module ", m, ": bad shape");
  const int64_t sbytes = n * (k / g) * (d[kbBf16] ? 2 : 4);
  if (d[kbOutBlob] >= 0) {
    I4P_CHECK(in_range(d[kbOutBlob], d[kbBlobBytes], out_len), "requant_batch: blob outside the buffer");
  } else {
    I4P_CHECK(in_range(d[kbOutQ], n * k, out_len) && in_range(d[kbOutS], sbytes, out_len),
              "requant_batch: outputs outside the buffer");
  }
}

}  // namespace

void scales_to_float(const uint8_t* src, int64_t n, int64_t groups, int64_t dtype, bool kn, float* out) {
  const int64_t item = dtype == kScaleF32 ? 4 : 2;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < groups; ++j) {
      const uint8_t* p = src + (kn ? j * n + r : r * groups + j) * item;
      float v;
      if (dtype == kScaleF32) {
        v = load<float>(p);
      } else if (dtype == kScaleF16) {
        v = half_to_float(load<uint16_t>(p));
      } else {
        const uint32_t w = static_cast<uint32_t>(load<uint16_t>(p)) << 16;
        std::memcpy(&v, &w, 4);
      }
      out[r * groups + j] = v;
    }
  }
}

int64_t lossless_batch(const uint8_t* src, int64_t src_len, const int64_t* desc, int64_t count, uint8_t* out,
                       int64_t out_len, int64_t* res, double* tot, int64_t threads) {
  std::vector<float> sscale, s;
  std::vector<int8_t> qbuf;
  std::vector<uint16_t> bits;
  for (int64_t m = 0; m < count; ++m) {
    const int64_t* d = desc + m * kbFields;
    int64_t* r = res + m * kbResults;
    for (int64_t i = 0; i < kbResults; ++i) r[i] = 0;
    const int64_t n = d[kbN], k = d[kbK], g = d[kbG];
    I4P_CHECK(d[kbLayout] == kGptq || d[kbLayout] == kCt, "lossless_batch: module ", m, ": layout ", d[kbLayout]);
    check_row(d, m, "lossless_batch", src_len, out_len);
    I4P_CHECK(d[kbZeros] < 0 || in_range(d[kbZeros], d[kbZerosBytes], src_len), "lossless_batch: zeros outside");
    const int64_t groups = k / g, sbytes = n * groups * (d[kbBf16] ? 2 : 4);
    const bool packed = d[kbOutBlob] >= 0;
    // what the per-module path would read differently: hand the module back
    bool as_given = d[kbWords] % 4 == 0;
    if (as_given && d[kbZeros] >= 0) {
      const uint8_t* z = src + d[kbZeros];
      const uint8_t want = static_cast<uint8_t>(d[kbZeroByte]);
      as_given = std::all_of(z, z + d[kbZerosBytes], [want](uint8_t b) { return b == want; });
    }
    if (as_given && d[kbGidx] >= 0) {
      as_given = trivial_gidx(d, src, "lossless_batch");
    }
    if (!as_given) {
      r[0] = kNotAsGiven;
      continue;
    }
    JobArgs a = source_args(d, src, sscale);
    int8_t* q = q_target(d, packed, qbuf, out);
    s.resize(n * groups);
    const int64_t st = lossless_job(a, q, s.data(), tot + 5 * m, r + 1, threads);
    if (st != kDone) {
      r[0] = st;
      continue;
    }
    // the scales as shipped: bf16 (exact: lossless_job rounded them) or float32
    ship(d, r, q, s, bits, a.bf16 != 0, packed, n, k, g, sbytes, out, threads);
  }
  return 0;
}

// the scale search a requant job runs: the grid's coarse ratios and fine offsets (none: no search)
static void with_search(JobArgs& a, const float* coarse, int64_t n_coarse, const float* fine, int64_t n_fine) {
  a.search = n_coarse > 0;
  a.coarse = n_coarse > 0 ? coarse : nullptr;
  a.n_coarse = n_coarse;
  a.fine = n_fine > 0 ? fine : nullptr;
  a.n_fine = n_fine;
}

// requant_job on a row's job arguments, then its outputs and checksums (ship); a close call, a scale
// not finite or a refusal hands the module back (r[0])
static void requant_and_ship(const JobArgs& a, const int64_t* d, int64_t* r, double* tot, int64_t* zgroups,
                      std::vector<int8_t>& qbuf, std::vector<float>& s, std::vector<uint8_t>& flags,
                      std::vector<uint16_t>& bits, uint8_t* out, int64_t threads, const FloatRows* rows = nullptr) {
  const int64_t n = d[kbN], k = d[kbK], g = d[kbG], groups = k / g, sbytes = n * groups * (d[kbBf16] ? 2 : 4);
  const bool packed = d[kbOutBlob] >= 0;
  int8_t* q = q_target(d, packed, qbuf, out);
  s.resize(n * groups);
  flags.resize(n * groups);
  int64_t counts[2] = {0, 0};
  const int64_t st = requant_job(a, q, s.data(), flags.data(), tot, counts, r + 1, threads, rows);
  if (st != kDone) {
    r[0] = st;
    return;
  }
  *zgroups = counts[0];
  bool plain = counts[1] == 0;  // close calls: the per-module path decides them in torch
  for (int64_t i = 0; i < n * groups && plain; ++i) plain = std::isfinite(s[i]);
  if (!plain) {
    r[0] = kNotAsGiven;
    return;
  }
  // the scales as shipped: bf16 (the search's values are bf16 already) or float32
  ship(d, r, q, s, bits, a.bf16 != 0, packed, n, k, g, sbytes, out, threads);
}

// The requant path of many modules in one call (twin: convert's per-module path through
// w4a8.requant_job, which int4pack/batch.py falls back to): each module's packed words, scales and
// zero points read in place, the zero points unpacked as the readers unpack them (GPTQ qzeros
// [G, ceil(N/8)] along N, v1's whole-word add of 0x11111111; AWQ qzeros [G, N/8] in AWQ's nibble
// order; compressed-tensors weight_zero_point [ceil(N/8), G] along N), requant_job exactly as
// i4p_requant_job runs it, and the outputs and checksums as
// lossless_batch writes them. Handed back (kNotAsGiven): what the per-module path would read or
// decide otherwise -- zero points all 8 (lossless there), a g_idx that is not arange(K) / group,
// misaligned words, a v1 zero word holding an F nibble (the reader notes it), close calls (decided
// in torch there), a scale not finite -- and any refusal (its status: the per-module path words it).
// Float sources (FloatSource rows: bf16/f16/f32 weights, e4m3 or E2M1 times block scales) are decoded to
// float32 as their readers decode them, then searched as w4a8.requantize does; a NaN byte or a bad
// scale hands the module back (the reader refuses it there).
int64_t requant_batch(const uint8_t* src, int64_t src_len, const int64_t* desc, int64_t count, uint8_t* out,
                      int64_t out_len, const float* coarse, int64_t n_coarse, const float* fine, int64_t n_fine,
                      int64_t* res, double* tot, int64_t* zgroups, int64_t threads) {
  std::vector<float> sscale, s;
  std::vector<int8_t> qbuf;
  std::vector<uint8_t> zbuf, flags, cbuf;
  std::vector<uint16_t> bits;
  for (int64_t m = 0; m < count; ++m) {
    const int64_t* d = desc + m * kbFields;
    int64_t* r = res + m * kbResults;
    for (int64_t i = 0; i < kbResults; ++i) r[i] = 0;
    zgroups[m] = 0;
    const int64_t n = d[kbN], k = d[kbK], gs = d[kbSrcGroups], g = d[kbG], layout = d[kbLayout];
    if (layout == kSrcGguf && d[kbScaleType] == kGgufQ4_0) {  // codes and zero points, as the reader gives them
      check_float_row(d, m, out_len);
      const bool negative = q4_0_codes(d, m, src, src_len, cbuf, sscale, zbuf);
      JobArgs a{};
      a.layout = kCodes;
      a.data = cbuf.data();
      a.d0 = a.n = n;
      a.d1 = a.k = k;
      a.sscale = sscale.data();
      a.src_groups = k / 32;
      a.zeros = negative ? zbuf.data() : nullptr;
      a.src_group = 32;
      a.g = g;
      a.bf16 = d[kbBf16] != 0;
      if (negative) {
        with_search(a, coarse, n_coarse, fine, n_fine);
        requant_and_ship(a, d, r, tot + 6 * m, zgroups + m, qbuf, s, flags, bits, out, threads);
      } else {  // symmetric: the ints kept, as the per-module path keeps them (lossless_batch's steps)
        r[kbKeptInts] = 1;
        int8_t* q = q_target(d, d[kbOutBlob] >= 0, qbuf, out);
        s.resize(n * (k / g));
        const int64_t st = lossless_job(a, q, s.data(), tot + 6 * m, r + 1, threads);
        r[0] = st;
        if (st == kDone)
          ship(d, r, q, s, bits, a.bf16 != 0, d[kbOutBlob] >= 0, n, k, g, n * (k / g) * (a.bf16 ? 2 : 4), out,
               threads);
      }
      continue;
    }
    if (layout >= kSrcBf16 && layout <= kSrcGguf) {  // a float source: its rows decoded in the float job
      check_float_row(d, m, out_len);
      const std::unique_ptr<FloatRows> rows = float_rows(d, m, src, src_len);
      if (!rows) {
        r[0] = kNotAsGiven;
        continue;
      }
      JobArgs a{};
      a.layout = kFloat;
      a.d0 = n;
      a.d1 = k;
      a.n = n;
      a.k = k;
      a.g = g;
      a.bf16 = d[kbBf16] != 0;
      with_search(a, coarse, n_coarse, fine, n_fine);
      requant_and_ship(a, d, r, tot + 6 * m, zgroups + m, qbuf, s, flags, bits, out, threads, rows.get());
      continue;
    }
    I4P_CHECK(layout == kGptq || layout == kAwq || layout == kCt, "requant_batch: module ", m, ": layout ", layout);
    check_row(d, m, "requant_batch", src_len, out_len);
    const int64_t zw = layout == kAwq ? n / 8 : (n + 7) / 8;  // zero words per group (CT: per column of words)
    I4P_CHECK(layout != kAwq || n % 8 == 0, "requant_batch: module ", m, ": AWQ N not a multiple of 8");
    I4P_CHECK(d[kbZeros] >= 0 && d[kbZerosBytes] == gs * zw * 4 && in_range(d[kbZeros], d[kbZerosBytes], src_len),
              "requant_batch: module ", m, ": zeros outside the mapping or not [G, N/8] words");
    bool as_given = d[kbWords] % 4 == 0 && d[kbZeros] % 4 == 0;
    if (as_given && d[kbGidx] >= 0) {
      as_given = trivial_gidx(d, src, "requant_batch");
    }
    // the zero points [N, Gs]
    const bool v1 = layout == kGptq && d[kbZeroByte] == 0x77;
    const uint8_t* zsrc = src + d[kbZeros];
    if (as_given && v1) {  // the reader notes a v1 F nibble: leave such a module to it
      for (int64_t i = 0; i < d[kbZerosBytes] && as_given; ++i)
        as_given = (zsrc[i] & 0x0F) != 0x0F && (zsrc[i] >> 4) != 0x0F;
    }
    if (!as_given) {
      r[0] = kNotAsGiven;
      continue;
    }
    zbuf.resize(n * gs);
    if (layout == kAwq) {
      unpack_awq_words(reinterpret_cast<const uint32_t*>(zsrc), zbuf.data(), gs, zw, 0, zw, 0);
    } else if (layout == kCt) {  // words [ceil(N/8), Gs], packed along N: the nibble is the zero point
      for (int64_t w = 0; w < zw; ++w)
        for (int64_t j = 0; j < gs; ++j) {
          const uint32_t word = load<uint32_t>(zsrc + (w * gs + j) * 4);
          for (int64_t b = 0; b < 8 && 8 * w + b < n; ++b) zbuf[(8 * w + b) * gs + j] = (word >> (4 * b)) & 0xFu;
        }
    } else {
      for (int64_t j = 0; j < gs; ++j)
        for (int64_t w = 0; w < zw; ++w) {
          uint32_t word = load<uint32_t>(zsrc + (j * zw + w) * 4);
          if (v1) word += 0x11111111u;
          for (int64_t b = 0; b < 8 && 8 * w + b < n; ++b) zbuf[(8 * w + b) * gs + j] = (word >> (4 * b)) & 0xFu;
        }
    }
    if (std::all_of(zbuf.begin(), zbuf.end(), [](uint8_t z) { return z == 8; })) {  // lossless there
      r[0] = kNotAsGiven;
      continue;
    }
    JobArgs a = source_args(d, src, sscale);
    a.zeros = zbuf.data();
    with_search(a, coarse, n_coarse, fine, n_fine);
    requant_and_ship(a, d, r, tot + 6 * m, zgroups + m, qbuf, s, flags, bits, out, threads);
  }
  return 0;
}

}  // namespace i4p
