// Per-group geometry of the Blackwell NVFP4 MoE grouped GEMM (docs/SPEC.md §2, §3).
//
// Plain integer arithmetic, no CUTLASS types, callable on the host and on the
// device: the host planner (tested on the CPU) and the device kernel that fills
// CUTLASS's per-group argument arrays evaluate exactly this code, so what the
// host tests check is what the GPU computes.
//
// Grouping. Group g = expert * parts + part. For w13 (parts = 2) group
// (e, 0) is the gate GEMM and (e, 1) the up GEMM of expert e; they are separate
// CUTLASS groups so that each carries its own alpha (gate and up
// weight_scale_2 differ per expert, docs/FIELD_BUGS.md row 10), and they write the two
// column halves of one [rows, 2 * n_part] output (ldd = 2 * n_part).
// For w2 (parts = 1) there is one group per expert.
//
// Memory the groups point into (byte offsets from the base pointers). A and D are
// compact: only the rows of real (token, slot) pairs exist; only the scale factors keep
// the docs/SPEC.md §2 128-row padding per expert (TMA reads whole 128-row scale atoms).
//   A    fp4 activations [rows, k/2], expert e's rows start at
//        row_offset(e) = sum_{j<e} tokens_j (no padding).
//   SFA  docs/SPEC.md §2 swizzled scales of A, [sf_rows, k/16] swizzled as one matrix
//        whose expert blocks start on 128-row tiles: expert e's block starts at row
//        sf_row_offset(e) = sum_{j<e} round_up(tokens_j, 128), byte
//        sf_row_offset(e) * sf_padded_cols(k/16), and is the standalone docs/SPEC.md §2
//        layout of a [tokens_e, k/16] matrix (its rows past tokens_e are zero).
//   B    fp4 weights [E, parts * n_part, k/2] (the checkpoint layout, gate rows
//        then up rows for w13).
//   SFB  weight scales swizzled per (expert, part): [E, parts, sf_padded_bytes(n_part, k/16)]
//        bytes. Gate and up are swizzled separately because n_part = I need not
//        be a multiple of 128 (I = 464): a 128-row tile would straddle gate and up.
//   D    fp32 [rows, parts * n_part], row-major, rows as in A.
// TMA bounds each group's A and D tensor maps by its own M, so a tile's rows past the
// expert's tokens are neither read (zero fill) nor written: compact rows are safe.
// Empty experts (0 tokens) get the problem shape (0, 0, 0): CUTLASS's grouped
// tile scheduler then reserves no tiles for them and builds no TMA descriptor.
#pragma once

#include <cstdint>

#include "megamoe/sf_layout.hpp"  // the docs/SPEC.md §2 closed form and padded sizes

#if defined(__CUDACC__)
#define MEGAMOE_HOST_DEVICE __host__ __device__
#else
#define MEGAMOE_HOST_DEVICE
#endif

namespace megamoe::sm100 {

constexpr int kExpertRowAlign = 128;  // docs/SPEC.md §2 per-expert SF row padding (one SF tile of rows)
constexpr int kOutputElementBytes = 4;  // D is fp32
constexpr int kWideTileN = 128;   // the default kernel configuration's N tile
constexpr int kNarrowTileN = 64;  // the small-M configuration's N tile

struct MoeGemmGeometry {
  int num_experts = 0;
  int parts = 1;          // 2: gate/up groups writing two column halves of D; 1: one group per expert
  int n_part = 0;         // N of each group (I for w13 parts, H for w2)
  int k = 0;              // K of every group, in fp4 elements (a multiple of 32 for TMA)
  int a_scale_count = 1;  // 1: one activation global scale; num_experts: one per expert (static input_scale)
  int tile_n = 128;       // N tile of the kernel configuration: 128 (kWideTileN) or 64 (kNarrowTileN)
};

struct GroupGeometry {
  int expert = 0;
  int part = 0;
  int m = 0, n = 0, k = 0;        // problem shape given to CUTLASS ((0,0,0) for an empty expert)
  int tokens = 0;                 // tokens routed to the expert (m before zeroing)
  int64_t row_offset = 0;         // first row of the expert's (compact) block in A and D
  int64_t sf_row_offset = 0;      // first row of the expert's 128-row aligned block in SFA
  int64_t a_offset_bytes = 0;
  int64_t sfa_offset_bytes = 0;
  int64_t b_offset_bytes = 0;
  int64_t sfb_offset_bytes = 0;
  int64_t d_offset_elems = 0;
  int64_t ldd = 0;                // row stride of D in elements
  int a_scale_index = 0;          // index into the activation global scales
  int b_scale_index = 0;          // index into the weight global scales [E * parts]
};

// Where expert e's rows start: exclusive prefix sums over the experts before it.
struct ExpertOffsets {
  int64_t row = 0;     // sum_{j<e} tokens_j: A and D
  int64_t sf_row = 0;  // sum_{j<e} round_up(tokens_j, 128): SFA
};

MEGAMOE_HOST_DEVICE inline int64_t round_up_i64(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

MEGAMOE_HOST_DEVICE inline int num_groups(MoeGemmGeometry const& geo) { return geo.num_experts * geo.parts; }

// Rows an expert adds to A / D and to SFA (a negative count, rejected on the host, counts as 0).
MEGAMOE_HOST_DEVICE inline int64_t expert_rows(int32_t tokens) { return tokens > 0 ? tokens : 0; }
MEGAMOE_HOST_DEVICE inline int64_t expert_sf_rows(int32_t tokens) {
  return round_up_i64(expert_rows(tokens), kExpertRowAlign);
}

// offsets[e] for e = 0..num_experts (offsets[num_experts] = the totals), in one pass.
MEGAMOE_HOST_DEVICE inline void expert_offsets(int32_t const* token_counts, int num_experts, ExpertOffsets* offsets) {
  ExpertOffsets o;
  for (int e = 0; e < num_experts; ++e) {
    offsets[e] = o;
    o.row += expert_rows(token_counts[e]);
    o.sf_row += expert_sf_rows(token_counts[e]);
  }
  offsets[num_experts] = o;
}

// Group `group` of an expert with `tokens` tokens whose rows start at `offsets`.
MEGAMOE_HOST_DEVICE inline GroupGeometry group_geometry(MoeGemmGeometry const& geo, int32_t tokens,
                                                       ExpertOffsets const& offsets, int group) {
  GroupGeometry out;
  out.expert = group / geo.parts;
  out.part = group % geo.parts;
  out.tokens = tokens;
  bool const empty = out.tokens <= 0;
  out.m = empty ? 0 : out.tokens;
  out.n = empty ? 0 : geo.n_part;
  out.k = empty ? 0 : geo.k;
  out.row_offset = offsets.row;
  out.sf_row_offset = offsets.sf_row;
  int64_t const part_index = int64_t(out.expert) * geo.parts + out.part;
  int64_t const sf_row_bytes = megamoe::sf_padded_cols(geo.k / megamoe::kSfVec);  // bytes per row of an SF block
  out.a_offset_bytes = out.row_offset * (geo.k / 2);
  out.sfa_offset_bytes = out.sf_row_offset * sf_row_bytes;
  out.b_offset_bytes = part_index * geo.n_part * (geo.k / 2);
  out.sfb_offset_bytes = part_index * megamoe::sf_padded_bytes(geo.n_part, geo.k / megamoe::kSfVec);
  out.ldd = int64_t(geo.parts) * geo.n_part;
  out.d_offset_elems = out.row_offset * out.ldd + int64_t(out.part) * geo.n_part;
  out.a_scale_index = geo.a_scale_count == 1 ? 0 : out.expert;
  out.b_scale_index = int(part_index);
  return out;
}

// Epilogue alpha of a group: activation global scale x weight global scale (docs/SPEC.md §1: both multiply on decode).
MEGAMOE_HOST_DEVICE inline float group_alpha(GroupGeometry const& gg, float const* a_global_scale,
                                             float const* b_global_scale) {
  return a_global_scale[gg.a_scale_index] * b_global_scale[gg.b_scale_index];
}

}  // namespace megamoe::sm100
