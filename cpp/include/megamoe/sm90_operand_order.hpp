// The orders in which the sm90 GEMMs read a bf16 activation row: one closed form for every kernel and host path that
// writes or reads them (the staging, scatter and quantize kernels, the GEMM epilogues that write h as the gemm2
// operand, the GEMMs themselves), checked against CuTe layouts by cpp/tests/test_sm90_operand_order.cpp.
//
// Operand order (every sm90 GEMM). The weight decode (cpp/sm90/gemm_common.cuh, dequant_word) turns a word of 8
// consecutive weights n0..n7 into the bf16 pairs (n_j, n_{j+4}), j = 0..3. A dot product does not care about the
// order of its terms as long as both operands use the same one, so each 8-element group of an activation row is
// stored in the order 0,4,1,5,2,6,3,7: element j of the group at position operand_position(j) = 2 (j % 4) + j / 4
// (the CuTe layout (4,2):(2,1)); operand_order is its inverse, the element stored at position p ((2,4):(4,1)).
//
// Lane order (the wgmma GEMMs, cpp/sm90/gemm_wgmma.cuh). Within every 64-element block of a row, MMA lane t of a
// quad owns elements [16 t, 16 t + 16) of its weight rows: two whole words. Its A-fragment k-positions must hold
// the partners of those elements, so the operand-order unit u = 8 t + v (a unit: the bf16 pair at operand positions
// 2u, 2u + 1; t < 4, v < 8) is stored at unit 4 v + t: operand position p at lane_order_position(p) (the CuTe layout
// (2,8,4):(1,8,2) of p).
//
// The device code that stores rows in these orders: megamoe/sm90_operand_order.cuh.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define MEGAMOE_OO_HD __host__ __device__ __forceinline__
#else
#define MEGAMOE_OO_HD inline
#endif

namespace megamoe {

// Stored position of element j of an 8-element group in operand order (inverse of operand_order()).
MEGAMOE_OO_HD int operand_position(int j) { return ((j & 3) << 1) | (j >> 2); }

// Stored position p of an 8-element group holds element operand_order(p).
MEGAMOE_OO_HD int operand_order(int p) { return (p >> 1) + ((p & 1) << 2); }

// Lane order: the stored unit of operand-order unit u (0 <= u < 32) of a 64-element block.
MEGAMOE_OO_HD int lane_order_unit(int u) { return ((u & 7) << 2) | (u >> 3); }

// Lane order: the stored position of operand-order position p (0 <= p < 64) within its 64-element block.
MEGAMOE_OO_HD int lane_order_position(int p) {
  return (lane_order_unit(p >> 1) << 1) | (p & 1);
}

// Offset of column col of an operand row (operand order, or with lane_order the wgmma kernels' lane order).
MEGAMOE_OO_HD int64_t operand_column(int64_t col, bool lane_order) {
  const int op = int(col & 56) + operand_position(int(col & 7));  // operand position within the 64-block
  return (col & ~int64_t(63)) + (lane_order ? lane_order_position(op) : op);
}

// The inverse, per stored 16-byte chunk c (8 bf16 = 4 pairs) of a row: pair t of the chunk holds the elements
// operand_chunk_first(c) + operand_chunk_step * t and 4 more. Operand order: chunk c is 8-element group c, pair t its
// elements (t, t + 4). Lane order: chunk v = c % 8 of 64-element block c / 8 holds the operand pairs v, 8 + v, 16 + v,
// 24 + v, i.e. elements (16 t + 8 (v / 4) + v % 4, + 4) of the block.
MEGAMOE_OO_HD int64_t operand_chunk_first(int64_t c, bool lane_order) {
  const int v = int(c & 7);
  return lane_order ? (c >> 3) * 64 + 8 * (v >> 2) + (v & 3) : c * 8;
}
MEGAMOE_OO_HD int operand_chunk_step(bool lane_order) { return lane_order ? 16 : 1; }

}  // namespace megamoe
