// CRC-32 (zlib's: reflected polynomial 0xEDB88320), the checksum of the packed format's provenance
// (serve_spec.crc) computed beside the lossless batch (batch.cpp). Slicing by 8: eight byte tables,
// eight bytes a step (about zlib 1.2's speed), portable to every machine the library builds for.

#include "convert_kernels.h"

namespace i4p {

namespace {

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

}  // namespace

uint32_t crc32_extend(uint32_t crc, const uint8_t* p, int64_t n) {
  const Crc32Tables& T = crc32_tables();
  uint32_t c = ~crc;
  int64_t i = 0;
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
