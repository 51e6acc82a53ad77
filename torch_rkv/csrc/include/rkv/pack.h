// Bit packing: the stable byte layout of docs/format.md.
//
// A row of D codes of b bits is one little-endian bitstream of D*b bits: code i occupies stream bits
// [i*b, (i+1)*b), and stream bit k is bit (k % 8) of byte k / 8. So 8-bit is one code per byte, 4-bit
// puts code 2j in the low nibble of byte j, 2-bit puts code 4j+r in bits 2r..2r+1 of byte j, and 3-bit
// packs codes 8j..8j+7 into bytes 3j..3j+2 as one 24-bit little-endian word. A row needs D*b % 8 == 0.
#pragma once

#include "rkv/macros.h"

namespace rkv {

RKV_HD bool valid_bits(int64_t bits) { return bits == 2 || bits == 3 || bits == 4 || bits == 8; }
RKV_HD uint32_t code_mask(int bits) { return (1u << bits) - 1u; }
RKV_HD int64_t packed_row_bytes(int64_t dim, int bits) { return dim * bits / 8; }

// Code i of a packed row. Reads the second byte only when the code straddles it, so it never reads
// past the row.
RKV_HD uint32_t unpack_code(const uint8_t* row, int64_t i, int bits) {
  const int64_t bit = i * bits;
  const int64_t byte = bit >> 3;
  const int shift = static_cast<int>(bit & 7);
  uint32_t w = row[byte];
  if (shift + bits > 8) w |= static_cast<uint32_t>(row[byte + 1]) << 8;
  return (w >> shift) & code_mask(bits);
}

// Byte k of a packed row whose code i is code_at(i) (a functor, so a kernel can compute codes on the
// fly). Each output byte depends only on its own codes: bytes can be written by independent threads.
template <typename CodeAt>
RKV_HD uint8_t pack_byte_from(const CodeAt& code_at, int64_t k, int bits) {
  const int64_t first = (8 * k) / bits;
  const int64_t last = (8 * k + 7) / bits;
  uint32_t out = 0;
  for (int64_t i = first; i <= last; ++i) {
    const int shift = static_cast<int>(i * bits - 8 * k);
    const uint32_t c = code_at(i) & code_mask(bits);
    out |= shift >= 0 ? (c << shift) : (c >> -shift);
  }
  return static_cast<uint8_t>(out & 0xffu);
}

struct CodeArray {
  const uint8_t* codes;
  RKV_HD uint32_t operator()(int64_t i) const { return codes[i]; }
};

// Byte k of the packed row holding `codes` (one code per uint8).
RKV_HD uint8_t pack_byte(const uint8_t* codes, int64_t k, int bits) { return pack_byte_from(CodeArray{codes}, k, bits); }

}  // namespace rkv
