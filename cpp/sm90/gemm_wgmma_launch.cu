// launch_wgmma_gemm (megamoe/sm90_kernels.h): the wgmma grouped-GEMM kernel (gemm_wgmma.cuh) of the arguments' token
// tile, stage K and TMA or copied activation rows (WgmmaGemmArgs: the plan's), its TMA tensor maps (encoded on the
// host), its shared-memory attributes and its grid.
#include "gemm_wgmma.cuh"
#include "pdl.cuh"

namespace megamoe::sm90 {

cudaError_t encode_tensor_map(CUtensorMap* map, CUtensorMapDataType type, int rank, const void* base,
                              const uint64_t* dims, const uint64_t* strides, const uint32_t* box,
                              CUtensorMapSwizzle swizzle) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<Encode>(fn);
  }();
  if (!encode) return cudaErrorNotSupported;
  cuuint64_t d[5], st[4];
  cuuint32_t b[5], one[5];
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    one[i] = 1;
    if (i + 1 < rank) st[i] = strides[i];
  }
  const CUresult r = encode(map, type, cuuint32_t(rank), const_cast<void*>(base), d, st, b, one,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Tensor maps of one launch (host; encoding is a pure host call, no GPU work).
template <int kMaxN, int kStageK>
inline cudaError_t wg_encode_maps(const WgmmaGemmArgs& a, WgMaps& maps) {
  using Cfg = WgCfg<kMaxN, kStageK>;
  const uint64_t E = uint64_t(a.num_experts), N = uint64_t(a.N), K = uint64_t(a.K);
  // weight and scale boxes: kSiluMul R / 2 rows (gate and up rows apart), kStore all R rows of the block
  const int box_rows = a.epilogue == Epilogue::kSiluMul ? Cfg::kRows / 2 : Cfg::kRows;
  if (a.w_tiled) {
    // {bytes of a chunk, 32 rows, K / 256 chunks, N / 32 groups, E} (kWTileRows, kWTileK; wgmma_gemm_args_error
    // checked the shape): a box of R / 32 groups x 32 rows x kKS / 2 bytes lands as R rows of kKS / 2 bytes, as the
    // 3-D box of the row-major order does
    constexpr uint64_t kR = kWTileRows, kW = kWTileK / 2, kS = kWTileK / 16;
    const uint64_t chunks = K / kWTileK, groups = N / kR;
    const uint32_t gbox = uint32_t(box_rows / kWTileRows);
    {
      const uint64_t dims[5] = {kW, kR, chunks, groups, E}, strides[4] = {kW, kR * kW, chunks * kR * kW, N * K / 2};
      const uint32_t box[5] = {uint32_t(Cfg::kKS / 2), uint32_t(kR), 1, gbox, 1};
      const cudaError_t err = encode_tensor_map(&maps.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 5, a.w_data, dims, strides,
                                                box, Cfg::kWSwizzle);
      if (err != cudaSuccess) return err;
    }
    const uint64_t dims[5] = {kS, kR, chunks, groups, E}, strides[4] = {kS, kR * kS, chunks * kR * kS, N * K / 16};
    const uint32_t box[5] = {uint32_t(kS), uint32_t(kR), 1, gbox, 1};
    const cudaError_t err = encode_tensor_map(&maps.s, CU_TENSOR_MAP_DATA_TYPE_UINT8, 5, a.w_scale, dims, strides, box,
                                              CU_TENSOR_MAP_SWIZZLE_NONE);
    if (err != cudaSuccess) return err;
  } else {
    {
      const uint64_t dims[3] = {K / 2, N, E}, strides[2] = {K / 2, N * K / 2};
      const uint32_t box[3] = {uint32_t(Cfg::kKS / 2), uint32_t(box_rows), 1};
      const cudaError_t err = encode_tensor_map(&maps.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, a.w_data, dims, strides,
                                                box, Cfg::kWSwizzle);
      if (err != cudaSuccess) return err;
    }
    const uint64_t srs = uint64_t(scale_row_bytes(a));
    const uint64_t dims[3] = {K / 16, N, E}, strides[2] = {srs, N * srs};
    const uint32_t box[3] = {16, uint32_t(box_rows), 1};
    const cudaError_t err = encode_tensor_map(&maps.s, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, a.w_scale, dims, strides, box,
                                              CU_TENSOR_MAP_SWIZZLE_NONE);
    if (err != cudaSuccess) return err;
  }
  if (a.act_tma) {
    const uint64_t rows = uint64_t(a.act_num_rows > 0 ? a.act_num_rows : a.max_total_rows);
    // {64 elements, rows, K / 64 blocks}: one box holds a stage's kSub sub-tiles of `width` rows, each 128-byte
    // swizzled as a wgmma descriptor reads it
    const uint64_t dims[3] = {uint64_t(kWgK), rows, K / kWgK}, strides[2] = {K * 2, uint64_t(kWgK) * 2};
    for (int i = 0; i < Cfg::kNumWidths; ++i) {
      const uint32_t box[3] = {uint32_t(kWgK), uint32_t(Cfg::width(i)), uint32_t(Cfg::kSub)};
      const cudaError_t err = encode_tensor_map(&maps.act[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, a.act, dims,
                                                strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

template <int kMaxN, int kStageK, bool kActTma, bool kQuantH, bool kPdl>
inline cudaError_t wg_set_attributes() {
  static bool attr_set = false;
  if (attr_set) return cudaSuccess;
  constexpr auto kernel = wg_gemm_kernel<kMaxN, kStageK, kActTma, kQuantH, kPdl>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, WgCfg<kMaxN, kStageK>::kSmem);
  if (err == cudaSuccess)  // all of the unified L1/shared storage as shared memory (kMinBlocks blocks must fit)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               int(cudaSharedmemCarveoutMaxShared));
  if (err == cudaSuccess) attr_set = true;
  return err;
}

// One instance's launch: with programmatic dependent launch (its kPdl instance, tiles 8 and 32 only: plan_pdl_launch)
// or normally.
template <int kMaxN, int kStageK, bool kActTma, bool kQuantH>
inline cudaError_t wg_launch(bool pdl, dim3 grid, cudaStream_t stream, const GroupedGemmCommon& c,
                             const WgMaps& maps) {
  using Cfg = WgCfg<kMaxN, kStageK>;
  if constexpr (kMaxN <= kTile32) {
    if (pdl) {
      const cudaError_t err = wg_set_attributes<kMaxN, kStageK, kActTma, kQuantH, true>();
      if (err != cudaSuccess) return err;
      return pdl_launch(wg_gemm_kernel<kMaxN, kStageK, kActTma, kQuantH, true>, grid, Cfg::kThreads, Cfg::kSmem,
                        stream, c, maps);
    }
  }
  const cudaError_t err = wg_set_attributes<kMaxN, kStageK, kActTma, kQuantH, false>();
  if (err != cudaSuccess) return err;
  wg_gemm_kernel<kMaxN, kStageK, kActTma, kQuantH, false><<<grid, Cfg::kThreads, Cfg::kSmem, stream>>>(c, maps);
  return cudaGetLastError();
}

template <int kMaxN, int kStageK>
inline cudaError_t launch_wg_gemm_k(const WgmmaGemmArgs& a, cudaStream_t stream) {
  const bool act_tma = a.act_tma;
  // copied rows run the tile's smallest K per stage (tile 64: K 128, tile 128: K 64; plan_stage_k)
  constexpr bool kTmaOnly = kStageK != wg_min_stage_k(kMaxN);
  // instantiated with TMA rows only (W4A4's gemm1 input is staged per slot; wgmma_gemm_args_error), and not in tile 8
  // (plan_tile8 is asked without it)
  constexpr bool kQuantOk = kMaxN != kTile8;
  const bool quant = a.h_quant_gs != nullptr;
  if (!kQuantOk && quant) return cudaErrorInvalidValue;
  WgMaps maps{};
  const cudaError_t err = wg_encode_maps<kMaxN, kStageK>(a, maps);
  if (err != cudaSuccess) return err;
  // Upper bound of token tiles over all experts: sum ceil(t_e / kMaxN) <= rows / kMaxN + active experts (at most
  // 65535: wgmma_gemm_args_error); one token's slots (slot_experts): one block row each.
  const bool slots = a.slot_experts != nullptr;
  if (slots && kMaxN > kTile32) return cudaErrorInvalidValue;  // (refused by the rules)
  const int64_t tiles = slots ? a.grid_experts : (a.max_total_rows + kMaxN - 1) / kMaxN + a.grid_experts;
  // Row blocks in pairs where the kernel can (wg_items; quant runs the kActTma kernel) and the plan pairs them: the
  // kernel reads the pairing off gridDim.x (wg_block_items).
  const int sm = sm_count();
  const int64_t tiles_bound = wg_tiles_bound(kMaxN, a.max_total_rows, a.grid_experts);
  const int row_blocks = wg_row_blocks<kMaxN>(a);
  const bool pair = wg_items<kMaxN, kStageK>(a.K, act_tma, quant) == 2 &&
                    plan_pair_row_blocks(kMaxN, row_blocks, tiles_bound, sm);
  const unsigned gx = unsigned(pair ? (row_blocks + 1) / 2 : row_blocks);
  const dim3 grid(gx, unsigned(tiles));
  const GroupedGemmCommon& c = a;  // what the kernel reads (the rest of WgmmaGemmArgs chose it and its grid)
  // the slots are read by the kPdl instances only (tiles 8 and 32: wgmma_gemm_args_error)
  const bool pdl = slots || plan_pdl_launch(kMaxN, tiles_bound * gx, sm);
  if (quant) {
    if constexpr (kQuantOk) return wg_launch<kMaxN, kStageK, true, true>(pdl, grid, stream, c, maps);
  } else if (act_tma) {
    return wg_launch<kMaxN, kStageK, true, false>(pdl, grid, stream, c, maps);
  } else if constexpr (!kTmaOnly) {
    return wg_launch<kMaxN, kStageK, false, false>(pdl, grid, stream, c, maps);
  }
  return cudaErrorInvalidValue;  // (not reached: the rules above and the plan leave no other case)
}

// The instance of the arguments' stage K (plan_stage_k): tile 128 steps K by 128 (4 stages) when K allows it and the
// activation rows come by TMA, else by 64 (8 stages: the copied-rows loop of K 128 spills); tile 64 likewise by 256
// (3 stages) or 128 (6 stages); tiles 32 and 8 by 256.
template <int kMaxN>
inline cudaError_t launch_wg_gemm(const WgmmaGemmArgs& a, cudaStream_t stream) {
  constexpr int kStageK = wg_stage_k(kMaxN), kMinStageK = wg_min_stage_k(kMaxN);
  if constexpr (kMinStageK != kStageK) {
    if (a.stage_k != kStageK) return launch_wg_gemm_k<kMaxN, kMinStageK>(a, stream);
  }
  return launch_wg_gemm_k<kMaxN, kStageK>(a, stream);
}

cudaError_t launch_wgmma_gemm(const WgmmaGemmArgs& a, cudaStream_t stream) {
  // the binding checked the rules with their messages (K a multiple of the stage K, stage K and TMA rows the plan's,
  // E <= 1024, scale rows of 16-byte multiples, aligned weights): under them every case below has its instantiation
  if (wgmma_gemm_args_error(a)) return cudaErrorInvalidValue;
  switch (a.tile) {
    case kTile32: {
      // a small grid on one-token blocks (plan_tile8; they have no quantizing epilogue)
      const int64_t e = a.grid_experts, rows = a.max_total_rows;
      if (!a.h_quant_gs && plan_tile8(wg_tiles_bound(kTile8, rows, e) * wg_row_blocks<kTile8>(a),
                                      wg_tiles_bound(kTile32, rows, e) * wg_row_blocks<kTile32>(a), sm_count()))
        return launch_wg_gemm<kTile8>(a, stream);
      return launch_wg_gemm<kTile32>(a, stream);
    }
    case kTile64: return launch_wg_gemm<kTile64>(a, stream);
    case kTile128: return launch_wg_gemm<kTile128>(a, stream);
    default: return cudaErrorInvalidValue;  // (refused by the rules above)
  }
}

}  // namespace megamoe::sm90
