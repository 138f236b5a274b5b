// Nibble unpacking: GPTQ [K/8, N], compressed-tensors [N, K/8] and AWQ GEMM [K, N/8] words -> codes
// uint8 [N, K] (twins: int4pack/nibbles.py).

#include "convert_kernels.h"

namespace i4p {

// ------------------------------------------------------------------------------------ unpacking

// word rows fetched ahead by the unpack kernels whose rows are far apart (GPTQ, AWQ)
constexpr int64_t kPrefetchRows = 64;

// the cache lines of [p, p + bytes) (bytes <= 64: the first and the last line)
I4P_INLINE void prefetch_span(const void* p, int64_t bytes) {
  __builtin_prefetch(p);
  __builtin_prefetch(static_cast<const uint8_t*>(p) + bytes - 1);
}

// GPTQ qweight [K/8, N], packed along K -> codes uint8 [N, K] less bias, rows [r0, r1) (output row r
// at o + (r - o0) * K: the whole tensor, or requant_job's block of rows). Blocks of 16 rows, whose
// words t..t+7 fill one cache line of each output row in turn: each input line is used up at once,
// and no line of the output is left half written while 16 others are (rows K bytes apart share
// L1 sets when K is a multiple of 2 KB)
I4P_CLONES void unpack_gptq_rows(const uint32_t* w, uint8_t* o, int64_t n, int64_t kw, int64_t r0, int64_t r1,
                                 int64_t o0, uint8_t bias) {
  const int64_t k = kw * 8, r4 = r0 + (r1 - r0) / 4 * 4, kw4 = kw / 4 * 4, kw8 = kw / 8 * 8;
  for (int64_t b0 = r0; b0 < r4; b0 += 16) {
    const int64_t b1 = std::min(r4, b0 + 16);
    for (int64_t t = 0; t < kw8; t += 8) {
      // each word row is a page or more away from the last: no hardware prefetcher follows, and
      // from the page cache (not in any CPU cache) the loads stalled. Fetch kPrefetchRows ahead,
      // into the next 16 rows at the end of this block (the caller's next block when b0 is its last)
      for (int64_t i = 0; i < 8; ++i) {
        int64_t pt = t + kPrefetchRows + i, pr = b0;
        if (pt >= kw8) {
          pt -= kw8;
          pr += 16;
        }
        if (pr < n && pt < kw8) prefetch_span(w + pt * n + pr, 4 * std::min<int64_t>(16, n - pr));
      }
      for (int64_t r = b0; r < b1; r += 4) {
        uint8_t* dst = o + (r - o0) * k + 8 * t;
        gptq_quad(w + t * n + r, n, dst, k, bias);
        gptq_quad(w + (t + 4) * n + r, n, dst + 32, k, bias);
      }
    }
    for (int64_t t = kw8; t < kw4; t += 4) {
      for (int64_t r = b0; r < b1; r += 4) gptq_quad(w + t * n + r, n, o + (r - o0) * k + 8 * t, k, bias);
    }
  }
  const uint64_t ones = 0x0101010101010101ull;
  for (int64_t r = r0; r < r1; ++r) {  // the words past the fours, then the rows past the fours
    for (int64_t t = (r < r4 ? kw4 : 0); t < kw; ++t) {
      // (u | 0x80) - bias never borrows from the next byte; ^ 0x80 leaves u - bias mod 256
      const uint64_t v = ((spread_nibbles(w[t * n + r]) | 0x80 * ones) - bias * ones) ^ (0x80 * ones);
      std::memcpy(o + (r - o0) * k + 8 * t, &v, 8);
    }
  }
}

// compressed-tensors weight_packed [N, ceil(K/8)], packed along K -> codes uint8 [N, K] (rows
// [r0, r1), output row r at o + (r - o0) * K)
I4P_CLONES void unpack_ct_rows(const uint32_t* w, int64_t kw, int64_t k, uint8_t* o, int64_t r0, int64_t r1,
                               int64_t o0) {
  const int64_t full = k / 8, full4 = full / 4 * 4;
  for (int64_t r = r0; r < r1; ++r) {
    const uint32_t* src = w + r * kw;
    uint8_t* dst = o + (r - o0) * k;
    for (int64_t j = 0; j < full4; j += 4) {
      u8x16 a, b;
      nibbles4(src + j, a, b);
      std::memcpy(dst + 8 * j, &a, 16);
      std::memcpy(dst + 8 * j + 16, &b, 16);
    }
    for (int64_t j = full4; j < full; ++j) {
      const uint64_t v = spread_nibbles(src[j]);
      std::memcpy(dst + 8 * j, &v, 8);
    }
    if (full * 8 < k) {
      const uint64_t v = spread_nibbles(src[full]);
      std::memcpy(dst + 8 * full, &v, k - 8 * full);
    }
  }
}

// AWQ GEMM qweight [K, N/8], packed along N: nibble i of word j holds logical column 8j + kAwqOrder[i]
constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// column c of the 8 output rows of word j, one nibble at a time (the edges the tiles leave);
// output row r at o + (r - o0) * K
I4P_INLINE void awq_word(const uint32_t* w, uint8_t* o, int64_t k, int64_t nw, int64_t j, int64_t c, int64_t o0) {
  const uint32_t v = w[c * nw + j];
  for (int i = 0; i < 8; ++i) o[(8 * j + kAwqOrder[i] - o0) * k + c] = (v >> (4 * i)) & 0xF;
}

// transpose 8 vectors of 16 bytes: afterwards 8-byte unit u of d[i] holds byte 2i + u of a[0..7]
I4P_INLINE void transpose8x16(const u8x16* a, u8x16* d) {
  u8x16 b[8], c[8];
  for (int s = 0; s < 4; ++s) {  // b[2s], b[2s + 1]: bytes 0-7, 8-15 of a[2s], a[2s + 1] in pairs
    b[2 * s] = lo8x16(a[2 * s], a[2 * s + 1]);
    b[2 * s + 1] = hi8x16(a[2 * s], a[2 * s + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // c[4h + m]: bytes 4m..4m+3 of a[4h..4h+3] in fours
    c[4 * h] = lo16x16(b[4 * h], b[4 * h + 2]);
    c[4 * h + 1] = hi16x16(b[4 * h], b[4 * h + 2]);
    c[4 * h + 2] = lo16x16(b[4 * h + 1], b[4 * h + 3]);
    c[4 * h + 3] = hi16x16(b[4 * h + 1], b[4 * h + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    d[2 * m] = lo32x16(c[m], c[m + 4]);
    d[2 * m + 1] = hi32x16(c[m], c[m + 4]);
  }
}

// words [j0, j0 + 8) of every row: 64 output rows built in a tile of kCols columns (whole cache
// lines), then copied out. Four words of 8 rows at a time: byte b of them holds word b / 4's
// nibbles 2 (b % 4) and 2 (b % 4) + 1, and a byte transpose turns the rows into 8 columns of
// output rows
I4P_CLONES void unpack_awq_block(const uint32_t* w, uint8_t* o, int64_t k, int64_t nw, int64_t j0, int64_t o0) {
  constexpr int64_t kCols = 64;
  alignas(64) uint8_t tile[64][kCols];
  const int64_t k8 = k / 8 * 8;
  const u8x16 low = (u8x16)(u64x2{} + 0x0F0F0F0F0F0F0F0Full);
  for (int64_t c0 = 0; c0 < k8; c0 += kCols) {
    const int64_t cb = std::min(kCols, k8 - c0);
    for (int64_t tg = 0; tg < cb; tg += 8) {
      // rows a page or more apart, out of the page cache: see unpack_gptq_rows
      for (int64_t t = c0 + tg + kPrefetchRows; t < std::min(k8, c0 + tg + kPrefetchRows + 8); ++t)
        prefetch_span(w + t * nw + j0, 32);
      for (int h = 0; h < 2; ++h) {  // words j0 + 4h .. j0 + 4h + 3
        u8x16 a[2][8], d[8];
        for (int t = 0; t < 8; ++t) {
          u8x16 v;
          std::memcpy(&v, w + (c0 + tg + t) * nw + j0 + 4 * h, 16);
          a[0][t] = v & low;
          a[1][t] = (u8x16)((u64x2)v >> 4) & low;
        }
        for (int nh = 0; nh < 2; ++nh) {  // low, then high nibble of each byte
          transpose8x16(a[nh], d);
          for (int i = 0; i < 8; ++i) {
            for (int u = 0; u < 2; ++u) {
              const int b = 16 * h + 2 * i + u, nib = 2 * (b % 4) + nh;
              store_unit(&tile[8 * (b / 4) + kAwqOrder[nib]][tg], d[i], u);
            }
          }
        }
      }
    }
    for (int64_t m = 0; m < 64; ++m) std::memcpy(o + (8 * j0 + m - o0) * k + c0, tile[m], cb);
  }
  for (int64_t c = k8; c < k; ++c)
    for (int64_t j = j0; j < j0 + 8; ++j) awq_word(w, o, k, nw, j, c, o0);
}

#ifdef I4P_AWQ_AVX2
// exchange the bits of m in b with those sh bits higher in a
template <int sh>
__attribute__((target("avx2"), always_inline)) inline void awq_swap(__m256i& a, __m256i& b, __m256i m) {
  const __m256i d = _mm256_and_si256(_mm256_xor_si256(_mm256_srli_epi32(a, sh), b), m);
  b = _mm256_xor_si256(b, d);
  a = _mm256_xor_si256(a, _mm256_slli_epi32(d, sh));
}

// unpack_awq_block in AVX2 with few shuffles: the SSE2 byte transposes are all shuffles, which
// cores with one shuffle port (Intel's) run several times slower than AMD's.
// 8 rows of the 8 words: an 8 x 8 transpose of nibbles inside each 32-bit lane by masks and shifts
// (no shuffles) leaves, for each nibble i, 8 columns of output row 8 (j0 + l) + kAwqOrder[i] in
// lane l; 8 such row blocks, transposed as 32-bit elements, make 64 columns of each output row:
// whole cache lines, stored straight into the output
__attribute__((target("avx2"))) void unpack_awq_block_avx2(const uint32_t* w, uint8_t* o, int64_t k, int64_t nw,
                                                           int64_t j0, int64_t o0) {
  const int64_t k64 = k / 64 * 64;
  const __m256i m16 = _mm256_set1_epi32(0x0000FFFF), m8 = _mm256_set1_epi32(0x00FF00FF);
  const __m256i m4 = _mm256_set1_epi32(0x0F0F0F0F);
  alignas(32) __m256i t[8][8];  // t[i][b]: nibble i of rows c0 + 8b .. c0 + 8b + 7, lane l = word j0 + l
  for (int64_t c0 = 0; c0 < k64; c0 += 64) {
    for (int64_t c = c0 + kPrefetchRows; c < std::min(k, c0 + kPrefetchRows + 64); ++c)
      prefetch_span(w + c * nw + j0, 32);  // rows a page or more apart: see unpack_gptq_rows
    for (int b = 0; b < 8; ++b) {
      __m256i r[8];
      for (int i = 0; i < 8; ++i)
        r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (c0 + 8 * b + i) * nw + j0));
      // swap the off-diagonal blocks of 4, 2, then 1 nibbles between rows 4, 2, then 1 apart
      for (int x = 0; x < 4; ++x) awq_swap<16>(r[x], r[x + 4], m16);
      for (int x : {0, 1, 4, 5}) awq_swap<8>(r[x], r[x + 2], m8);
      for (int x : {0, 2, 4, 6}) awq_swap<4>(r[x], r[x + 1], m4);
      for (int i = 0; i < 8; ++i) t[i][b] = r[i];  // r[i]: nibble i, row c0 + 8b + m in nibble m
    }
    for (int i = 0; i < 8; ++i) {
      const __m256i* a = t[i];  // 8 x 8 transpose of 32-bit elements: u[l] element b = a[b] lane l
      const __m256i p0 = _mm256_unpacklo_epi32(a[0], a[1]), p1 = _mm256_unpackhi_epi32(a[0], a[1]);
      const __m256i p2 = _mm256_unpacklo_epi32(a[2], a[3]), p3 = _mm256_unpackhi_epi32(a[2], a[3]);
      const __m256i p4 = _mm256_unpacklo_epi32(a[4], a[5]), p5 = _mm256_unpackhi_epi32(a[4], a[5]);
      const __m256i p6 = _mm256_unpacklo_epi32(a[6], a[7]), p7 = _mm256_unpackhi_epi32(a[6], a[7]);
      const __m256i q0 = _mm256_unpacklo_epi64(p0, p2), q1 = _mm256_unpackhi_epi64(p0, p2);
      const __m256i q2 = _mm256_unpacklo_epi64(p1, p3), q3 = _mm256_unpackhi_epi64(p1, p3);
      const __m256i q4 = _mm256_unpacklo_epi64(p4, p6), q5 = _mm256_unpackhi_epi64(p4, p6);
      const __m256i q6 = _mm256_unpacklo_epi64(p5, p7), q7 = _mm256_unpackhi_epi64(p5, p7);
      const __m256i u[8] = {_mm256_permute2x128_si256(q0, q4, 0x20), _mm256_permute2x128_si256(q1, q5, 0x20),
                            _mm256_permute2x128_si256(q2, q6, 0x20), _mm256_permute2x128_si256(q3, q7, 0x20),
                            _mm256_permute2x128_si256(q0, q4, 0x31), _mm256_permute2x128_si256(q1, q5, 0x31),
                            _mm256_permute2x128_si256(q2, q6, 0x31), _mm256_permute2x128_si256(q3, q7, 0x31)};
      for (int l = 0; l < 8; ++l) {
        // 64 nibbles in column order -> bytes; the unpacks work per 128-bit half, hence the permutes
        const __m256i lo = _mm256_and_si256(u[l], m4), hi = _mm256_and_si256(_mm256_srli_epi32(u[l], 4), m4);
        const __m256i x = _mm256_unpacklo_epi8(lo, hi), y = _mm256_unpackhi_epi8(lo, hi);
        uint8_t* dst = o + (8 * (j0 + l) + kAwqOrder[i] - o0) * k + c0;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(x, y, 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), _mm256_permute2x128_si256(x, y, 0x31));
      }
    }
  }
  for (int64_t c = k64; c < k; ++c)
    for (int64_t j = j0; j < j0 + 8; ++j) awq_word(w, o, k, nw, j, c, o0);
}

bool cpu_has_avx2() {
  __builtin_cpu_init();  // this runs from a static initializer: libgcc's own may not have run yet
  return __builtin_cpu_supports("avx2") != 0;
}
std::atomic<bool> g_awq_avx2{cpu_has_avx2()};
#endif

// words [j0, j1) (output rows [8 j0, 8 j1)): tiles of 8 words, the rest word by word
void unpack_awq_words(const uint32_t* w, uint8_t* o, int64_t k, int64_t nw, int64_t j0, int64_t j1, int64_t o0) {
  int64_t j = j0;
#ifdef I4P_AWQ_AVX2
  if (g_awq_avx2.load(std::memory_order_relaxed)) {
    for (; j + 8 <= j1; j += 8) unpack_awq_block_avx2(w, o, k, nw, j, o0);
  }
#endif
  for (; j + 8 <= j1; j += 8) unpack_awq_block(w, o, k, nw, j, o0);
  for (; j < j1; ++j)
    for (int64_t c = 0; c < k; ++c) awq_word(w, o, k, nw, j, c, o0);
}

bool use_awq_avx2(bool on) {
#ifdef I4P_AWQ_AVX2
  return g_awq_avx2.exchange(on && cpu_has_avx2());
#else
  (void)on;
  return false;
#endif
}

}  // namespace i4p
