// The sm90 activation orders of megamoe/sm90_operand_order.hpp checked against CuTe layouts:
//  - operand_position(j) equals the layout (4,2):(2,1) at j, operand_order(p) its right inverse at p;
//  - lane_order_unit(u) equals (8,4):(4,1) at u (and the quantizer's quad transposition 4 i + tig),
//    lane_order_position(p) equals (2,8,4):(1,8,2) at p;
//  - operand_column(col, lane_order) equals, per 64-element block, the composition of the lane layout with the
//    block's operand layout ((4,2,8):(2,1,8)), both bijective on the block;
//  - the per-chunk inverse (operand_chunk_first / operand_chunk_step, what the staging kernels read) puts element e
//    exactly where operand_column(e) says, for every element of several blocks in both orders.
#include <cstdio>
#include <vector>

#include <cute/tensor.hpp>

#include "megamoe/sm90_operand_order.hpp"

using namespace cute;

static int failures = 0;
static int checks = 0;

static void expect(bool ok, const char* what, long long at, long long ours, long long theirs) {
  ++checks;
  if (!ok) {
    if (failures < 20) std::printf("FAIL %s at %lld: ours %lld, CuTe / expected %lld\n", what, at, ours, theirs);
    ++failures;
  }
}

int main() {
  // Operand order within an 8-element group.
  const auto group = make_layout(make_shape(Int<4>{}, Int<2>{}), make_stride(Int<2>{}, Int<1>{}));
  const auto group_inv = right_inverse(group);
  for (int j = 0; j < 8; ++j) {
    expect(megamoe::operand_position(j) == group(j), "operand_position", j, megamoe::operand_position(j), group(j));
    expect(megamoe::operand_order(j) == group_inv(j), "operand_order", j, megamoe::operand_order(j), group_inv(j));
    expect(megamoe::operand_order(megamoe::operand_position(j)) == j, "operand_order o operand_position", j,
           megamoe::operand_order(megamoe::operand_position(j)), j);
  }

  // Lane order within a 64-element block: units (pairs), then positions.
  const auto unit = make_layout(make_shape(Int<8>{}, Int<4>{}), make_stride(Int<4>{}, Int<1>{}));
  const auto lane = make_layout(make_shape(Int<2>{}, Int<8>{}, Int<4>{}), make_stride(Int<1>{}, Int<8>{}, Int<2>{}));
  for (int u = 0; u < 32; ++u)
    expect(megamoe::lane_order_unit(u) == unit(u), "lane_order_unit", u, megamoe::lane_order_unit(u), unit(u));
  for (int p = 0; p < 64; ++p)
    expect(megamoe::lane_order_position(p) == lane(p), "lane_order_position", p, megamoe::lane_order_position(p),
           lane(p));
  // The quantizer's quad transposition (sm90_operand_order.cuh, lane_order_chunks): word i of lane tig's block at unit
  // 4 i + tig of the 64-block, which is lane_order_unit(8 tig + i).
  for (int tig = 0; tig < 4; ++tig)
    for (int i = 0; i < 8; ++i)
      expect(megamoe::lane_order_unit(8 * tig + i) == 4 * i + tig, "lane_order_chunks' unit", 8 * tig + i,
             megamoe::lane_order_unit(8 * tig + i), 4 * i + tig);

  // A whole 64-element block: element e -> operand position (8-element groups kept in place) -> lane order.
  const auto block = make_layout(make_shape(Int<4>{}, Int<2>{}, Int<8>{}), make_stride(Int<2>{}, Int<1>{}, Int<8>{}));
  const auto block_lane = composition(lane, block);
  for (int lane_order = 0; lane_order < 2; ++lane_order) {
    const int64_t cols = 4 * 64;
    std::vector<int> hits(cols, 0);
    for (int64_t e = 0; e < cols; ++e) {
      const int64_t ours = megamoe::operand_column(e, lane_order != 0);
      const int64_t theirs = (e / 64) * 64 + (lane_order ? block_lane(int(e % 64)) : block(int(e % 64)));
      expect(ours == theirs, lane_order ? "operand_column (lane order)" : "operand_column (operand order)", e, ours,
             theirs);
      if (ours >= 0 && ours < cols) ++hits[ours];
    }
    for (int64_t c = 0; c < cols; ++c) expect(hits[c] == 1, "operand_column is a bijection", c, hits[c], 1);

    // The per-chunk inverse: pair t of stored chunk c holds elements (first + step t, + 4) at columns 8c + 2t, + 1.
    for (int64_t c = 0; c < cols / 8; ++c)
      for (int t = 0; t < 4; ++t) {
        const int64_t e0 = megamoe::operand_chunk_first(c, lane_order != 0) + megamoe::operand_chunk_step(lane_order != 0) * t;
        expect(megamoe::operand_column(e0, lane_order != 0) == 8 * c + 2 * t, "operand_chunk_first (pair's first)",
               8 * c + 2 * t, megamoe::operand_column(e0, lane_order != 0), 8 * c + 2 * t);
        expect(megamoe::operand_column(e0 + 4, lane_order != 0) == 8 * c + 2 * t + 1,
               "operand_chunk_first (pair's second)", 8 * c + 2 * t + 1, megamoe::operand_column(e0 + 4, lane_order != 0),
               8 * c + 2 * t + 1);
      }
  }

  std::printf("sm90 operand order: %d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
