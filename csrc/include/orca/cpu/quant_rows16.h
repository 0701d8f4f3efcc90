// The "x16" layout of the quantized formats: a weight's rows in groups of 16 whose blocks are
// interleaved field by field, so that a vector's 16 int32 lanes are 16 rows
// (quant_vnni_rows16.h's kernels: no per-row scale shuffles and no horizontal sums). The same
// bytes as the file's row layout, permuted within each group of 16 rows (a group's
// 16 * row_bytes bytes start where its first row's would), q5_0 / q5_1's high bits rearranged.
// Block b of a group (a K-quant's super-block), at 16 * block_bytes * b, holds the block's
// fields (kFields) one after the other, each for the 16 rows:
// - a 2-byte field (an fp16 d, m or dmin) as 16 halves, row r's at 2r;
// - a field of 4n bytes as n vectors of 64 bytes, vector v holding bytes 4v to 4v + 3 of each
//   row's field (row r's at 4r);
// - q5_0 / q5_1's qh (a 4-byte field) rearranged: byte i of row r's holds bits 4v + i (as bit
//   v) and 16 + 4v + i (as bit 4 + v) of its qh, v = 0..3: the fifth bits of the weights whose
//   low four are in quant vector v's byte i.
#pragma once

#include <emmintrin.h>

#include <cstdint>
#include <cstring>

#include "orca/cpu/quant_formats.h"

namespace orca::cpu::quant {

constexpr int64_t kRowGroup = 16;  // rows per group of the x16 layout

namespace rows16 {

// A block's field in the file: its first byte and its bytes.
struct Field {
  int64_t at, bytes;
};

// Each format's fields in the x16 layout's order (a K-quant's ggml struct order, but q6_K's
// d, scales, qh, ql: its scales first).
struct Fields {
  Field field[5];
  int count;
};

constexpr Fields fields(Format f) {
  switch (f) {
    case Format::kQ8_0: return {{{0, 2}, {2, 32}}, 2};
    case Format::kQ4_0: return {{{0, 2}, {2, 16}}, 2};
    case Format::kQ4_1: return {{{0, 2}, {2, 2}, {4, 16}}, 3};
    case Format::kQ5_0: return {{{0, 2}, {2, 4}, {6, 16}}, 3};
    case Format::kQ5_1: return {{{0, 2}, {2, 2}, {4, 4}, {8, 16}}, 4};
    case Format::kQ8_M: return {{{0, 2}, {2, 2}, {4, 32}}, 3};
    case Format::kQ4_K: return {{{0, 2}, {2, 2}, {4, 12}, {16, 128}}, 4};
    case Format::kQ5_K: return {{{0, 2}, {2, 2}, {4, 12}, {16, 32}, {48, 128}}, 5};
    case Format::kQ6_K: return {{{208, 2}, {192, 16}, {128, 64}, {0, 128}}, 4};
  }
  return {{}, 0};
}

// Where field i of a block starts in its group's block.
constexpr int64_t group_at(Format f, int i) {
  int64_t at = 0;
  for (int j = 0; j < i; ++j) at += kRowGroup * fields(f).field[j].bytes;
  return at;
}

// A 32-weight format's quant field (its last) and its 64-byte vectors in a group block: 4 for
// the four-bit formats (a byte's low and high nibbles), 8 for q8_0 / q8_m.
constexpr int quant_field(Format f) { return fields(f).count - 1; }
constexpr int quant_vectors(Format f) {
  return static_cast<int>(fields(f).field[quant_field(f)].bytes / 4);
}

// q5_0 / q5_1: their qh, field 1 or 2, is rearranged.
constexpr bool has_high_bits(Format f) { return f == Format::kQ5_0 || f == Format::kQ5_1; }
constexpr int high_bits_field(Format f) { return f == Format::kQ5_1 ? 2 : 1; }

// Bits 0, 4, ..., 28 of x as bits 0 to 7, and back.
inline uint32_t gather_every_fourth_bit(uint32_t x) {
  x &= 0x11111111u;
  x = (x | x >> 3) & 0x03030303u;
  x = (x | x >> 6) & 0x000F000Fu;
  return (x | x >> 12) & 0xFFu;
}
inline uint32_t spread_to_every_fourth_bit(uint32_t x) {
  x = (x | x << 12) & 0x000F000Fu;
  x = (x | x << 6) & 0x03030303u;
  return (x | x << 3) & 0x11111111u;
}

// A block's qh in the group layout's order, and back.
inline uint32_t rearrange_high_bits(uint32_t qh) {
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) out |= gather_every_fourth_bit(qh >> i) << (8 * i);
  return out;
}
inline uint32_t restore_high_bits(uint32_t rearranged) {
  uint32_t qh = 0;
  for (int i = 0; i < 4; ++i) qh |= spread_to_every_fourth_bit(rearranged >> (8 * i) & 0xFF) << i;
  return qh;
}

// Four 16-byte rows of four dwords each, transposed (its own inverse).
inline void transpose_dwords(__m128i (&m)[4]) {
  const __m128i t0 = _mm_unpacklo_epi32(m[0], m[1]), t1 = _mm_unpacklo_epi32(m[2], m[3]);
  const __m128i t2 = _mm_unpackhi_epi32(m[0], m[1]), t3 = _mm_unpackhi_epi32(m[2], m[3]);
  m[0] = _mm_unpacklo_epi64(t0, t1);
  m[1] = _mm_unpackhi_epi64(t0, t1);
  m[2] = _mm_unpacklo_epi64(t2, t3);
  m[3] = _mm_unpackhi_epi64(t2, t3);
}

// One block of 16 rows from the file's layout (rows row_bytes apart) into the group's
// (kToGroup), or back.
template <Format F, bool kToGroup>
inline void convert_block(const uint8_t* in, uint8_t* out, int64_t row_bytes) {
  const auto copy = [&](int64_t file_at, int64_t grouped_at, int64_t bytes) {
    if constexpr (kToGroup) {
      std::memcpy(out + grouped_at, in + file_at, bytes);
    } else {
      std::memcpy(out + file_at, in + grouped_at, bytes);
    }
  };
  constexpr Fields kFields = fields(F);
  for (int i = 0; i < kFields.count; ++i) {
    const Field field = kFields.field[i];
    const int64_t base = group_at(F, i);
    if (has_high_bits(F) && i == high_bits_field(F)) {
      // All 16 rows at once (a loop the compiler vectorizes).
      uint32_t qh[kRowGroup];
      for (int64_t r = 0; r < kRowGroup; ++r) {
        std::memcpy(&qh[r], in + (kToGroup ? r * row_bytes + field.at : base + 4 * r), 4);
      }
      for (auto& bits : qh) bits = kToGroup ? rearrange_high_bits(bits) : restore_high_bits(bits);
      for (int64_t r = 0; r < kRowGroup; ++r) {
        std::memcpy(out + (kToGroup ? base + 4 * r : r * row_bytes + field.at), &qh[r], 4);
      }
    } else if (field.bytes == 2) {
      for (int64_t r = 0; r < kRowGroup; ++r) copy(r * row_bytes + field.at, base + 2 * r, 2);
    } else if (field.bytes % 16 == 0) {
      // Four rows' bytes 16c to 16c + 15 <-> those rows' dwords in vectors 4c to 4c + 3.
      for (int64_t r0 = 0; r0 < kRowGroup; r0 += 4) {
        for (int64_t c = 0; c < field.bytes / 16; ++c) {
          const auto file_at = [&](int k) { return (r0 + k) * row_bytes + field.at + 16 * c; };
          const auto grouped_at = [&](int k) { return base + 64 * (4 * c + k) + 4 * r0; };
          __m128i m[4];
          for (int k = 0; k < 4; ++k) {
            m[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                in + (kToGroup ? file_at(k) : grouped_at(k))));
          }
          transpose_dwords(m);
          for (int k = 0; k < 4; ++k) {
            _mm_storeu_si128(
                reinterpret_cast<__m128i*>(out + (kToGroup ? grouped_at(k) : file_at(k))), m[k]);
          }
        }
      }
    } else {
      for (int64_t r = 0; r < kRowGroup; ++r) {
        for (int64_t v = 0; v < field.bytes / 4; ++v) {
          copy(r * row_bytes + field.at + 4 * v, base + 64 * v + 4 * r, 4);
        }
      }
    }
  }
}

}  // namespace rows16

// Row r of a weight of K weights a row in the x16 layout (w: its first group) in the file's
// layout, row_bytes(f, K) bytes at out.
inline void file_row_of_rows16(Format f, const uint8_t* w, int64_t K, int64_t r, uint8_t* out) {
  dispatch_format(f, [&]<Format F>() {
    constexpr rows16::Fields kFields = rows16::fields(F);
    const int64_t row = row_bytes(F, K), blocks = K / weights_per_block(F);
    const int64_t lane = r % kRowGroup;
    const uint8_t* group = w + (r - lane) * row;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* in = group + b * kRowGroup * block_bytes(F);
      uint8_t* block = out + b * block_bytes(F);
      for (int i = 0; i < kFields.count; ++i) {
        const rows16::Field field = kFields.field[i];
        const uint8_t* base = in + rows16::group_at(F, i);
        if (field.bytes == 2) {
          std::memcpy(block + field.at, base + 2 * lane, 2);
          continue;
        }
        for (int64_t v = 0; v < field.bytes / 4; ++v) {
          std::memcpy(block + field.at + 4 * v, base + 64 * v + 4 * lane, 4);
        }
        if (rows16::has_high_bits(F) && i == rows16::high_bits_field(F)) {
          uint32_t qh;
          std::memcpy(&qh, block + field.at, 4);
          qh = rows16::restore_high_bits(qh);
          std::memcpy(block + field.at, &qh, 4);
        }
      }
    }
  });
}

// `rows` rows of K weights (rows a multiple of kRowGroup) from the file's layout into the x16
// layout (kToGroup), or back; in and out do not overlap.
template <bool kToGroup>
inline void convert_rows16(Format f, const uint8_t* in, int64_t K, int64_t rows, uint8_t* out) {
  dispatch_format(f, [&]<Format F>() {
    const int64_t row = row_bytes(F, K), blocks = K / weights_per_block(F);
    for (int64_t g = 0; g < rows / kRowGroup; ++g) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t file_at = g * kRowGroup * row + b * block_bytes(F);
        const int64_t group_block_at = g * kRowGroup * row + b * kRowGroup * block_bytes(F);
        rows16::convert_block<F, kToGroup>(in + (kToGroup ? file_at : group_block_at),
                                           out + (kToGroup ? group_block_at : file_at), row);
      }
    }
  });
}

}  // namespace orca::cpu::quant
