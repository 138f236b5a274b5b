// CRC-32 (the IEEE polynomial, reflected: zlib.crc32's), the checksum int4pack records for each
// packed blob and the values it was packed from. verify checks every blob's four: at memory speed
// with carry-less multiplication (folding 64 bytes at a time, then Barrett reduction, per Intel's
// "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ"), by table elsewhere.

#include "../common.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define I4P_CRC32_CLMUL 1
#endif

namespace i4p {
namespace {

struct Table {
  uint32_t t[8][256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (int j = 1; j < 8; ++j)
      for (int i = 0; i < 256; ++i) t[j][i] = (t[j - 1][i] >> 8) ^ t[0][t[j - 1][i] & 0xFF];
  }
};

const Table& table() {
  static const Table tab;
  return tab;
}

// the register (not inverted) carried over n bytes, eight at a time (slicing by 8)
uint32_t soft(uint32_t c, const uint8_t* p, int64_t n) {
  const Table& tb = table();
  for (; n >= 8; n -= 8, p += 8) {
    uint32_t a, b;
    std::memcpy(&a, p, 4);
    std::memcpy(&b, p + 4, 4);
    a ^= c;
    c = tb.t[7][a & 0xFF] ^ tb.t[6][(a >> 8) & 0xFF] ^ tb.t[5][(a >> 16) & 0xFF] ^ tb.t[4][a >> 24] ^
        tb.t[3][b & 0xFF] ^ tb.t[2][(b >> 8) & 0xFF] ^ tb.t[1][(b >> 16) & 0xFF] ^ tb.t[0][b >> 24];
  }
  for (; n > 0; --n, ++p) c = tb.t[0][(c ^ *p) & 0xFF] ^ (c >> 8);
  return c;
}

#ifdef I4P_CRC32_CLMUL
#define I4P_CLMUL __attribute__((target("pclmul,sse4.1")))

I4P_CLMUL inline __m128i load(const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); }

// x times x^(128 + 32) and x^(128 - 32) (its two halves), plus the next 16 bytes
I4P_CLMUL inline __m128i fold(__m128i x, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), next);
}

// n >= 64 and a multiple of 16: the register carried over them
I4P_CLMUL uint32_t folded(uint32_t c, const uint8_t* p, int64_t n) {
  // x^(4*128+32), x^(4*128-32) (fold 64 bytes); x^(128+32), x^(128-32) (fold 16); x^64; mu, P'
  const __m128i k12 = _mm_set_epi64x(0x00000001c6e41596LL, 0x0000000154442bd4LL);
  const __m128i k34 = _mm_set_epi64x(0x00000000ccaa009eLL, 0x00000001751997d0LL);
  const __m128i k5 = _mm_set_epi64x(0, 0x0000000163cd6124LL);
  const __m128i poly = _mm_set_epi64x(0x00000001f7011641LL, 0x00000001db710641LL);
  const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
  __m128i x1 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i x2 = load(p + 16), x3 = load(p + 32), x4 = load(p + 48);
  p += 64;
  n -= 64;
  for (; n >= 64; n -= 64, p += 64) {
    x1 = fold(x1, k12, load(p));
    x2 = fold(x2, k12, load(p + 16));
    x3 = fold(x3, k12, load(p + 32));
    x4 = fold(x4, k12, load(p + 48));
  }
  x1 = fold(x1, k34, x2);
  x1 = fold(x1, k34, x3);
  x1 = fold(x1, k34, x4);
  for (; n >= 16; n -= 16, p += 16) x1 = fold(x1, k34, load(p));
  // 128 -> 64 bits (32 zero bits appended), 64 -> 32 bits, then Barrett reduction
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), _mm_clmulepi64_si128(k34, x1, 0x01));
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 4), _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k5, 0x00));
  __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x10);
  t = _mm_clmulepi64_si128(_mm_and_si128(t, mask32), poly, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x1, t), 1));
}

bool has_clmul() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  }();
  return has;
}
#endif

}  // namespace

// zlib.crc32(p[0..n), crc): continuing from crc (0 to start)
uint32_t crc32_ieee(uint32_t crc, const uint8_t* p, int64_t n) {
  uint32_t c = ~crc;
#ifdef I4P_CRC32_CLMUL
  if (n >= 64 && has_clmul()) {
    const int64_t m = n & ~int64_t{15};
    c = folded(c, p, m);
    p += m;
    n -= m;
  }
#endif
  return ~soft(c, p, n);
}

}  // namespace i4p
