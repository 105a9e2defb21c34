// The dispatch plan of the Hopper (sm_90a) MoE GEMMs: which grouped-GEMM kernel and tiling a forward runs.
// Plain host C++ (no CUDA header, no device code): cpp/sm90/plan.cpp implements it, the launchers and the kernels
// (cpp/sm90/gemm_*.cuh) read the same constants, tests/test_sm90_plan.py checks it on the CPU.
#pragma once
#include <cstdint>

namespace megamoe::sm90 {

// Token tiles of the wgmma kernels (GemmKernel::kWgmma32 / 64 / 128: the largest token count of one block), and
// kTile8, the one-token blocks that run a tile-32 GEMM whose grid is small (plan_tile8): 64 weight rows (one
// warpgroup) x up to 8 tokens, three blocks per SM.
constexpr int kTile8 = 8, kTile32 = 32, kTile64 = 64, kTile128 = 128;
constexpr int kWgK = 64;              // K of one SW128 activation sub-tile of the wgmma kernels (a stage holds 1, 2 or 4)
constexpr int kWgMaxExperts = 1024;   // the plan's bound on E for the wgmma kernels: every block scans all E token counts
// K per stage of a wgmma tile: the largest it runs (wg_stage_k), and the smallest (its fallback, wg_min_stage_k: the K
// granularity the plan and the launch require). plan_stage_k: the one a GEMM of reduction length k runs, the largest
// when k is a multiple of it and the activation rows come by TMA (act_tma), else the smallest.
constexpr int wg_stage_k(int max_n) { return max_n == kTile128 ? 128 : 256; }
constexpr int wg_min_stage_k(int max_n) { return max_n <= kTile32 ? 256 : max_n == kTile64 ? 128 : kWgK; }
constexpr int plan_stage_k(int max_n, int64_t k, bool act_tma) {
  return k % wg_stage_k(max_n) == 0 && act_tma ? wg_stage_k(max_n) : wg_min_stage_k(max_n);
}

// Row blocks in pairs (wgmma tiles 32 and 64 with TMA rows: wg_items): a pair saves one block launch, expert scan and
// first wait, but runs its two row blocks one after the other on one SM. When every block of the unpaired grid is
// resident at once (at most tiles_bound token tiles x row_blocks blocks, wg_blocks_per_sm of them per SM), the pairs
// would put two row blocks in turn on one SM while other SMs idle or hold one: the grid runs unpaired (one token:
// v4-flash gemm2 is 6 x 32 row blocks, 96 pairs on 96 of 132 SMs, or 192 blocks on all of them). Either way each
// row of the output sums its K in the same order (batch invariance holds).
constexpr int wg_blocks_per_sm(int tile) { return tile == kTile8 ? 3 : tile == kTile32 ? 2 : 1; }
// Whether a grid of `blocks` blocks of the tile is resident at once (one wave).
constexpr bool wg_one_wave(int tile, int64_t blocks, int sm_count) {
  return blocks <= int64_t(sm_count) * wg_blocks_per_sm(tile);
}
constexpr bool plan_pair_row_blocks(int tile, int64_t row_blocks, int64_t tiles_bound, int sm_count) {
  return !wg_one_wave(tile, tiles_bound * row_blocks, sm_count);
}
// Upper bound of the token tiles of a grouped GEMM of `rows` rows over `experts` experts (each tile holds a row).
constexpr int64_t wg_tiles_bound(int tile, int64_t rows, int64_t experts) {
  const int64_t t = (rows + tile - 1) / tile + experts;
  return t < rows ? t : rows;
}
// A tile-32 GEMM (no quantizing epilogue) runs on one-token blocks (kTile8) where all of their grid is resident at
// once and it puts fewer weight bytes on the busiest SM: units8 blocks of 64 rows (tiles of 8 x row blocks of 64
// rows) against blocks32 of 128 rows (unpaired). At one token, where every SM holds one or two of tile 32's blocks,
// the SM with two sets the time (v4-flash gemm1: 192 blocks of 128 rows, 60 SMs with two; as 384 blocks of 64 rows at
// most three per SM: three quarters of the bytes). A row sums its K in the same order with the same wgmma (n8) in
// both: the bits are tile 32's.
constexpr bool plan_tile8(int64_t units8, int64_t blocks32, int sm_count) {
  const int64_t sm = sm_count;
  return wg_one_wave(kTile8, units8, sm_count) && (units8 + sm - 1) / sm < 2 * ((blocks32 + sm - 1) / sm);
}
// A grid of tile 8 or 32 that is one wave (at most `blocks` blocks: decode) is launched with programmatic dependent
// launch (pdl.cuh), on the kernel's kPdl instance: its blocks start, and with settled offsets find their tile and issue
// their first weight loads, while the kernel before it finishes (one token of v3 on an H100: 88 against 93 us). Every
// other grid runs the instance and launch it had before: the prologue reordered for PDL, in every instance, ran
// v3 at T = 2048 3% slower.
constexpr bool plan_pdl_launch(int tile, int64_t blocks, int sm_count) {
  return tile <= kTile32 && wg_one_wave(tile, blocks, sm_count);
}

// From this many tokens the per-slot gemm1 input is written in token order (each row of x read once and stored into
// its k grouped rows; W4A4 where a token's slots quantize alike: quantized once) instead of gathered per slot (a
// token's row read, and with W4A4 quantized, k times, in expert order): GemmPlan::token_order.
constexpr int64_t kTokenOrderFrom = 1024;

// The grouped-GEMM kernels (exported to Python once, as megamoe._C.Sm90GemmKernel).
enum class GemmKernel : int {
  kAuto = -1,     // let plan_moe_gemms() decide (only as GemmProblem::kernel)
  kStream = 0,    // streaming, mma.sync, swap-AB: decode, few tokens per expert (cpp/sm90/gemm_stream.cuh)
  kWgmma32 = 1,   // wgmma, swap-AB, token tiles of up to 32 tokens, K 256 per stage (cpp/sm90/gemm_wgmma.cuh)
  kWgmma64 = 2,   // the same with token tiles of up to 64 tokens, K 128 per stage
  kWgmma128 = 3,  // token tiles of up to 128 tokens, K 128 per stage (K 64 when K % 128 != 0 or rows are copied)
};

// What the dispatch plan needs to know about one MoE forward (or one grouped GEMM).
struct GemmProblem {
  int64_t tokens_per_expert = 0;  // expected tokens per expert under uniform routing, ceil(T*k / E)
  int64_t k_gemm1 = 0, k_gemm2 = 0;  // reduction lengths of the two GEMMs (H and I; equal for a single GEMM)
  int num_experts = 0;
  bool w4a16 = true;              // activations bf16 (false: NVFP4, W4A4)
  bool gather_input = true;       // the input may be gathered by the first GEMM (bf16 x, MoE forward)
  bool h_static_scale = false;    // W4A4: h takes a static global scale (not the per-row dynamic one), so the
                                  // first GEMM can quantize it in its epilogue
  GemmKernel kernel = GemmKernel::kAuto;  // an explicit choice (benchmarks, tests): kept when the shape allows it
  int tokens_per_pass = 0;                // streaming: explicit 8, 16, 32 or 64 (0: the plan's)
  int64_t tokens = 0;                     // T of the MoE forward (0: not a forward: no one-token path, no token order)
  bool slots_quantize_alike = true;       // W4A4: a token's k slots quantize alike (a per-row dynamic scale, or one
                                          // static scale for every expert), so its gemm1 input may go in token order
  int64_t token_order_from = kTokenOrderFrom;  // GemmPlan::token_order from this many tokens
  // A row's output bits must not depend on the rest of its batch (docs/SPEC.md §3.5): the automatic choice never
  // mixes the streaming kernel (K split four ways between warps, partial sums added in shared memory) with the wgmma
  // kernels (K in one sequence of k16 steps) across token counts. Every wgmma tile and width sums a row in the same
  // order with the same instructions, so where the shape allows the wgmma kernels they run at every T, decode
  // included; elsewhere the streaming kernel runs at every T. An explicit kernel is kept as asked.
  bool batch_invariant = false;
};

// The one dispatch decision for a problem: kernel, token tile, tokens per pass, fusions, stage K, copied rows, the
// one-token path and the token order.
struct GemmPlan {
  GemmKernel kernel = GemmKernel::kStream;  // never kAuto
  int token_tile = 8;       // tokens per MMA tile: 8 streaming (n8), 32 / 64 / 128 wgmma (largest N per block)
  int tokens_per_pass = 8;  // tokens sharing one dequantization of the weights (streaming: 8..64; wgmma: the tile)
  bool gather_x = false;    // W4A16, bf16 x, streaming or wgmma tile 32: gemm1 reads its rows through row_token (the
                            // streaming kernel from x itself, wgmma from x staged once as [T, H] in lane order), no
                            // per-slot staging; tiles 64 and 128 read x staged per slot (TMA boxes of contiguous rows)
  bool h_operand = false;   // gemm1 writes h as the bf16 gemm2 operand, no staging kernel between the GEMMs: W4A16, and
                            // W4A4 with a static scale for h (h_static_scale; gemm1 quantizes h, GroupedGemmCommon::h_quant_gs)
  bool lane_order = false;  // the kernel reads its activations in lane order (wgmma): stage them so
  // wgmma: K per pipeline stage of gemm1 and gemm2 (plan_stage_k, for 16-byte aligned activations, as the workspace's
  // are) and whether gemm1 copies its gathered rows with cp.async (gather_x) instead of TMA boxes; 0 / false streaming
  int stage_k_gemm1 = 0, stage_k_gemm2 = 0;
  bool copied_rows_gemm1 = false;
  // One token (GemmProblem::tokens == 1) runs without the align kernel: on the one-tile streaming kernel with both K
  // multiples of 64 or on wgmma tile 32, W4A16 gathering bf16 x (gather_x) or W4A4 with h quantized in gemm1
  // (h_operand); slot j is row j of expert topk_ids[0, j] and gemm1 writes the token's entry_row.
  bool without_align = false;
  // The per-slot gemm1 input (where not gathered) is written in token order (scatter through entry_row) rather than
  // gathered slot by slot: from GemmProblem::token_order_from tokens, W4A16, or W4A4 whose slots quantize alike.
  bool token_order = false;
};

// Pure host function (no CUDA call): the thresholds below are the measured switch points
// (docs/PERFORMANCE.md), which GemmProblem::batch_invariant overrides for the streaming kernel. Streaming with one 8-token tile per pass up to kWgmmaAboveTokensPerExpert
// expected tokens per expert, wgmma above: tile 32 up to kWgmma32UpTo when both K are multiples
// of 256 (it steps K by 256), tile 64 up to kWgmma64UpTo (or in tile 32's range when a K is a
// multiple of 128 only) when both K are multiples of 128 (it steps K by 128), then (or for a K
// that is a multiple of 64 only) tile 128; streaming whenever a K is not a multiple of 64 or E > 1024 (the
// wgmma kernel's limits), one tile per pass up to kStreamOneTileUpTo, more tiles per pass above.
constexpr int64_t kWgmmaAboveTokensPerExpert = 4;
constexpr int64_t kWgmma32UpTo = 28;
constexpr int64_t kWgmma64UpTo = 63;
constexpr int64_t kStreamOneTileUpTo = 8;
GemmPlan plan_moe_gemms(const GemmProblem& problem);

}  // namespace megamoe::sm90
