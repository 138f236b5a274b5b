// KleidiAI W4A8 RHS packer (nr=8, kr=16, sr=2), written from the layout in docs/kleidiai.md §1.5.
// Input: signed int4 values as int8 [E, N, K]. Output: uint8 [E, bytes], one blob per expert.
// Work unit = one 8-row block of one expert; for_rows spreads units over threads.
//
// Per 32-value chunk of K, per segment s (0/1), per row r of the block: 8 bytes, byte i =
// nib(k) | nib(k+16) << 4 with k = 32c + 8s + i, nib = the two's complement low 4 bits.
// Rows past N repeat row N-1 (data, scales and bias alike).

#include "../common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace i4p {
namespace {

constexpr int64_t kNr = 8;

inline int64_t roundup(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// One 32-value chunk of one row: 16 bytes, written as two 8-byte segments whose
// destinations are 8*8 bytes apart (the 8 rows of a segment are contiguous).
// seg_sum[s] gets the sum of the 16 values stored in segment s.
// SWAR on 64-bit words: 8 values per load, nibble = low 4 bits of the int8 (two's complement).
inline void put_chunk(const int8_t* __restrict__ src, uint8_t* __restrict__ dst, int32_t seg_sum[2]) {
  constexpr uint64_t kLow = 0x0F0F0F0F0F0F0F0FULL;
  constexpr uint64_t kEight = 0x0808080808080808ULL;
  constexpr uint64_t kOnes = 0x0101010101010101ULL;
  for (int s = 0; s < 2; ++s) {
    uint64_t lo, hi;
    std::memcpy(&lo, src + 8 * s, 8);
    std::memcpy(&hi, src + 8 * s + 16, 8);
    lo &= kLow;
    hi &= kLow;
    const uint64_t word = lo | (hi << 4);
    std::memcpy(dst + s * kNr * 8, &word, 8);
    // q + 8 = nibble ^ 8 lies in [0, 15]; 16 of them sum to <= 240, so one byte holds the
    // horizontal sum that the multiply by 0x01..01 gathers into the top byte
    const uint64_t u = (lo ^ kEight) + (hi ^ kEight);
    seg_sum[s] = static_cast<int32_t>((u * kOnes) >> 56) - 128;
  }
}

inline void put_f32(uint8_t* dst, float v) { std::memcpy(dst, &v, 4); }
inline void put_i32(uint8_t* dst, int32_t v) { std::memcpy(dst, &v, 4); }

struct Job {
  const int8_t* q;        // [E, N, K]
  const uint8_t* scales;  // groupwise: bf16 bits [E, N, K/g]; channelwise: fp32 [E, N]
  const float* bias;      // [E, N] or null
  uint8_t* out;           // [E, bytes]
  int64_t n, k, g, bytes;
};

void group_block(const Job& j, int64_t e, int64_t blk) {
  const int64_t k = j.k, g = j.g;
  const int64_t nblk = k / g;
  const int64_t data_per_qblk = g / 2 * kNr;
  uint8_t* dst = j.out + e * j.bytes + blk * (j.bytes / (roundup(j.n, kNr) / kNr));
  const int8_t* q = j.q + e * j.n * j.k;
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(j.scales) + e * j.n * nblk;
  int64_t rows[kNr];
  for (int r = 0; r < kNr; ++r) rows[r] = std::min(blk * kNr + r, j.n - 1);
  float sums[kNr] = {0};
  for (int64_t b = 0; b < nblk; ++b) {
    float s[kNr];
    for (int r = 0; r < kNr; ++r) {
      const uint16_t bits = sc[rows[r] * nblk + b];
      const uint32_t wide = static_cast<uint32_t>(bits) << 16;  // bf16 -> fp32 is exact
      std::memcpy(&s[r], &wide, 4);
      std::memcpy(dst + data_per_qblk + 2 * r, &bits, 2);
    }
    // rows innermost: 8 independent add chains (one per row) instead of one latency-bound chain,
    // and the 8 rows of a segment are written contiguously
    const int8_t* src[kNr];  // locals: stores through uint8_t* would force reloads of j.*
    for (int r = 0; r < kNr; ++r) src[r] = q + rows[r] * k + b * g;
    for (int64_t c = 0; c < g / 32; ++c) {
      int32_t seg[2][kNr];
      for (int r = 0; r < kNr; ++r) {
        int32_t two[2];
        put_chunk(src[r] + 32 * c, dst + c * 2 * kNr * 8 + r * 8, two);
        seg[0][r] = two[0];
        seg[1][r] = two[1];
      }
      // KleidiAI rounds the row sum once per 16-value segment, in storage order. One lane per
      // row keeps that order and lets the compiler vectorise over rows (rather than a scalar
      // chain). The product (|seg| <= 128 times a bf16) is exact: FMA cannot change it.
      for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < kNr; ++r) sums[r] += static_cast<float>(seg[h][r]) * s[r];
      }
    }
    dst += data_per_qblk + 2 * kNr;
  }
  for (int r = 0; r < kNr; ++r) put_f32(dst + 4 * r, sums[r]);
  dst += 4 * kNr;
  for (int r = 0; r < kNr; ++r) put_f32(dst + 4 * r, j.bias ? j.bias[e * j.n + rows[r]] : 0.0f);
}

void channel_block(const Job& j, int64_t e, int64_t blk) {
  const int64_t kp = roundup(j.k, 32);
  uint8_t* dst = j.out + e * j.bytes + blk * (j.bytes / (roundup(j.n, kNr) / kNr));
  const int8_t* q = j.q + e * j.n * j.k;
  const float* sc = reinterpret_cast<const float*>(j.scales) + e * j.n;
  const int64_t kfull = j.k / 32 * 32;
  int64_t rows[kNr];
  for (int r = 0; r < kNr; ++r) rows[r] = std::min(blk * kNr + r, j.n - 1);
  int32_t row_sum[kNr] = {0};
  // rows innermost, as in group_block: the 8 rows of a segment are written contiguously
  for (int64_t c = 0; c < kfull / 32; ++c) {
    for (int r = 0; r < kNr; ++r) {
      int32_t seg[2];
      put_chunk(q + rows[r] * j.k + 32 * c, dst + c * 2 * kNr * 8 + r * 8, seg);
      row_sum[r] += seg[0] + seg[1];
    }
  }
  if (kfull < j.k) {  // K tail: pad with int4 zero (the zero point)
    for (int r = 0; r < kNr; ++r) {
      int8_t tail[32] = {0};
      std::memcpy(tail, q + rows[r] * j.k + kfull, j.k - kfull);
      int32_t seg[2];
      put_chunk(tail, dst + (kfull / 32) * 2 * kNr * 8 + r * 8, seg);
      row_sum[r] += seg[0] + seg[1];
    }
  }
  dst += kp / 2 * kNr;
  for (int r = 0; r < kNr; ++r) put_i32(dst + 4 * r, row_sum[r] * 16);
  dst += 4 * kNr;
  for (int r = 0; r < kNr; ++r) put_f32(dst + 4 * r, sc[rows[r]] * 0.0625f);
  dst += 4 * kNr;
  for (int r = 0; r < kNr; ++r) put_f32(dst + 4 * r, j.bias ? j.bias[e * j.n + rows[r]] : 0.0f);
}

}  // namespace

// q: int8 [E, N, K]; scales: bf16 bits [E, N, K/g] (groupwise) or fp32 [E, N] (channelwise, g == K);
// bias: fp32 [E, N] or null; out: uint8 [E, bytes] preallocated by the caller.
void kleidiai_pack(const int8_t* q, int64_t E, int64_t N, int64_t K, const void* scales, bool scales_bf16,
                   const float* bias, int64_t group_size, uint8_t* out, int64_t bytes, int64_t threads) {
  I4P_CHECK(E >= 0 && N >= 1 && K >= 2 && K % 2 == 0, "bad shape");
  const bool channel = group_size == K;
  Job j{q, static_cast<const uint8_t*>(scales), bias, out, N, K, group_size, bytes};
  const int64_t nb = roundup(N, kNr) / kNr;
  if (channel) {
    I4P_CHECK(!scales_bf16, "channelwise scales: fp32 [E, N]");
    I4P_CHECK(j.bytes == nb * kNr * (roundup(K, 32) / 2 + 12), "out has the wrong size");
  } else {
    I4P_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0, "group size");
    I4P_CHECK(scales_bf16, "groupwise scales: bf16 [E, N, K/g]");
    I4P_CHECK(j.bytes == nb * kNr * (K / 2 + 2 * (K / group_size) + 8), "out has the wrong size");
  }
  // grain: enough 8-row blocks to amortise a thread (~64 KiB of input per task)
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K));
  for_rows(E * nb, grain, threads, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u) {
      if (channel) channel_block(j, u / nb, u % nb);
      else group_block(j, u / nb, u % nb);
    }
  });
}

}  // namespace i4p
