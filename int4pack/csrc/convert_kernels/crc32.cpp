// CRC-32 (zlib's: reflected polynomial 0xEDB88320), the checksum of the packed format's provenance
// (serve_spec.crc) computed beside the lossless batch (batch.cpp). On x86-64 with PCLMULQDQ: 64 bytes
// a step folded by carry-less multiplies, then a Barrett reduction (the method of Intel's "Fast CRC
// Computation for Generic Polynomials Using PCLMULQDQ", its constants for this polynomial: x^n mod P,
// bit-reflected); on aarch64 with the CRC32 instructions, crc32x over 8 bytes a step; the rest, and
// other machines, slicing by 8 (eight byte tables, about zlib 1.2's speed). The multiplies made the
// packed format's three CRC-32s per module 10x cheaper.

#include "convert_kernels.h"

namespace i4p {

namespace {

std::atomic<bool> g_clmul{true};  // the hardware path (carry-less multiplies, or Arm's crc32x)

struct Crc32Tables {
  uint32_t t[8][256];
  Crc32Tables() {
    for (uint32_t v = 0; v < 256; ++v) {
      uint32_t c = v;
      for (int b = 0; b < 8; ++b) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
      t[0][v] = c;
    }
    for (uint32_t v = 0; v < 256; ++v) {
      for (int j = 1; j < 8; ++j) t[j][v] = t[0][t[j - 1][v] & 255u] ^ (t[j - 1][v] >> 8);
    }
  }
};

const Crc32Tables& crc32_tables() {
  static const Crc32Tables t;
  return t;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define I4P_CRC32_CLMUL 1
// the state c (not inverted) over n bytes, n >= 64 and a multiple of 16
__attribute__((target("pclmul,sse4.1"))) uint32_t crc32_clmul(uint32_t c, const uint8_t* p, int64_t n) {
  const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);  // fold 512 bits
  const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);  // fold 128 bits
  const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124LL);  // 64 -> 32 bits
  const __m128i poly = _mm_set_epi64x(0x1f7011641LL, 0x1db710641LL);  // P' and mu (Barrett)
// (macros: a lambda would not take the function's target)
#define ld(q) _mm_loadu_si128(reinterpret_cast<const __m128i*>(q))
#define fold(x, k, d) \
  _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), d)
  __m128i x1 = _mm_xor_si128(ld(p), _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i x2 = ld(p + 16), x3 = ld(p + 32), x4 = ld(p + 48);
  p += 64;
  n -= 64;
  for (; n >= 64; p += 64, n -= 64) {  // four independent chains
    x1 = fold(x1, k1k2, ld(p));
    x2 = fold(x2, k1k2, ld(p + 16));
    x3 = fold(x3, k1k2, ld(p + 32));
    x4 = fold(x4, k1k2, ld(p + 48));
  }
  x1 = fold(x1, k3k4, x2);
  x1 = fold(x1, k3k4, x3);
  x1 = fold(x1, k3k4, x4);
  for (; n >= 16; p += 16, n -= 16) x1 = fold(x1, k3k4, ld(p));
  // 128 -> 64 bits, then 64 -> 32, then the Barrett reduction
  const __m128i lo32 = _mm_setr_epi32(-1, 0, -1, 0);
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), _mm_clmulepi64_si128(x1, k3k4, 0x10));
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 4), _mm_clmulepi64_si128(_mm_and_si128(x1, lo32), k5, 0x00));
  __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x1, lo32), poly, 0x10);
  t = _mm_clmulepi64_si128(_mm_and_si128(t, lo32), poly, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x1, t), 1));
#undef ld
#undef fold
}

bool has_clmul() {
  static const bool yes = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return yes;
}
#endif

}  // namespace

bool use_crc32_clmul(bool on) {  // tests: returns the previous setting
#if defined(I4P_CRC32_CLMUL) || defined(I4P_CRC_ARM)
  const bool was = g_clmul.load();
  g_clmul = on;
  return was;
#else
  (void)on;
  return false;
#endif
}

uint32_t crc32_extend(uint32_t crc, const uint8_t* p, int64_t n) {
  const Crc32Tables& T = crc32_tables();
  uint32_t c = ~crc;
  int64_t i = 0;
#ifdef I4P_CRC32_CLMUL
  if (n >= 64 && g_clmul.load(std::memory_order_relaxed) && has_clmul()) {
    i = n / 16 * 16;
    c = crc32_clmul(c, p, i);
  }
#elif defined(I4P_CRC_ARM)
  if (g_clmul.load(std::memory_order_relaxed) && arm_has_crc()) {
    for (; i + 8 <= n; i += 8) {
      uint64_t x;
      std::memcpy(&x, p + i, 8);
      c = arm_crc32x(c, x);
    }
    for (; i < n; ++i) c = arm_crc32b(c, p[i]);
    return ~c;
  }
#endif
  for (; i + 8 <= n; i += 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p + i, 4);  // little-endian hosts only (x86-64, aarch64)
    std::memcpy(&hi, p + i + 4, 4);
    lo ^= c;
    c = T.t[7][lo & 255u] ^ T.t[6][(lo >> 8) & 255u] ^ T.t[5][(lo >> 16) & 255u] ^ T.t[4][lo >> 24] ^
        T.t[3][hi & 255u] ^ T.t[2][(hi >> 8) & 255u] ^ T.t[1][(hi >> 16) & 255u] ^ T.t[0][hi >> 24];
  }
  for (; i < n; ++i) c = T.t[0][(c ^ p[i]) & 255u] ^ (c >> 8);
  return ~c;
}

}  // namespace i4p
