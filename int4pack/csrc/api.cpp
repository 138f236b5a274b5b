// The library's C ABI: what int4pack/_native.py calls through ctypes. Every function takes raw
// pointers and sizes (the Python side checks dtypes, shapes and contiguity and allocates the
// outputs) and returns a status: -1 for a failed check, whose message i4p_last_error() gives on
// the same thread; kVanished (-2) for input bytes that vanished under the call (a mapped source
// shard cut: fault_guard.h), whose address i4p_last_fault() gives; other values as documented
// per function. The GIL is released by ctypes.

#include "common.h"
#include "convert_kernels/convert_kernels.h"

#include <algorithm>
#include <cstring>
#include <new>

namespace i4p {
void kleidiai_pack(const int8_t* q, int64_t E, int64_t N, int64_t K, const void* scales, bool scales_bf16,
                   const float* bias, int64_t group_size, uint8_t* out, int64_t bytes, int64_t threads);
int64_t kleidiai_unpack(const uint8_t* blob, int64_t bytes, int64_t N, int64_t K, int64_t g, bool check,
                        bool has_bias, int8_t* q, void* scales, float* bias, int64_t threads);
void int8_range(const int8_t* p, int64_t n, int64_t threads, int64_t* lo_hi);
void dequant_w4a8(const int8_t* q, int64_t N, int64_t K, int64_t g, const void* scales, bool bf16, float* out,
                  int64_t threads);
void ref_pack(const int8_t* q, int64_t N, int64_t K, const void* scales, bool bf16, int64_t nscales, float* out,
              int64_t threads);
int64_t kleidiai_verify_blob(const uint8_t* blob, int64_t bytes, int64_t N, int64_t K, int64_t g, bool has_bias,
                             int8_t* q, void* scales, float* bias, uint8_t* repack, uint32_t* crcs,
                             int64_t threads);
void dequant_sq(const int8_t* q, int64_t N, int64_t K, int64_t g, const void* scales, bool bf16, float* out,
                float* row_sq, float* col_sq);
void w4a8_matmul(const float* x, int64_t M, int64_t K, const int8_t* q, int64_t N, int64_t bl, const void* scales,
                 bool bf16, float* y, int64_t threads, bool simd);
bool w4a8_matmul_avx2();
void act_noise(const float* x, int64_t M, int64_t H, const float* y13, const float* act, int64_t I,
               const float* sq13, const float* sq2, int64_t kind, float* out);
void w4a8_reference(const float* x, int64_t M, int64_t K, const int8_t* q, int64_t N, int64_t g, const void* scales,
                    bool bf16, float* y, float* row_sq, float* col_sq, float* group_sq);
}

using namespace i4p;

namespace {

thread_local std::string t_error;
thread_local uintptr_t t_fault = 0;

constexpr int64_t kVanished = -2;  // _native.VANISHED

// f() run guarded (fault_guard.h); a C++ exception becomes -1 and its message, a fault kVanished
template <class F>
int64_t guarded(const F& f) {
  uintptr_t fault = 0;
  try {
    int64_t status = 0;
    fault = run_guarded([&] { status = f(); });
    if (fault == 0) return status;
  } catch (const SourceFault& e) {  // taken on a thread of for_rows
    fault = e.address;
  } catch (const std::bad_alloc&) {
    t_error = "out of memory";
  } catch (const std::exception& e) {
    t_error = e.what();
  } catch (...) {
    t_error = "unknown C++ exception";
  }
  if (fault == 0) return -1;
  t_fault = fault;
  t_error = "input bytes vanished under the kernel (SIGBUS)";
  return kVanished;
}

}  // namespace

// bumped whenever a signature below changes: _native.py refuses a library of another version
I4P_EXPORT int64_t i4p_abi_version() { return 2; }

I4P_EXPORT const char* i4p_last_error() { return t_error.c_str(); }

// the address whose read faulted, after a call returned kVanished on this thread
I4P_EXPORT uint64_t i4p_last_fault() { return t_fault; }

#ifndef I4P_SOURCE_HASH
#define I4P_SOURCE_HASH "unknown"
#endif
// the hash of the sources this library was built from (_build.source_hash)
I4P_EXPORT const char* i4p_source_hash() { return I4P_SOURCE_HASH; }

// the tables Python reads instead of restating them (_native.tables): "table:name=value,...;"
// for the tensor jobs' statuses, the batch descriptor's fields, its result columns and scale types
#define I4P_TABLE_ITEM(e, v, name) #name "=" #v ","
I4P_EXPORT const char* i4p_tables() {
  return "job_status:" I4P_JOB_STATUS(I4P_TABLE_ITEM) ";batch_field:" I4P_BATCH_FIELD(I4P_TABLE_ITEM)
         ";batch_result:" I4P_BATCH_RESULT(I4P_TABLE_ITEM) ";scale_type:" I4P_SCALE_TYPE(I4P_TABLE_ITEM) ";";
}
#undef I4P_TABLE_ITEM

// GPTQ qweight [K/8, N] -> codes uint8 [N, K]
I4P_EXPORT int64_t i4p_unpack_gptq(const uint32_t* w, int64_t kw, int64_t n, uint8_t* out, int64_t threads) {
  return guarded([&] {
    for_rows(n, 64, threads, [&](int64_t r0, int64_t r1) { unpack_gptq_rows(w, out, n, kw, r0, r1, 0); });
    return int64_t{0};
  });
}

// compressed-tensors weight_packed [N, kw] -> codes uint8 [N, K], K <= 8 kw
I4P_EXPORT int64_t i4p_unpack_ct(const uint32_t* w, int64_t n, int64_t kw, int64_t k, uint8_t* out,
                                 int64_t threads) {
  return guarded([&] {
    I4P_CHECK(k >= 0 && k <= kw * 8, "weight_packed: K=", k, " does not fit ", kw, " words");
    for_rows(n, 16, threads, [&](int64_t r0, int64_t r1) { unpack_ct_rows(w, kw, k, out, r0, r1, 0); });
    return int64_t{0};
  });
}

// AWQ GEMM qweight [K, N/8] -> codes uint8 [N, K]
I4P_EXPORT int64_t i4p_unpack_awq(const uint32_t* w, int64_t k, int64_t nw, uint8_t* out, int64_t threads) {
  return guarded([&] {
    const int64_t nb = nw / 8;
    for_rows(nb, 1, threads, [&](int64_t b0, int64_t b1) { unpack_awq_words(w, out, k, nw, 8 * b0, 8 * b1, 0); });
    unpack_awq_words(w, out, k, nw, 8 * nb, nw, 0);  // the last words when N/8 is not a multiple of 8
    return int64_t{0};
  });
}

// the tensor job of each path (convert_kernels.h): its status (>= 0, JobStatus) or -1
I4P_EXPORT int64_t i4p_lossless_job(const JobArgs* a, int8_t* q, float* s, double* tot, int64_t* report,
                                    int64_t threads) {
  return guarded([&] { return lossless_job(*a, q, s, tot, report, threads); });
}

I4P_EXPORT int64_t i4p_requant_job(const JobArgs* a, int8_t* q, float* s, uint8_t* flags, double* tot,
                                   int64_t* counts, int64_t* report, int64_t threads) {
  return guarded([&] { return requant_job(*a, q, s, flags, tot, counts, report, threads); });
}

I4P_EXPORT int64_t i4p_requant_supported() { return requant_supported(); }

I4P_EXPORT void i4p_search_batches(int64_t* out) { search_batches(out); }

I4P_EXPORT void i4p_element_groups(int64_t* out) { element_groups(out); }

I4P_EXPORT void i4p_element_candidates(int64_t* out) { element_candidates(out); }

I4P_EXPORT int64_t i4p_force_search64(int64_t on) { return force_search64(on != 0); }

I4P_EXPORT int64_t i4p_use_awq_avx2(int64_t on) { return use_awq_avx2(on != 0); }

// CRC-32C of p[0..n) continuing from crc (0 to start)
I4P_EXPORT uint32_t i4p_crc32c(const uint8_t* p, int64_t n, uint32_t crc) { return crc32c_extend(crc, p, n); }

// copy src[0..n) into dst and return the CRC-32C of those bytes, continuing from crc
I4P_EXPORT uint32_t i4p_crc32c_copy(const uint8_t* src, uint8_t* dst, int64_t n, uint32_t crc) {
  // in steps that stay in cache between the copy and the CRC: one pass over the source
  constexpr int64_t kStep = 3 * kCrcBlock * 4;
  for (int64_t i = 0; i < n; i += kStep) {
    const int64_t m = std::min(kStep, n - i);
    std::memcpy(dst + i, src + i, m);
    crc = crc32c_extend(crc, dst + i, m);
  }
  return crc;
}

// KleidiAI RHS blobs (kleidiai_pack.cpp)
I4P_EXPORT int64_t i4p_kleidiai_pack(const int8_t* q, int64_t e, int64_t n, int64_t k, const void* scales,
                                     int64_t scales_bf16, const float* bias, int64_t group_size, uint8_t* out,
                                     int64_t bytes, int64_t threads) {
  return guarded([&] {
    kleidiai_pack(q, e, n, k, scales, scales_bf16 != 0, bias, group_size, out, bytes, threads);
    return int64_t{0};
  });
}

// reading blobs back, and verify's whole-matrix helpers (kleidiai_unpack.cpp)
I4P_EXPORT int64_t i4p_kleidiai_unpack(const uint8_t* blob, int64_t bytes, int64_t n, int64_t k, int64_t g,
                                       int64_t check, int64_t has_bias, int8_t* q, void* scales, float* bias,
                                       int64_t threads) {
  return guarded([&] { return kleidiai_unpack(blob, bytes, n, k, g, check != 0, has_bias != 0, q, scales, bias, threads); });
}

I4P_EXPORT int64_t i4p_int8_range(const int8_t* p, int64_t n, int64_t threads, int64_t* lo_hi) {
  return guarded([&] {
    int8_range(p, n, threads, lo_hi);
    return int64_t{0};
  });
}

I4P_EXPORT int64_t i4p_dequant_w4a8(const int8_t* q, int64_t n, int64_t k, int64_t g, const void* scales,
                                    int64_t bf16, float* out, int64_t threads) {
  return guarded([&] {
    dequant_w4a8(q, n, k, g, scales, bf16 != 0, out, threads);
    return int64_t{0};
  });
}

I4P_EXPORT int64_t i4p_ref_pack(const int8_t* q, int64_t n, int64_t k, const void* scales, int64_t bf16,
                                int64_t nscales, float* out, int64_t threads) {
  return guarded([&] {
    ref_pack(q, n, k, scales, bf16 != 0, nscales, out, threads);
    return int64_t{0};
  });
}

// the lossless path of many modules (batch.cpp): 0, each module's status in res, or -1
I4P_EXPORT int64_t i4p_lossless_batch(const uint8_t* src, int64_t src_len, const int64_t* desc, int64_t count,
                                      uint8_t* out, int64_t out_len, int64_t* res, double* tot, int64_t threads) {
  return guarded([&] { return lossless_batch(src, src_len, desc, count, out, out_len, res, tot, threads); });
}

// the requant path of many modules (batch.cpp): 0, each module's status in res, or -1
I4P_EXPORT int64_t i4p_requant_batch(const uint8_t* src, int64_t src_len, const int64_t* desc, int64_t count,
                                     uint8_t* out, int64_t out_len, const float* coarse, int64_t n_coarse,
                                     const float* fine, int64_t n_fine, int64_t* res, double* tot, int64_t* zgroups,
                                     int64_t threads) {
  return guarded([&] {
    return requant_batch(src, src_len, desc, count, out, out_len, coarse, n_coarse, fine, n_fine, res, tot, zgroups,
                         threads);
  });
}

// a decoded source's values [N, K] as requant_batch's job reads them (float_rows.cpp; GGUF Q4_0: (c - z) * s
// of its codes): 0, 1 where the batch hands the module back, or -1 (tests)
I4P_EXPORT int64_t i4p_float_rows(const uint8_t* src, int64_t src_len, const int64_t* desc, float* out) {
  return guarded([&] {
    const int64_t n = desc[kbN], k = desc[kbK];
    if (desc[kbLayout] == kSrcGguf && desc[kbScaleType] == kGgufQ4_0) {
      std::vector<uint8_t> codes, zeros;
      std::vector<float> scales;
      q4_0_codes(desc, 0, src, src_len, codes, scales, zeros);
      for (int64_t i = 0; i < n * k; ++i)
        out[i] = (static_cast<float>(codes[i]) - static_cast<float>(zeros[i / 32])) * scales[i / 32];
      return int64_t{0};
    }
    const std::unique_ptr<FloatRows> rows = float_rows(desc, 0, src, src_len);
    if (!rows) return int64_t{1};
    for (int64_t r = 0; r < n; ++r) rows->row(r, out + r * k);
    return int64_t{0};
  });
}

// zlib's CRC-32 of p[0..n) continuing from crc (crc32.cpp)
I4P_EXPORT uint32_t i4p_crc32(const uint8_t* p, int64_t n, uint32_t crc) { return crc32_extend(crc, p, n); }

// zlib's CRC-32 of each of n buffers (ptrs[i], lens[i] bytes) into out[i]: the vLLM plugin's blobs,
// many in one call, so that its checking thread takes Python's GIL once for them all
I4P_EXPORT void i4p_crc32_many(const uint8_t* const* ptrs, const int64_t* lens, int64_t n, uint32_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = crc32_extend(0, ptrs[i], lens[i]);
}

I4P_EXPORT int64_t i4p_use_crc32_clmul(int64_t on) { return use_crc32_clmul(on != 0); }

// source scales (ScaleType, [N, G] or stored [G, N]) as float32 [N, G] (batch.cpp)
I4P_EXPORT int64_t i4p_scales_to_float(const uint8_t* src, int64_t n, int64_t groups, int64_t dtype, int64_t kn,
                                       float* out) {
  return guarded([&] {
    I4P_CHECK(dtype >= kScaleF32 && dtype <= kScaleBf16, "scales_to_float: dtype ", dtype);
    scales_to_float(src, n, groups, dtype, kn != 0, out);
    return int64_t{0};
  });
}

// a blob's CRC-32, its decode with the checks, the CRC-32s of what it decodes to, repack and compare
// (kleidiai_unpack.cpp): failed-check bits, 64 for a repack that differs
I4P_EXPORT int64_t i4p_kleidiai_verify_blob(const uint8_t* blob, int64_t bytes, int64_t n, int64_t k, int64_t g,
                                            int64_t has_bias, int8_t* q, void* scales, float* bias, uint8_t* repack,
                                            uint32_t* crcs, int64_t threads) {
  return guarded([&] {
    return kleidiai_verify_blob(blob, bytes, n, k, g, has_bias != 0, q, scales, bias, repack, crcs, threads);
  });
}

I4P_EXPORT int64_t i4p_dequant_sq(const int8_t* q, int64_t n, int64_t k, int64_t g, const void* scales, int64_t bf16,
                                  float* out, float* row_sq, float* col_sq) {
  return guarded([&] {
    dequant_sq(q, n, k, g, scales, bf16 != 0, out, row_sq, col_sq);
    return int64_t{0};
  });
}

// torch's reference W4A8 matmul on int4 values and scales (verify_kernels/w4a8_matmul.cpp); simd 0:
// the portable loops
I4P_EXPORT int64_t i4p_w4a8_matmul(const float* x, int64_t m, int64_t k, const int8_t* q, int64_t n, int64_t bl,
                                   const void* scales, int64_t bf16, float* y, int64_t threads, int64_t simd) {
  return guarded([&] {
    w4a8_matmul(x, m, k, q, n, bl, scales, bf16 != 0, y, threads, simd != 0);
    return int64_t{0};
  });
}

// 1 where w4a8_matmul runs its AVX2 loops on this CPU
I4P_EXPORT int64_t i4p_w4a8_matmul_avx2() { return w4a8_matmul_avx2() ? 1 : 0; }

// verify's float32 reference x @ dequant(q, scales)^T with dequant_sq's squared sums (kleidiai_unpack.cpp)
I4P_EXPORT int64_t i4p_w4a8_reference(const float* x, int64_t m, int64_t k, const int8_t* q, int64_t n, int64_t g,
                                      const void* scales, int64_t bf16, float* y, float* row_sq, float* col_sq,
                                      float* group_sq) {
  return guarded([&] {
    w4a8_reference(x, m, k, q, n, g, scales, bf16 != 0, y, row_sq, col_sq, group_sq);
    return int64_t{0};
  });
}

// verify's predicted activation-quantisation error of one expert's rows (verify_kernels/noise.cpp)
I4P_EXPORT int64_t i4p_act_noise(const float* x, int64_t m, int64_t h, const float* y13, const float* act, int64_t i,
                                 const float* sq13, const float* sq2, int64_t kind, float* out) {
  return guarded([&] {
    act_noise(x, m, h, y13, act, i, sq13, sq2, kind, out);
    return int64_t{0};
  });
}
