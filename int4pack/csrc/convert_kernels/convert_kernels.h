// Shared by the convert_kernels sources (several files by kernel family, one library with the
// KleidiAI packer): includes, build macros, byte-vector helpers and the declarations each family
// exposes to the others and to api.cpp. No torch headers: the kernels take pointers and sizes.
//
// Every kernel has a pure-torch twin (int4pack/nibbles.py, int4pack/w4a8.py,
// int4pack/scale_search.py, int4pack/kernels.py) that stays the oracle: tests/test_kernels.py
// compares the bytes.
#pragma once

#include "../common.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
#define I4P_CRC_X86 1
#include <immintrin.h>
#define I4P_AWQ_AVX2 1  // unpack_awq_block_avx2, picked at run time
#endif
#if defined(__aarch64__) && defined(__GNUC__) && defined(__linux__)
#include <sys/auxv.h>
#define I4P_CRC_ARM 1
#endif

namespace i4p {

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
// an AVX2/FMA build of the heavy loops next to the baseline one, picked at load time
#define I4P_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define I4P_CLONES
#endif
// helpers of the I4P_CLONES functions are forced inline: a call would run their default build
#define I4P_INLINE inline __attribute__((always_inline))
#define I4P_LAMBDA_INLINE __attribute__((always_inline))

#ifdef I4P_CRC_ARM
// Armv8's CRC32 instructions (optional in v8.0, mandatory from v8.1; every Neoverse has them): asked
// of the kernel (HWCAP_CRC32, bit 7), written through .arch_extension so the build needs no -march.
// crc32x is zlib's CRC-32, crc32cx CRC-32C; both take 8 little-endian bytes a step.
inline bool arm_has_crc() {
  static const bool yes = (getauxval(AT_HWCAP) & (1ul << 7)) != 0;
  return yes;
}
#define I4P_ARM_CRC_OP(name, insn, arg, reg)                                              \
  I4P_INLINE uint32_t name(uint32_t c, arg x) {                                          \
    asm(".arch_extension crc\n\t" insn " %w0, %w0, %" reg "1" : "+r"(c) : "r"(x)); \
    return c;                                                                            \
  }
I4P_ARM_CRC_OP(arm_crc32x, "crc32x", uint64_t, "x")
I4P_ARM_CRC_OP(arm_crc32b, "crc32b", uint32_t, "w")
I4P_ARM_CRC_OP(arm_crc32cx, "crc32cx", uint64_t, "x")
I4P_ARM_CRC_OP(arm_crc32cb, "crc32cb", uint32_t, "w")
#undef I4P_ARM_CRC_OP
#endif

// a T from unaligned bytes (the host's byte order)
template <class T>
I4P_INLINE T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// whether [off, off + bytes) lies inside [0, len)
inline bool in_range(int64_t off, int64_t bytes, int64_t len) { return off >= 0 && bytes >= 0 && off <= len - bytes; }

// byte i of the result = nibble i of w
I4P_INLINE uint64_t spread_nibbles(uint32_t w) {
  uint64_t v = w;
  v = (v | (v << 16)) & 0x0000FFFF0000FFFFull;
  v = (v | (v << 8)) & 0x00FF00FF00FF00FFull;
  v = (v | (v << 4)) & 0x0F0F0F0F0F0F0F0Full;
  return v;
}

// ------------------------------------------------------------------------------------ byte vectors

typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

#if defined(__clang__)
#define I4P_SHUF(T, a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define I4P_SHUF(T, a, b, ...) __builtin_shuffle(a, b, T{__VA_ARGS__})
#endif
#define I4P_SHUF8(a, b, ...) I4P_SHUF(u8x32, a, b, __VA_ARGS__)

// interleave the low (lo) or high (hi) halves of units of 1, 2, 4, 8 bytes of a and b, each
// 128-bit half on its own (what x86's unpack instructions do)
I4P_INLINE u8x32 lo8(u8x32 a, u8x32 b) {
  return I4P_SHUF8(a, b, 0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                   16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55);
}
I4P_INLINE u8x32 hi8(u8x32 a, u8x32 b) {
  return I4P_SHUF8(a, b, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47,
                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63);
}
I4P_INLINE u8x32 lo16(u8x32 a, u8x32 b) {
  return I4P_SHUF8(a, b, 0, 1, 32, 33, 2, 3, 34, 35, 4, 5, 36, 37, 6, 7, 38, 39,
                   16, 17, 48, 49, 18, 19, 50, 51, 20, 21, 52, 53, 22, 23, 54, 55);
}
I4P_INLINE u8x32 hi16(u8x32 a, u8x32 b) {
  return I4P_SHUF8(a, b, 8, 9, 40, 41, 10, 11, 42, 43, 12, 13, 44, 45, 14, 15, 46, 47,
                   24, 25, 56, 57, 26, 27, 58, 59, 28, 29, 60, 61, 30, 31, 62, 63);
}
I4P_INLINE u8x32 lo32(u8x32 a, u8x32 b) {
  return I4P_SHUF8(a, b, 0, 1, 2, 3, 32, 33, 34, 35, 4, 5, 6, 7, 36, 37, 38, 39,
                   16, 17, 18, 19, 48, 49, 50, 51, 20, 21, 22, 23, 52, 53, 54, 55);
}
I4P_INLINE u8x32 hi32(u8x32 a, u8x32 b) {
  return I4P_SHUF8(a, b, 8, 9, 10, 11, 40, 41, 42, 43, 12, 13, 14, 15, 44, 45, 46, 47,
                   24, 25, 26, 27, 56, 57, 58, 59, 28, 29, 30, 31, 60, 61, 62, 63);
}
I4P_INLINE u8x32 lo64(u8x32 a, u8x32 b) {
  return I4P_SHUF8(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 32, 33, 34, 35, 36, 37, 38, 39,
                   16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51, 52, 53, 54, 55);
}
I4P_INLINE u8x32 hi64(u8x32 a, u8x32 b) {
  return I4P_SHUF8(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47,
                   24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63);
}

// 16-byte units for the unpack kernels. On x86 they are the SSE2 unpack instructions themselves:
// GCC may lower the same transpose written as generic 32-byte shuffles to scalar moves
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint64_t u64x2 __attribute__((vector_size(16)));
#if defined(__SSE2__)
#define I4P_UNPACK(name, op) \
  I4P_INLINE u8x16 name(u8x16 a, u8x16 b) { return (u8x16)op((__m128i)a, (__m128i)b); }
I4P_UNPACK(lo8x16, _mm_unpacklo_epi8)
I4P_UNPACK(hi8x16, _mm_unpackhi_epi8)
I4P_UNPACK(lo16x16, _mm_unpacklo_epi16)
I4P_UNPACK(hi16x16, _mm_unpackhi_epi16)
I4P_UNPACK(lo32x16, _mm_unpacklo_epi32)
I4P_UNPACK(hi32x16, _mm_unpackhi_epi32)
I4P_UNPACK(lo64x16, _mm_unpacklo_epi64)
I4P_UNPACK(hi64x16, _mm_unpackhi_epi64)
#undef I4P_UNPACK
#else
#define I4P_SHUF16(a, b, ...) I4P_SHUF(u8x16, a, b, __VA_ARGS__)
I4P_INLINE u8x16 lo8x16(u8x16 a, u8x16 b) { return I4P_SHUF16(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23); }
I4P_INLINE u8x16 hi8x16(u8x16 a, u8x16 b) {
  return I4P_SHUF16(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}
I4P_INLINE u8x16 lo16x16(u8x16 a, u8x16 b) { return I4P_SHUF16(a, b, 0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23); }
I4P_INLINE u8x16 hi16x16(u8x16 a, u8x16 b) {
  return I4P_SHUF16(a, b, 8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31);
}
I4P_INLINE u8x16 lo32x16(u8x16 a, u8x16 b) { return I4P_SHUF16(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23); }
I4P_INLINE u8x16 hi32x16(u8x16 a, u8x16 b) {
  return I4P_SHUF16(a, b, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
}
I4P_INLINE u8x16 lo64x16(u8x16 a, u8x16 b) { return I4P_SHUF16(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23); }
I4P_INLINE u8x16 hi64x16(u8x16 a, u8x16 b) {
  return I4P_SHUF16(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
#undef I4P_SHUF16
#endif

I4P_INLINE void store_unit(uint8_t* dst, u8x16 v, int u) {
#if defined(__SSE2__)
  if (u == 0) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), (__m128i)v);
  } else {
    _mm_storeh_pd(reinterpret_cast<double*>(dst), _mm_castsi128_pd((__m128i)v));
  }
#else
  const uint64_t x = ((u64x2)v)[u];
  std::memcpy(dst, &x, 8);
#endif
}

// 4 words -> their 32 nibbles as bytes, in order: a holds words 0 and 1, b words 2 and 3 (byte u
// of a word holds its nibbles 2u, low, and 2u + 1, high)
I4P_INLINE void nibbles4v(u8x16 v, u8x16& a, u8x16& b) {
  const u8x16 lo = v & 0x0F, hi = (u8x16)((u64x2)v >> 4) & 0x0F;
  a = lo8x16(lo, hi);
  b = hi8x16(lo, hi);
}

I4P_INLINE void nibbles4(const uint32_t* w, u8x16& a, u8x16& b) {
  u8x16 v;
  std::memcpy(&v, w, 16);
  nibbles4v(v, a, b);
}

// GPTQ words t..t+3 of rows r..r+3 ([K/8, N]: w at word (t, r), rows N words apart) -> each row's
// 32 codes less bias, stored whole at dst + i * k: a 4 x 4 transpose of the words, then 16-byte
// stores (one word per row at a time would take twice the stores)
I4P_INLINE void gptq_quad(const uint32_t* w, int64_t n, uint8_t* dst, int64_t k, uint8_t bias) {
  u8x16 x0, x1, x2, x3;
  std::memcpy(&x0, w, 16);
  std::memcpy(&x1, w + n, 16);
  std::memcpy(&x2, w + 2 * n, 16);
  std::memcpy(&x3, w + 3 * n, 16);
  const u8x16 a0 = lo32x16(x0, x1), a1 = hi32x16(x0, x1), a2 = lo32x16(x2, x3), a3 = hi32x16(x2, x3);
  const u8x16 rows[4] = {lo64x16(a0, a2), hi64x16(a0, a2), lo64x16(a1, a3), hi64x16(a1, a3)};
  for (int i = 0; i < 4; ++i) {
    u8x16 a, b;
    nibbles4v(rows[i], a, b);
    a -= bias;
    b -= bias;
    std::memcpy(dst + i * k, &a, 16);
    std::memcpy(dst + i * k + 16, &b, 16);
  }
}


I4P_INLINE float ship_bf16(float x) {
  // float32 -> bfloat16 (round to nearest even) -> float32, as c10::BFloat16 does for finite x
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  u &= 0xFFFF0000u;
  float y;
  std::memcpy(&y, &u, 4);
  return y;
}

// ---- unpack.cpp
// row ranges into a caller's buffer (the whole tensor, or the one-pass jobs' 64 rows at a time)
void unpack_gptq_rows(const uint32_t* w, uint8_t* o, int64_t n, int64_t kw, int64_t r0, int64_t r1, int64_t o0,
                      uint8_t bias = 0);
void unpack_ct_rows(const uint32_t* w, int64_t kw, int64_t k, uint8_t* o, int64_t r0, int64_t r1, int64_t o0);
void unpack_awq_words(const uint32_t* w, uint8_t* o, int64_t k, int64_t nw, int64_t j0, int64_t j1, int64_t o0);
bool use_awq_avx2(bool on);  // tests: returns the previous setting

// ---- job.cpp: what the two tensor jobs (lossless.cpp, requant.cpp) share

// the source's layout: records.Packing (0 codes uint8 [N, K], int32 words of 1 compressed-tensors
// [N, K/8], 2 GPTQ [K/8, N], 3 AWQ [K, N/8]), or 4 float32 values [N, K] (w4a8.requantize)
enum Layout : int64_t { kCodes = 0, kCt = 1, kGptq = 2, kAwq = 3, kFloat = 4 };

// a float source's rows as float32, decoded one at a time (float_rows.cpp)
struct FloatRows {
  virtual ~FloatRows() = default;
  virtual void row(int64_t r, float* x) const = 0;  // row r's K values
};

// a tensor job's inputs (_native._JobArgs)
struct JobArgs {
  int64_t layout;
  const void* data;
  int64_t d0, d1;  // data's shape
  int64_t n, k;
  const float* sscale;  // source scales [N, Gs] (null for float values)
  int64_t src_groups;  // Gs
  const uint8_t* zeros;  // zero points [N, Gs], or null: all 8
  const int64_t* gidx;  // source group of each column [K], or null: column i in group i / src_group
  int64_t src_group;
  int64_t g;  // target group width (K: channel)
  int32_t bf16, search;  // bf16 (else fp32) target scales; the scale search (else RTN)
  const float* coarse;  // the search's candidate ratios and fine offsets (kernels.search_points)
  int64_t n_coarse;
  const float* fine;
  int64_t n_fine;
};

// a job's answer: done, or what it refused, with the place in report[3] (row, group, how many
// more of the same kind) where the message names one (w4a8._refusal words it)
// (the X lists name each value once: the enums and the table i4p_tables() exports to Python)
#define I4P_JOB_STATUS(X)                                                                      \
  X(kDone, 0, done)                                                                            \
  X(kScaleNotFinite, 1, scale_not_finite)   /* a source scale NaN or Inf (report: the first) */ \
  X(kScaleNegative, 2, scale_negative)      /* a negative source scale (report: the first) */   \
  X(kScaleErases, 3, scale_erases)          /* a zero scale over a code off its zero point */   \
  X(kCastNotFinite, 4, cast_not_finite)     /* a target scale not finite in bf16 (lossless) */  \
  X(kWeightNotFinite, 5, weight_not_finite) /* a source value (c - z) * s not finite (requant) */
#define I4P_ENUM_ITEM(e, v, name) e = v,
enum JobStatus : int64_t { I4P_JOB_STATUS(I4P_ENUM_ITEM) };

// the job's shapes, groups and g_idx; last: the last layout the job reads
void check_job(const JobArgs& a, int64_t last, const char* what);
// the source scales as w4a8.check_scales takes them: not finite, then negative (kDone or the
// status, report filled); zero_seen: whether some scale is zero (then see erased_in_row)
int64_t check_source_scales(const JobArgs& a, int64_t* report, bool& zero_seen);
// rows [r0, r1) of the source's codes, unpacked into buf (row r at buf + (r - r0) * K); r0 a
// multiple of 8 for AWQ
void unpack_block(const JobArgs& a, int64_t r0, int64_t r1, uint8_t* buf);
// the source group of the first column of row r whose scale is zero while its value is not the
// group's zero point (a weight the zero scale would erase), or -1. values: row r's K values;
// zero: the value every zero point stands for, or -1 to read the zero points (8 without)
int64_t erased_in_row(const JobArgs& a, int64_t r, const uint8_t* values, int zero);
constexpr int64_t kJobRows = 64;  // rows unpacked at a time (8 AWQ words; 128 KB of codes at K = 2048)

// ---- lossless.cpp
// the lossless path: q = codes - 8, the target scales cast from the source's, the cast's error.
// Returns the status; when kDone, q int8 [N, K], s float32 [N, K/g] (the shipped values) and
// tot [5] (dd, ww, vv, wv, max_abs) are filled
int64_t lossless_job(const JobArgs& a, int8_t* q, float* s, double* tot, int64_t* report, int64_t threads);

// ---- requant.cpp
// the requant path: the scale search of every target group. Returns the status; when kDone,
// q int8 [N, K], s float32 [N, K/g], flags uint8 [N, K/g] (bit 0: a close call, left to
// kernels.redo_close_calls; bit 2: a zero group), tot [6] (dd, ww, vv, wv, baseline sse, max_abs;
// dd, vv, wv and max_abs without the close calls) and counts [2] (zero groups, close calls)
// rows: the values of a kFloat job without data, decoded in the job (requant_batch's float sources)
int64_t requant_job(const JobArgs& a, int8_t* q, float* s, uint8_t* flags, double* tot, int64_t* counts,
                    int64_t* report, int64_t threads, const FloatRows* rows = nullptr);
bool requant_supported();  // whether this CPU runs requant_rows (see requant.cpp)
void search_batches(int64_t* out);  // histogram batches searched in float32, float64
void element_groups(int64_t* out);  // element groups decided in float32 batches, one by one in float64
void element_candidates(int64_t* out);  // candidates of those batches evaluated, skipped (eight groups each)
bool force_search64(bool on);  // tests: returns the previous setting

// ---- crc32c.cpp
constexpr int64_t kCrcBlock = 8192;  // bytes per chain of the SSE4.2 CRC
uint32_t crc32c_extend(uint32_t crc, const uint8_t* p, int64_t n);

// ---- crc32.cpp
uint32_t crc32_extend(uint32_t crc, const uint8_t* p, int64_t n);  // zlib's CRC-32
bool use_crc32_clmul(bool on);  // tests: the carry-less multiply path (x86-64) on or off; the previous setting

// ---- batch.cpp: the lossless path of many modules in one call (int4pack/batch.py)
// source scale dtypes, and the fields of one module's row of int64 in the descriptor (batch.FIELDS)
#define I4P_SCALE_TYPE(X) X(kScaleF32, 0, F32) X(kScaleF16, 1, F16) X(kScaleBf16, 2, BF16)
enum ScaleType : int64_t { I4P_SCALE_TYPE(I4P_ENUM_ITEM) };
#define I4P_BATCH_FIELD(X)                                                                                    \
  /* Layout (kGptq, kCt), byte offset and shape of the words */                                               \
  X(kbLayout, 0, layout) X(kbWords, 1, words) X(kbD0, 2, d0) X(kbD1, 3, d1) X(kbN, 4, n) X(kbK, 5, k)        \
  /* source scales: offset, ScaleType, stored [Gs, N], Gs */                                                  \
  X(kbScales, 6, scales) X(kbScaleType, 7, scale_type) X(kbScalesKN, 8, scales_kn) X(kbSrcGroups, 9, src_groups) \
  /* packed zero points (offset or -1), their size, the byte of a zero of 8 */                                \
  X(kbZeros, 10, zeros) X(kbZerosBytes, 11, zeros_bytes) X(kbZeroByte, 12, zero_byte)                         \
  /* g_idx (offset or -1), its item size (4, 8), the group it must follow */                                  \
  X(kbGidx, 13, gidx) X(kbGidxItem, 14, gidx_item) X(kbGidxGroup, 15, gidx_group)                             \
  /* JobArgs' src_group, g, bf16 */                                                                           \
  X(kbSrcGroup, 16, src_group) X(kbG, 17, g) X(kbBf16, 18, bf16)                                              \
  /* places in the output buffer (-1: not written), blob size */                                              \
  X(kbOutQ, 19, out_q) X(kbOutS, 20, out_s) X(kbOutBlob, 21, out_blob) X(kbBlobBytes, 22, blob_bytes)         \
  X(kbFields, 24, fields)
enum BatchField : int64_t { I4P_BATCH_FIELD(I4P_ENUM_ITEM) };
// one module's results (int64): status (JobStatus, or kNotAsGiven), report [3], CRC-32C of the first
// and second output (blob, or weight and scales), zlib CRC-32 of q, scales and blob (packed only), and
// 1 where a requant batch's module kept its ints (GGUF Q4_0 without a negative scale: its sums are
// lossless_job's five)
#define I4P_BATCH_RESULT(X)                                                                                  \
  X(kbStatus, 0, status) X(kbReport, 1, report) X(kbCrcA, 4, crc_a) X(kbCrcB, 5, crc_b) X(kbZlibQ, 6, zlib_q) \
  X(kbZlibS, 7, zlib_s) X(kbZlibBlob, 8, zlib_blob) X(kbKeptInts, 9, kept_ints) X(kbResults, 10, results)    \
  X(kNotAsGiven, 100, not_as_given) /* the per-module path reads this module otherwise: run it there */
enum BatchResult : int64_t { I4P_BATCH_RESULT(I4P_ENUM_ITEM) };
// float sources in requant_batch (batch.py, _float_row): the row's layout says what the weight is
// (bf16, f16, f32 [N, K]; e4m3 [N, K] or E2M1 pairs [N, K/2], low nibble first, times a block
// scale); its kbScales holds the block scales [ceil(N/bn), ceil(K/bk)] of type kbScaleType (a
// ScaleType, or kScaleE8m0 / kScaleE4m3), kbSrcGroups their columns, kbSrcGroup bk and kbGidxGroup
// bn; E2M1 only: kbZeroByte 1 or 2 divides or multiplies every block scale by the float32 whose
// bits kbZerosBytes holds (NVFP4's global scale); no zero points, no g_idx
// MLX affine (kSrcMlx): kbWords the uint32 words [N, K * bits / 32], kbZeroByte the bits (4, 8),
// kbScales and kbZeros the scales and biases [N, K / group] (both of type kbScaleType: F32, F16,
// BF16), kbSrcGroup the group, kbSrcGroups K / group. GGUF (kSrcGguf): kbWords the block bytes
// [N, kbD1] of ggml type kbScaleType (GgufType), kbD0 = N; Q4_0 is read as codes (q4_0_codes)
enum FloatSource : int64_t {
  kSrcBf16 = 10, kSrcF16 = 11, kSrcF32 = 12, kSrcE4m3 = 13, kSrcE2m1 = 14, kSrcMlx = 15, kSrcGguf = 16
};
enum MiniScaleType : int64_t { kScaleE8m0 = 3, kScaleE4m3 = 4 };
// ggml's type numbers (gguf.GGMLQuantizationType) of the types int4pack reads
enum GgufType : int64_t {
  kGgufQ4_0 = 2, kGgufQ4_1 = 3, kGgufQ5_0 = 6, kGgufQ5_1 = 7, kGgufQ8_0 = 8, kGgufQ4_K = 12, kGgufQ5_K = 13,
  kGgufQ6_K = 14, kGgufIq4Nl = 20, kGgufIq4Xs = 23, kGgufMxfp4 = 39
};
void scales_to_float(const uint8_t* src, int64_t n, int64_t groups, int64_t dtype, bool kn, float* out);

// ---- float_rows.cpp
float half_to_float(uint16_t h);  // IEEE binary16 -> float32, exactly
// the decoder of requant_batch's float-source row d (module m) reading src[0, src_len); null where the
// per-module path is the only way (a block scale NaN, Inf or negative: the reader refuses it)
std::unique_ptr<FloatRows> float_rows(const int64_t* d, int64_t m, const uint8_t* src, int64_t src_len);
// a GGUF type's values and bytes per block (0: not a type read here)
int64_t gguf_block(int64_t type, int64_t& bytes);
// GGUF Q4_0 blocks of requant_batch's row d as formats/gguf.q4_0_codes records them: codes [N, K],
// scales |d| [N, K/32] and zero points (8; 7 where d < 0, whose codes become 15 - q); false where no
// d is negative (the module keeps its ints: codes, scales |d| = d and no zero points)
bool q4_0_codes(const int64_t* d, int64_t m, const uint8_t* src, int64_t src_len, std::vector<uint8_t>& codes,
                std::vector<float>& scales, std::vector<uint8_t>& zeros);
int64_t lossless_batch(const uint8_t* src, int64_t src_len, const int64_t* desc, int64_t count, uint8_t* out,
                       int64_t out_len, int64_t* res, double* tot, int64_t threads);
// the requant path of many modules (GPTQ and AWQ words with zero points), the same descriptor and
// results; tot [count, 6] (requant_job's sums), zgroups [count] (its zero groups); a module with
// close calls is handed back
int64_t requant_batch(const uint8_t* src, int64_t src_len, const int64_t* desc, int64_t count, uint8_t* out,
                      int64_t out_len, const float* coarse, int64_t n_coarse, const float* fine, int64_t n_fine,
                      int64_t* res, double* tot, int64_t* zgroups, int64_t threads);

}  // namespace i4p
