// CRC-32C of the bytes convert writes (twin: kernels.crc32c).

#include "convert_kernels.h"

namespace i4p {

// ------------------------------------------------------------------------------------ CRC-32C

// CRC-32C (Castagnoli; iSCSI, ext4) of the bytes convert writes, for the shard digests (writer.py).
// With SSE4.2, three 8 KB blocks run as three independent chains (the crc32 instruction has a
// latency of 3 and a throughput of 1) and are joined by shifting a chain's state over 8 KB of
// zeros: a linear map, applied as four 256-entry tables; on aarch64 the same with the Arm CRC32
// instructions. Elsewhere a byte table.
namespace crc {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected
constexpr int64_t kBlock = kCrcBlock;

struct Tables {
  uint32_t byte[256];
  uint32_t shift[4][256];  // shift[i][v]: state (v << 8i) carried over kBlock zero bytes
  Tables() {
    for (uint32_t v = 0; v < 256; ++v) {
      uint32_t c = v;
      for (int b = 0; b < 8; ++b) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      byte[v] = c;
    }
    for (int i = 0; i < 4; ++i) {
      for (uint32_t v = 0; v < 256; ++v) {
        uint32_t c = v << (8 * i);
        for (int64_t n = 0; n < kBlock; ++n) c = byte[c & 255u] ^ (c >> 8);
        shift[i][v] = c;
      }
    }
  }
  uint32_t over_block(uint32_t c) const {
    return shift[0][c & 255u] ^ shift[1][(c >> 8) & 255u] ^ shift[2][(c >> 16) & 255u] ^ shift[3][c >> 24];
  }
};

const Tables& tables() {
  static const Tables t;  // built once (thread-safe static), ~8 M table steps
  return t;
}

uint32_t soft(uint32_t c, const uint8_t* p, int64_t n, const Tables& t) {
  for (int64_t i = 0; i < n; ++i) c = t.byte[(c ^ p[i]) & 255u] ^ (c >> 8);
  return c;
}

#ifdef I4P_CRC_X86
__attribute__((target("sse4.2"))) uint32_t hard(uint32_t c, const uint8_t* p, int64_t n, const Tables& t) {
  while (n >= 3 * kBlock) {
    uint64_t a = c, b = 0, d = 0;
    for (int64_t i = 0; i < kBlock; i += 8) {
      uint64_t x, y, z;
      std::memcpy(&x, p + i, 8);
      std::memcpy(&y, p + kBlock + i, 8);
      std::memcpy(&z, p + 2 * kBlock + i, 8);
      a = _mm_crc32_u64(a, x);
      b = _mm_crc32_u64(b, y);
      d = _mm_crc32_u64(d, z);
    }
    c = t.over_block(t.over_block(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^ static_cast<uint32_t>(d);
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  uint64_t v = c;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t x;
    std::memcpy(&x, p, 8);
    v = _mm_crc32_u64(v, x);
  }
  c = static_cast<uint32_t>(v);
  for (; n > 0; --n, ++p) c = _mm_crc32_u8(c, *p);
  return c;
}
#endif

#ifdef I4P_CRC_ARM
uint32_t hard_arm(uint32_t c, const uint8_t* p, int64_t n, const Tables& t) {  // as hard() above
  while (n >= 3 * kBlock) {
    uint32_t a = c, b = 0, d = 0;
    for (int64_t i = 0; i < kBlock; i += 8) {
      uint64_t x, y, z;
      std::memcpy(&x, p + i, 8);
      std::memcpy(&y, p + kBlock + i, 8);
      std::memcpy(&z, p + 2 * kBlock + i, 8);
      a = arm_crc32cx(a, x);
      b = arm_crc32cx(b, y);
      d = arm_crc32cx(d, z);
    }
    c = t.over_block(t.over_block(a) ^ b) ^ d;
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t x;
    std::memcpy(&x, p, 8);
    c = arm_crc32cx(c, x);
  }
  for (; n > 0; --n, ++p) c = arm_crc32cb(c, *p);
  return c;
}
#endif

// the standard CRC-32C of p[0..n) continuing from a previous result crc (0 to start)
uint32_t extend(uint32_t crc, const uint8_t* p, int64_t n) {
  const Tables& t = tables();
  uint32_t c = ~crc;
#ifdef I4P_CRC_X86
  static const bool has = __builtin_cpu_supports("sse4.2");
  c = has ? hard(c, p, n, t) : soft(c, p, n, t);
#elif defined(I4P_CRC_ARM)
  c = arm_has_crc() ? hard_arm(c, p, n, t) : soft(c, p, n, t);
#else
  c = soft(c, p, n, t);
#endif
  return ~c;
}

}  // namespace crc

uint32_t crc32c_extend(uint32_t crc, const uint8_t* p, int64_t n) { return crc::extend(crc, p, n); }

}  // namespace i4p
