// NVFP4 x NVFP4 -> fp32 grouped GEMM for the MoE experts on Blackwell (sm_100a),
// through CUTLASS's block-scaled ptr-array grouped kernel.
//
// Two kernel configurations (compile time: this TU is the costliest of the build),
// alike but for the N tile: 1-SM tcgen05 MMA, tile 128xNx256 with N = 128 (the default)
// or N = 64 (small M: twice the CTAs when the N = 128 grid cannot fill the GPU, see
// select_tile_n), cluster 1x1, per-group alpha through a pointer array, no source C, fp32
// output. Both read the same per-group arrays. See sm100_moe_groups.hpp for what a group
// is and where its operands live.
//
// Why fp32 and not bf16 output: GEMM 1's output is re-quantized to NVFP4 after
// SwiGLU. Rounding it to bf16 first moves values across e2m1 rounding
// boundaries; emulated on the CPU (tests/test_sm100_host.py), the MoE then
// matches the torch reference with cosine 0.99977 (below the 0.9999 of the
// moe_vs_reference health check), with fp32 output to 1 - 1e-14.
#include "megamoe/sm100_grouped_gemm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>

#include <cub/block/block_scan.cuh>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace megamoe::sm100 {
namespace {

using namespace cute;

using UnderlyingShape = Shape<int, int, int>;  // (M, N, K) of one group
using ProblemShape = cutlass::gemm::GroupProblemShape<UnderlyingShape>;

using ElementA = cutlass::nv_float4_t<cutlass::float_e2m1_t>;  // activations [M, K], K-major
using ElementB = cutlass::nv_float4_t<cutlass::float_e2m1_t>;  // weights [N, K], K-major
using ElementD = float;
using ElementAccumulator = float;
using LayoutA = cutlass::layout::RowMajor;
using LayoutB = cutlass::layout::ColumnMajor;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignmentA = 32;  // 16 bytes of fp4: TMA needs 16-byte aligned rows
constexpr int kAlignmentB = 32;
constexpr int kAlignmentD = 4;   // 16 bytes of fp32

using ClusterShape = Shape<_1, _1, _1>;
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmNvf4Sm100;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm;
constexpr char const* kScheduleName = "KernelPtrArrayTmaWarpSpecialized1SmNvf4Sm100 + PtrArrayTmaWarpSpecialized1Sm";

template <int TileN>
struct KernelConfig {
  using MmaTileShape = Shape<_128, Int<TileN>, _256>;
  // ElementC = void: D = alpha * acc, no source read.
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, MmaTileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator, void, LayoutD*,
      kAlignmentD, ElementD, LayoutD*, kAlignmentD, EpilogueSchedule>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, ElementA, LayoutA*, kAlignmentA, ElementB,
      LayoutB*, kAlignmentB, ElementAccumulator, MmaTileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};
using WideConfig = KernelConfig<128>;
using NarrowConfig = KernelConfig<64>;

// The per-group array types come from the wide configuration; the narrow one must read the same arrays.
using GemmKernel = typename WideConfig::GemmKernel;
using CollectiveMainloop = typename WideConfig::CollectiveMainloop;
using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideD = typename GemmKernel::InternalStrideD;
using LayoutSFA = typename CollectiveMainloop::InternalLayoutSFA;
using LayoutSFB = typename CollectiveMainloop::InternalLayoutSFB;
using BlockScaledConfig = typename CollectiveMainloop::Sm1xxBlkScaledConfig;
using ArrayElementA = typename CollectiveMainloop::ArrayElementA;
using ArrayElementB = typename CollectiveMainloop::ArrayElementB;
using ElementSF = typename CollectiveMainloop::ElementSF;

template <class Config>
constexpr bool kSameArrays =
    std::is_same_v<typename Config::GemmKernel::InternalStrideA, StrideA> &&
    std::is_same_v<typename Config::GemmKernel::InternalStrideB, StrideB> &&
    std::is_same_v<typename Config::GemmKernel::InternalStrideD, StrideD> &&
    std::is_same_v<typename Config::CollectiveMainloop::InternalLayoutSFA, LayoutSFA> &&
    std::is_same_v<typename Config::CollectiveMainloop::InternalLayoutSFB, LayoutSFB> &&
    std::is_same_v<typename Config::CollectiveMainloop::ElementSF, ElementSF> &&
    std::is_same_v<typename Config::CollectiveMainloop::ArrayElementA, ArrayElementA> &&
    std::is_same_v<typename Config::CollectiveMainloop::ArrayElementB, ArrayElementB>;
static_assert(kSameArrays<NarrowConfig>, "both tile configurations read one set of per-group arrays");

static_assert(BlockScaledConfig::SFVecSize == megamoe::kSfVec, "NVFP4 scales cover 16 elements");
constexpr int kSfVecSize = int(megamoe::kSfVec);
static_assert(sizeof(ElementSF) == 1, "e4m3 scales are one byte");
static_assert(sizeof(ElementD) == kOutputElementBytes, "sm100_moe_groups.hpp documents the output element");

// Typed views of the per-group arrays inside one device (or host) buffer.
struct GroupArrays {
  UnderlyingShape* problem_shapes;
  ArrayElementA const** ptr_a;
  ArrayElementB const** ptr_b;
  ElementSF const** ptr_sfa;
  ElementSF const** ptr_sfb;
  ElementD** ptr_d;
  float* alpha;
  float const** ptr_alpha;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
};

// Base addresses of the operands (integers so the host planner can use base 0
// and read the pointer arrays back as byte offsets).
struct OperandBases {
  uintptr_t a, a_sf, b, b_sf, d;
};

constexpr int64_t kArgsSectionAlign = 256;

ArgsLayout make_args_layout(int groups) {
  ArgsLayout out;
  int64_t cursor = 0;
  auto section = [&](int64_t& field, size_t element_bytes) {
    field = cursor;
    cursor = round_up_i64(cursor + int64_t(element_bytes) * groups, kArgsSectionAlign);
  };
  section(out.problem_shapes, sizeof(UnderlyingShape));
  section(out.ptr_a, sizeof(void*));
  section(out.ptr_b, sizeof(void*));
  section(out.ptr_sfa, sizeof(void*));
  section(out.ptr_sfb, sizeof(void*));
  section(out.ptr_d, sizeof(void*));
  section(out.alpha, sizeof(float));
  section(out.ptr_alpha, sizeof(void*));
  section(out.stride_a, sizeof(StrideA));
  section(out.stride_b, sizeof(StrideB));
  section(out.stride_d, sizeof(StrideD));
  section(out.layout_sfa, sizeof(LayoutSFA));
  section(out.layout_sfb, sizeof(LayoutSFB));
  out.total_bytes = cursor;
  return out;
}

GroupArrays view_group_arrays(void* buffer, ArgsLayout const& layout) {
  auto at = [&](int64_t offset) { return static_cast<void*>(static_cast<char*>(buffer) + offset); };
  GroupArrays out;
  out.problem_shapes = static_cast<UnderlyingShape*>(at(layout.problem_shapes));
  out.ptr_a = static_cast<ArrayElementA const**>(at(layout.ptr_a));
  out.ptr_b = static_cast<ArrayElementB const**>(at(layout.ptr_b));
  out.ptr_sfa = static_cast<ElementSF const**>(at(layout.ptr_sfa));
  out.ptr_sfb = static_cast<ElementSF const**>(at(layout.ptr_sfb));
  out.ptr_d = static_cast<ElementD**>(at(layout.ptr_d));
  out.alpha = static_cast<float*>(at(layout.alpha));
  out.ptr_alpha = static_cast<float const**>(at(layout.ptr_alpha));
  out.stride_a = static_cast<StrideA*>(at(layout.stride_a));
  out.stride_b = static_cast<StrideB*>(at(layout.stride_b));
  out.stride_d = static_cast<StrideD*>(at(layout.stride_d));
  out.layout_sfa = static_cast<LayoutSFA*>(at(layout.layout_sfa));
  out.layout_sfb = static_cast<LayoutSFB*>(at(layout.layout_sfb));
  return out;
}

// The SF layouts CUTLASS reads, for an (m, n, k) problem. The one constructor
// used by the planner, the device argument builder and sf_layout_offsets.
CUTLASS_HOST_DEVICE LayoutSFA make_layout_sfa(int m, int n, int k) {
  return BlockScaledConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
}
CUTLASS_HOST_DEVICE LayoutSFB make_layout_sfb(int m, int n, int k) {
  return BlockScaledConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
}

// Fills group g of the arrays; the same code runs on the host (planner) and on the device (launch).
CUTLASS_HOST_DEVICE void fill_group(MoeGemmGeometry const& geo, OperandBases const& bases, int32_t tokens,
                                    ExpertOffsets const& offsets, float const* a_global_scale,
                                    float const* b_global_scale, int g, GroupArrays const& out) {
  GroupGeometry const gg = group_geometry(geo, tokens, offsets, g);
  out.problem_shapes[g] = UnderlyingShape{gg.m, gg.n, gg.k};
  out.ptr_a[g] = reinterpret_cast<ArrayElementA const*>(bases.a + uintptr_t(gg.a_offset_bytes));
  out.ptr_b[g] = reinterpret_cast<ArrayElementB const*>(bases.b + uintptr_t(gg.b_offset_bytes));
  out.ptr_sfa[g] = reinterpret_cast<ElementSF const*>(bases.a_sf + uintptr_t(gg.sfa_offset_bytes));
  out.ptr_sfb[g] = reinterpret_cast<ElementSF const*>(bases.b_sf + uintptr_t(gg.sfb_offset_bytes));
  out.ptr_d[g] = reinterpret_cast<ElementD*>(bases.d + uintptr_t(gg.d_offset_elems) * sizeof(ElementD));
  out.alpha[g] = group_alpha(gg, a_global_scale, b_global_scale);
  out.ptr_alpha[g] = out.alpha + g;
  // Strides and SF layouts use the real extents even for an empty expert (its
  // problem shape is (0,0,0), so CUTLASS never reads them).
  int const m = gg.tokens > 0 ? gg.tokens : 0;
  out.stride_a[g] = cutlass::make_cute_packed_stride(StrideA{}, make_shape(m, geo.k, 1));
  out.stride_b[g] = cutlass::make_cute_packed_stride(StrideB{}, make_shape(geo.n_part, geo.k, 1));
  StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, make_shape(m, geo.n_part, 1));
  get<0>(stride_d) = gg.ldd;  // gate and up share D's rows: the row stride is parts * n_part
  out.stride_d[g] = stride_d;
  out.layout_sfa[g] = make_layout_sfa(m, geo.n_part, geo.k);
  out.layout_sfb[g] = make_layout_sfb(m, geo.n_part, geo.k);
}

// One block: thread i takes expert chunk + i; a block scan gives every expert its two row
// offsets (compact A/D rows, 128-aligned SFA rows), each count is read once, and a running
// carry crosses chunks. The same offsets as expert_offsets() on the host (exact integer sums).
constexpr int kBuilderThreads = 256;

__global__ void __launch_bounds__(kBuilderThreads)
build_group_arrays_kernel(MoeGemmGeometry geo, OperandBases bases, int32_t const* token_counts,
                          float const* a_global_scale, float const* b_global_scale, GroupArrays out) {
  using Scan = cub::BlockScan<long long, kBuilderThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ long long carry_row, carry_sf;
  if (threadIdx.x == 0) {
    carry_row = 0;
    carry_sf = 0;
  }
  __syncthreads();
  for (int chunk = 0; chunk < geo.num_experts; chunk += kBuilderThreads) {
    int const e = chunk + int(threadIdx.x);
    int32_t const tokens = e < geo.num_experts ? token_counts[e] : 0;
    long long row = 0, sf = 0, row_total = 0, sf_total = 0;
    Scan(scan_storage).ExclusiveSum((long long)expert_rows(tokens), row, row_total);
    __syncthreads();  // scan_storage is reused
    Scan(scan_storage).ExclusiveSum((long long)expert_sf_rows(tokens), sf, sf_total);
    ExpertOffsets const offsets{carry_row + row, carry_sf + sf};
    if (e < geo.num_experts) {
      for (int part = 0; part < geo.parts; ++part) {
        fill_group(geo, bases, tokens, offsets, a_global_scale, b_global_scale, e * geo.parts + part, out);
      }
    }
    __syncthreads();  // every thread has read the carries
    if (threadIdx.x == 0) {
      carry_row += row_total;
      carry_sf += sf_total;
    }
    __syncthreads();
  }
}

template <class Gemm>
typename Gemm::Arguments make_gemm_arguments(int groups, GroupArrays const& arrays,
                                             UnderlyingShape const* host_problem_shapes, int sm_count,
                                             int device_id) {
  decltype(typename Gemm::Arguments{}.epilogue.thread) fusion{};
  fusion.alpha = 0.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = arrays.ptr_alpha;  // one alpha per group: alpha_ptr_array[group]
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, 1};

  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device_id;
  hw_info.sm_count = sm_count;

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, arrays.problem_shapes, host_problem_shapes},
      {arrays.ptr_a, arrays.stride_a, arrays.ptr_b, arrays.stride_b, arrays.ptr_sfa, arrays.layout_sfa,
       arrays.ptr_sfb, arrays.layout_sfb},
      {fusion, nullptr, nullptr, arrays.ptr_d, arrays.stride_d},
      hw_info};
  return args;
}

std::vector<std::string> check_geometry(MoeGemmGeometry const& geo) {
  std::vector<std::string> problems;
  auto add = [&](std::string const& what) { problems.push_back(what); };
  if (geo.num_experts <= 0) add("num_experts must be positive, got " + std::to_string(geo.num_experts));
  if (geo.parts != 1 && geo.parts != 2) add("parts must be 1 or 2, got " + std::to_string(geo.parts));
  if (geo.n_part <= 0) add("n_part must be positive, got " + std::to_string(geo.n_part));
  if (geo.k <= 0 || geo.k % kAlignmentA != 0) {
    add("k = " + std::to_string(geo.k) + " must be a positive multiple of " + std::to_string(kAlignmentA) +
        " (16-byte fp4 rows for TMA); pad K with zero codes and zero scales");
  }
  if (geo.n_part % kAlignmentD != 0) {
    add("n_part = " + std::to_string(geo.n_part) + " must be a multiple of " + std::to_string(kAlignmentD) +
        " (16-byte output rows and part offsets for TMA)");
  }
  if (geo.tile_n != kWideTileN && geo.tile_n != kNarrowTileN) {
    add("tile_n must be " + std::to_string(kWideTileN) + " or " + std::to_string(kNarrowTileN) + ", got " +
        std::to_string(geo.tile_n));
  }
  if (geo.a_scale_count != 1 && geo.a_scale_count != geo.num_experts) {
    add("a_scale_count must be 1 or num_experts, got " + std::to_string(geo.a_scale_count));
  }
  return problems;
}

template <class Stride>
std::vector<int64_t> flatten_stride(Stride const& stride) {
  std::vector<int64_t> out;
  for_each(flatten(stride), [&](auto s) { out.push_back(int64_t(s)); });
  return out;
}

// A CuTe integer tuple as CuTe prints it ("_4" for a static 4, "(a,b)" for a tuple), written
// without iostreams: the plan runs in a process whose CUDA context and C++ locale are set up by
// torch, where formatting a number through an ostream of this library crashed (SIGSEGV in
// num_put, seen on an H100 once the context existed).
template <class T>
void append_int_tuple(std::string& s, T const& t) {
  if constexpr (cute::is_tuple<T>::value) {
    s += '(';
    int i = 0;
    cute::for_each(t, [&](auto const& e) {
      if (i++) s += ',';
      append_int_tuple(s, e);
    });
    s += ')';
  } else if constexpr (cute::is_static<T>::value) {
    s += '_';
    s += std::to_string(int64_t(T::value));
  } else {
    s += std::to_string(int64_t(t));
  }
}

template <class Layout>
std::string layout_string(Layout const& layout) {
  std::string s;
  append_int_tuple(s, shape(layout));
  s += ':';
  append_int_tuple(s, stride(layout));
  return s;
}

template <class Layout>
std::vector<SfSample> sample_sf_layout(Layout const& layout, int rows, int k) {
  int const kb_count = k / kSfVecSize;
  std::set<int> ms = {0, 1, 2, 7, 31, 32, 33, 63, 64, 95, 96, 127, 128, 129, 255, 256, 257, rows - 2, rows - 1};
  std::set<int> kbs = {0, 1, 2, 3, 4, 5, 7, 8, kb_count - 2, kb_count - 1};
  std::vector<SfSample> out;
  for (int m : ms) {
    if (m < 0 || m >= rows) continue;
    for (int kb : kbs) {
      if (kb < 0 || kb >= kb_count) continue;
      out.push_back({m, kb, int64_t(layout(make_coord(m, kb * kSfVecSize, 0)))});
    }
  }
  return out;
}

// Scales (m, kb) of a [rows, k/16] matrix whose offset in `layout` differs from the docs/SPEC.md §2
// closed form (megamoe::sf_offset, the one compiled into every kernel). Every (m, kb) is visited.
template <class Layout>
int64_t count_sf_mismatches(Layout const& layout, int rows, int k) {
  int const kb_count = k / kSfVecSize;
  int64_t const kt = megamoe::sf_padded_cols(kb_count) / megamoe::kSfTileCols;
  int64_t bad = 0;
  for (int m = 0; m < rows; ++m) {
    for (int kb = 0; kb < kb_count; ++kb) {
      bad += int64_t(layout(make_coord(m, kb * kSfVecSize, 0))) != megamoe::sf_offset(m, kb, kt);
    }
  }
  return bad;
}

std::string status_string(cutlass::Status status) { return cutlass::cutlassGetStatusString(status); }

}  // namespace

template <class Config>
KernelInfo kernel_info_of() {
  using MmaTileShape = typename Config::MmaTileShape;
  KernelInfo info;
  info.tile_m = size<0>(MmaTileShape{});
  info.tile_n = size<1>(MmaTileShape{});
  info.tile_k = size<2>(MmaTileShape{});
  info.cluster_m = size<0>(ClusterShape{});
  info.cluster_n = size<1>(ClusterShape{});
  info.stages = Config::CollectiveMainloop::DispatchPolicy::Stages;
  info.shared_storage_bytes = Config::GemmKernel::SharedStorageSize;
  info.smem_capacity_bytes = cutlass::arch::sm100_smem_capacity_bytes;
  info.threads_per_cta = int(Config::GemmKernel::MaxThreadsPerBlock);
  info.alignment_a_elems = kAlignmentA;
  info.alignment_b_elems = kAlignmentB;
  info.alignment_d_elems = kAlignmentD;
  info.sf_vec_size = BlockScaledConfig::SFVecSize;
  info.schedule = kScheduleName;
  info.element_a = "nv_float4_t<float_e2m1_t>";
  info.element_b = "nv_float4_t<float_e2m1_t>";
  info.element_sf = "float_ue4m3_t";
  info.element_d = "float";
  info.element_d_bytes = int(sizeof(ElementD));
  return info;
}

// Calls f(Config{}) with the configuration of tile_n (64 or 128).
template <class F>
decltype(auto) with_config(int tile_n, F&& f) {
  if (tile_n == 64) return f(NarrowConfig{});
  if (tile_n == 128) return f(WideConfig{});
  throw std::invalid_argument("sm100: tile_n must be 64 or 128, got " + std::to_string(tile_n));
}

KernelInfo kernel_info(int tile_n) {
  return with_config(tile_n, [](auto config) { return kernel_info_of<decltype(config)>(); });
}

int select_tile_n(int64_t pairs, int num_experts, int parts, int n_part, int sm_count) {
  if (pairs <= 0 || num_experts <= 0 || parts <= 0 || n_part <= 0 || sm_count <= 0) return kWideTileN;
  // At most min(E, pairs) experts have tokens, and all of them together hold at most
  // pairs / 128 further full 128-row tiles: a bound on the wide grid's M tiles.
  int64_t const m_tiles = std::min<int64_t>(num_experts, pairs) + pairs / kExpertRowAlign;
  int64_t const wide_ctas = m_tiles * parts * ((n_part + kWideTileN - 1) / kWideTileN);
  return wide_ctas < sm_count ? kNarrowTileN : kWideTileN;
}

ArgsLayout args_layout(int groups) { return make_args_layout(groups); }

int64_t workspace_bytes(int groups, int sm_count) {
  // The launch passes no host problem shapes, so size the workspace the same way; one
  // buffer serves either tile configuration (the larger of the two).
  std::vector<char> host_arrays(size_t(make_args_layout(groups).total_bytes));
  GroupArrays arrays = view_group_arrays(host_arrays.data(), make_args_layout(groups));
  auto const of = [&](auto config) {
    using Gemm = typename decltype(config)::Gemm;
    return int64_t(Gemm::get_workspace_size(make_gemm_arguments<Gemm>(groups, arrays, nullptr, sm_count, 0)));
  };
  return std::max(of(WideConfig{}), of(NarrowConfig{}));
}

std::vector<int64_t> sf_layout_offsets(int rows, int k, char which) {
  if (rows < 0 || k <= 0 || k % kSfVecSize != 0) {
    throw std::invalid_argument("sf_layout_offsets: need rows >= 0 and k a positive multiple of 16, got rows=" +
                                std::to_string(rows) + " k=" + std::to_string(k));
  }
  if (which != 'A' && which != 'B') {
    throw std::invalid_argument(std::string("sf_layout_offsets: operand must be 'A' or 'B', got '") + which + "'");
  }
  int const kb_count = k / kSfVecSize;
  std::vector<int64_t> out;
  out.reserve(size_t(rows) * kb_count);
  auto fill = [&](auto const& layout) {
    for (int m = 0; m < rows; ++m) {
      for (int kb = 0; kb < kb_count; ++kb) {
        out.push_back(int64_t(layout(make_coord(m, kb * kSfVecSize, 0))));
      }
    }
  };
  if (which == 'A') {
    fill(make_layout_sfa(rows, 1, k));
  } else {
    fill(make_layout_sfb(1, rows, k));
  }
  return out;
}

MoeGemmPlan plan_moe_gemm(MoeGemmGeometry const& geo, std::vector<int32_t> const& token_counts,
                          std::vector<float> const& a_global_scale, std::vector<float> const& b_global_scale,
                          int sm_count) {
  MoeGemmPlan plan;
  plan.geo = geo;
  plan.sm_count = sm_count;
  plan.problems = check_geometry(geo);
  // Problems that leave nothing to plan raise; alignment problems are reported (and make can_implement false).
  if (geo.num_experts <= 0 || (geo.parts != 1 && geo.parts != 2) || geo.n_part <= 0 || geo.k <= 0 ||
      geo.k % kSfVecSize != 0 || (geo.a_scale_count != 1 && geo.a_scale_count != geo.num_experts)) {
    std::string all;
    for (auto const& p : plan.problems) all += (all.empty() ? "" : "; ") + p;
    if (geo.k % kSfVecSize != 0) all += (all.empty() ? "" : "; ") + std::string("k must be a multiple of 16");
    throw std::invalid_argument("plan_moe_gemm: " + all);
  }
  if (int(token_counts.size()) != geo.num_experts) {
    throw std::invalid_argument("plan_moe_gemm: token_counts has " + std::to_string(token_counts.size()) +
                                " entries, num_experts = " + std::to_string(geo.num_experts));
  }
  if (int(a_global_scale.size()) != geo.a_scale_count) {
    throw std::invalid_argument("plan_moe_gemm: a_global_scale has " + std::to_string(a_global_scale.size()) +
                                " entries, a_scale_count = " + std::to_string(geo.a_scale_count));
  }
  int const groups = num_groups(geo);
  if (int(b_global_scale.size()) != groups) {
    throw std::invalid_argument("plan_moe_gemm: b_global_scale has " + std::to_string(b_global_scale.size()) +
                                " entries, num_experts * parts = " + std::to_string(groups));
  }
  if (sm_count <= 0) {
    throw std::invalid_argument("plan_moe_gemm: sm_count must be positive, got " + std::to_string(sm_count));
  }
  for (int32_t c : token_counts) {
    if (c < 0) throw std::invalid_argument("plan_moe_gemm: negative token count " + std::to_string(c));
  }

  plan.args = make_args_layout(groups);
  std::vector<char> host_arrays(size_t(plan.args.total_bytes));
  GroupArrays arrays = view_group_arrays(host_arrays.data(), plan.args);
  OperandBases const zero_bases{0, 0, 0, 0, 0};
  std::vector<ExpertOffsets> offsets(size_t(geo.num_experts) + 1);
  expert_offsets(token_counts.data(), geo.num_experts, offsets.data());
  for (int g = 0; g < groups; ++g) {
    int const e = g / geo.parts;
    fill_group(geo, zero_bases, token_counts[e], offsets[e], a_global_scale.data(), b_global_scale.data(), g,
               arrays);
  }

  plan.total_rows = offsets[geo.num_experts].row;
  plan.sf_rows = offsets[geo.num_experts].sf_row;
  plan.a_bytes = plan.total_rows * (geo.k / 2);
  plan.sfa_bytes = megamoe::sf_padded_bytes(plan.sf_rows, geo.k / kSfVecSize);
  plan.b_bytes = int64_t(groups) * geo.n_part * (geo.k / 2);
  plan.sfb_bytes = int64_t(groups) * megamoe::sf_padded_bytes(geo.n_part, geo.k / kSfVecSize);
  plan.d_elems = plan.total_rows * geo.parts * geo.n_part;

  std::map<int, int64_t> sfa_checked;
  int64_t sfb_mismatches = -1;
  for (int g = 0; g < groups; ++g) {
    GroupPlan gp;
    gp.geo = group_geometry(geo, token_counts[g / geo.parts], offsets[g / geo.parts], g);
    gp.alpha = arrays.alpha[g];
    gp.stride_a = flatten_stride(arrays.stride_a[g]);
    gp.stride_b = flatten_stride(arrays.stride_b[g]);
    gp.stride_d = flatten_stride(arrays.stride_d[g]);
    LayoutSFA const& sfa = arrays.layout_sfa[g];
    LayoutSFB const& sfb = arrays.layout_sfb[g];
    gp.layout_sfa = layout_string(sfa);
    gp.layout_sfb = layout_string(sfb);
    gp.sfa_bytes = int64_t(size(filter_zeros(sfa)));
    gp.sfb_bytes = int64_t(size(filter_zeros(sfb)));
    gp.sfa_cosize = int64_t(cosize(sfa));
    gp.sfb_cosize = int64_t(cosize(sfb));
    gp.sfa_samples = sample_sf_layout(sfa, gp.geo.tokens, geo.k);
    gp.sfb_samples = sample_sf_layout(sfb, geo.n_part, geo.k);
    // Layouts depend only on (rows, k): count each distinct one once.
    auto const sfa_key = gp.geo.tokens;
    if (sfa_checked.count(sfa_key) == 0) sfa_checked[sfa_key] = count_sf_mismatches(sfa, gp.geo.tokens, geo.k);
    if (sfb_mismatches < 0) sfb_mismatches = count_sf_mismatches(sfb, geo.n_part, geo.k);
    gp.sfa_mismatches = sfa_checked[sfa_key];
    gp.sfb_mismatches = sfb_mismatches;
    gp.ptr_a = uint64_t(reinterpret_cast<uintptr_t>(arrays.ptr_a[g]));
    gp.ptr_b = uint64_t(reinterpret_cast<uintptr_t>(arrays.ptr_b[g]));
    gp.ptr_sfa = uint64_t(reinterpret_cast<uintptr_t>(arrays.ptr_sfa[g]));
    gp.ptr_sfb = uint64_t(reinterpret_cast<uintptr_t>(arrays.ptr_sfb[g]));
    gp.ptr_d = uint64_t(reinterpret_cast<uintptr_t>(arrays.ptr_d[g]));
    gp.ptr_alpha_index = int64_t(arrays.ptr_alpha[g] - arrays.alpha);
    UnderlyingShape const one_shape = arrays.problem_shapes[g];
    GroupArrays one = arrays;  // the same arrays, seen from group g on
    one.problem_shapes += g;
    gp.can_implement =
        with_config(geo.tile_n, [&](auto config) {
          using Gemm = typename decltype(config)::Gemm;
          return Gemm::can_implement(make_gemm_arguments<Gemm>(1, one, &one_shape, sm_count, 0));
        }) == cutlass::Status::kSuccess;
    plan.groups.push_back(std::move(gp));
  }

  std::vector<UnderlyingShape> host_shapes(arrays.problem_shapes, arrays.problem_shapes + groups);
  cutlass::Status status = cutlass::Status::kSuccess;
  with_config(geo.tile_n, [&](auto config) {
    using Gemm = typename decltype(config)::Gemm;
    auto const args = make_gemm_arguments<Gemm>(groups, arrays, host_shapes.data(), sm_count, 0);
    status = Gemm::can_implement(args);
    plan.workspace_bytes_host_shapes = int64_t(Gemm::get_workspace_size(args));
    return 0;
  });
  plan.can_implement = status == cutlass::Status::kSuccess && plan.problems.empty();
  plan.can_implement_status = status_string(status);
  plan.workspace_bytes = workspace_bytes(groups, sm_count);
  return plan;
}

std::vector<uint8_t> host_args_bytes(MoeGemmGeometry const& geo, std::vector<int32_t> const& token_counts,
                                     std::vector<float> const& a_global_scale,
                                     std::vector<float> const& b_global_scale, OperandAddresses const& bases,
                                     uint64_t args_base, uint8_t fill) {
  std::vector<std::string> const problems = check_geometry(geo);
  if (!problems.empty()) throw std::invalid_argument("host_args_bytes: " + problems.front());
  int const groups = num_groups(geo);
  if (int(token_counts.size()) != geo.num_experts || int(a_global_scale.size()) != geo.a_scale_count ||
      int(b_global_scale.size()) != groups) {
    throw std::invalid_argument("host_args_bytes: need num_experts token counts, a_scale_count activation scales "
                                "and num_experts * parts weight scales");
  }
  ArgsLayout const layout = make_args_layout(groups);
  std::vector<uint8_t> buffer(size_t(layout.total_bytes), fill);
  GroupArrays const arrays = view_group_arrays(buffer.data(), layout);
  OperandBases const operand_bases{uintptr_t(bases.a), uintptr_t(bases.a_sf), uintptr_t(bases.b),
                                   uintptr_t(bases.b_sf), uintptr_t(bases.d)};
  std::vector<ExpertOffsets> offsets(size_t(geo.num_experts) + 1);
  expert_offsets(token_counts.data(), geo.num_experts, offsets.data());
  for (int g = 0; g < groups; ++g) {
    int const e = g / geo.parts;
    fill_group(geo, operand_bases, token_counts[e], offsets[e], a_global_scale.data(), b_global_scale.data(), g,
               arrays);
    // ptr_alpha points into the args buffer itself: as the device sees it, at args_base
    uint64_t const alpha_address = args_base + uint64_t(layout.alpha) + uint64_t(g) * sizeof(float);
    std::memcpy(&arrays.ptr_alpha[g], &alpha_address, sizeof(alpha_address));
  }
  return buffer;
}

namespace {

// Initialized CUTLASS Gemm objects, kept per launch buffers. A Gemm's params depend only on
// the addresses of the per-group arrays (inside `args`), the workspace, the group count, the
// SM count and the device: operand addresses and problem shapes are read by the kernel from
// the arrays, which the argument builder refills on every launch. Every initialize_workspace
// of this configuration (mainloop, epilogue, group tile scheduler) is a no-op, so re-running
// an initialized Gemm is what initialize + run would do, minus the host work.
using GemmKey = std::tuple<int, uintptr_t, uintptr_t, int, int>;  // device, args, workspace, groups, sm_count
constexpr size_t kMaxCachedGemms = 64;

template <class Gemm>
struct GemmCache {
  std::mutex mutex;
  std::map<GemmKey, std::unique_ptr<Gemm>> gemms;
  std::deque<GemmKey> order;  // oldest first
};

template <class Gemm>
GemmCache<Gemm>& gemm_cache() {
  static GemmCache<Gemm> cache;
  return cache;
}

}  // namespace

int64_t cached_gemm_count() {
  auto const count = [](auto config) {
    auto& cache = gemm_cache<typename decltype(config)::Gemm>();
    std::lock_guard<std::mutex> lock(cache.mutex);
    return int64_t(cache.gemms.size());
  };
  return count(WideConfig{}) + count(NarrowConfig{});
}

void moe_gemm_run(MoeGemmGeometry const& geo, MoeGemmDevicePointers const& ptrs, int32_t const* host_token_counts,
                  int sm_count, void* stream_handle) {
  // Every check below is host-only and runs before anything reaches the device (no CUDA call,
  // no kernel launch), so bad arguments raise with nothing queued.
  std::vector<std::string> const problems = check_geometry(geo);
  if (!problems.empty()) throw std::invalid_argument("sm100 moe_gemm: " + problems.front());
  if (sm_count <= 0) {
    throw std::invalid_argument("sm100 moe_gemm: sm_count must be positive, got " + std::to_string(sm_count));
  }
  int const groups = num_groups(geo);
  std::vector<UnderlyingShape> host_shapes;
  if (host_token_counts != nullptr) {
    int64_t tiles = 0;
    std::vector<ExpertOffsets> offsets(size_t(geo.num_experts) + 1);
    expert_offsets(host_token_counts, geo.num_experts, offsets.data());
    for (int g = 0; g < groups; ++g) {
      GroupGeometry const gg = group_geometry(geo, host_token_counts[g / geo.parts], offsets[g / geo.parts], g);
      if (gg.tokens < 0) {
        throw std::invalid_argument("sm100 moe_gemm: negative token count " + std::to_string(gg.tokens) +
                                    " for expert " + std::to_string(gg.expert));
      }
      host_shapes.push_back(UnderlyingShape{gg.m, gg.n, gg.k});
      tiles += (gg.m > 0 && gg.n > 0 && gg.k > 0) ? 1 : 0;  // groups with at least one tile
    }
    // No tile anywhere: CUTLASS would compute a 0-block grid and report an internal error.
    // Nothing to write (D has no rows that belong to a group, its buffers may be empty and
    // their pointers null), so nothing is launched and the pointers are not looked at.
    if (tiles == 0) return;
  }
  auto check_aligned = [](void const* p, char const* name, uintptr_t alignment) {
    if (p == nullptr || reinterpret_cast<uintptr_t>(p) % alignment != 0) {
      char address[32];
      std::snprintf(address, sizeof(address), "%p", p);
      throw std::invalid_argument(std::string("sm100 moe_gemm: ") + name + " = " + address + " must be a non-null " +
                                  std::to_string(uint64_t(alignment)) + "-byte aligned device pointer");
    }
  };
  // TMA: 16-byte aligned operand and output bases (every group offset keeps that, see
  // check_geometry), 128-byte aligned scale-factor bases (every group's SF block starts on a
  // 512-byte scale atom from there), 64-byte aligned tensor maps in the workspace.
  check_aligned(ptrs.a, "a", 16);
  check_aligned(ptrs.a_sf, "a_sf", kSfAlignmentBytes);
  check_aligned(ptrs.b, "b", 16);
  check_aligned(ptrs.b_sf, "b_sf", kSfAlignmentBytes);
  check_aligned(ptrs.d, "d", 16);
  check_aligned(ptrs.args, "args", 16);
  check_aligned(ptrs.token_counts, "token_counts", 4);
  check_aligned(ptrs.a_global_scale, "a_global_scale", 4);
  check_aligned(ptrs.b_global_scale, "b_global_scale", 4);

  ArgsLayout const layout = make_args_layout(groups);
  if (ptrs.args_bytes < layout.total_bytes) {
    throw std::invalid_argument("sm100 moe_gemm: args buffer has " + std::to_string(ptrs.args_bytes) +
                                " bytes, needs " + std::to_string(layout.total_bytes));
  }

  GroupArrays const arrays = view_group_arrays(ptrs.args, layout);
  with_config(geo.tile_n, [&](auto config) {
    using Gemm = typename decltype(config)::Gemm;
    using Kernel = typename decltype(config)::GemmKernel;
    // The launch itself always reads the problem shapes from the device arrays, so one
    // initialized Gemm serves every launch on these buffers, host counts or not (no per-call
    // initialize, tensor-map setup or cudaFuncSetAttribute). Host counts only add checks.
    auto args = make_gemm_arguments<Gemm>(groups, arrays, nullptr, sm_count, /*device_id=*/0);
    cutlass::Status status = Gemm::can_implement(args);
    if (status == cutlass::Status::kSuccess && !host_shapes.empty()) {
      status = Gemm::can_implement(make_gemm_arguments<Gemm>(groups, arrays, host_shapes.data(), sm_count, 0));
    }
    if (status != cutlass::Status::kSuccess) {
      throw std::runtime_error("sm100 moe_gemm: CUTLASS can_implement: " + status_string(status));
    }
    int64_t const needed = int64_t(Gemm::get_workspace_size(args));
    if (needed > 0) {
      check_aligned(ptrs.workspace, "workspace", Kernel::MinTensorMapWorkspaceAlignment);
    }
    if (ptrs.workspace_bytes < needed) {
      throw std::invalid_argument("sm100 moe_gemm: workspace has " + std::to_string(ptrs.workspace_bytes) +
                                  " bytes, CUTLASS needs " + std::to_string(needed));
    }

    // The device from here on.
    cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
    int device_id = 0;
    if (cudaGetDevice(&device_id) != cudaSuccess) throw std::runtime_error("sm100 moe_gemm: cudaGetDevice failed");
    args.hw_info.device_id = device_id;

    OperandBases const bases{reinterpret_cast<uintptr_t>(ptrs.a), reinterpret_cast<uintptr_t>(ptrs.a_sf),
                             reinterpret_cast<uintptr_t>(ptrs.b), reinterpret_cast<uintptr_t>(ptrs.b_sf),
                             reinterpret_cast<uintptr_t>(ptrs.d)};
    build_group_arrays_kernel<<<1, kBuilderThreads, 0, stream>>>(geo, bases, ptrs.token_counts, ptrs.a_global_scale,
                                                                ptrs.b_global_scale, arrays);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("sm100 moe_gemm: argument builder launch failed: ") +
                               cudaGetErrorString(err));
    }

    {
      GemmCache<Gemm>& cache = gemm_cache<Gemm>();
      std::lock_guard<std::mutex> lock(cache.mutex);
      GemmKey const key{device_id, reinterpret_cast<uintptr_t>(ptrs.args), reinterpret_cast<uintptr_t>(ptrs.workspace),
                        groups, sm_count};
      auto it = cache.gemms.find(key);
      if (it == cache.gemms.end()) {
        auto gemm = std::make_unique<Gemm>();
        status = gemm->initialize(args, ptrs.workspace, stream);
        if (status != cutlass::Status::kSuccess) {
          throw std::runtime_error("sm100 moe_gemm: CUTLASS initialize: " + status_string(status));
        }
        if (cache.gemms.size() >= kMaxCachedGemms) {
          cache.gemms.erase(cache.order.front());
          cache.order.pop_front();
        }
        it = cache.gemms.emplace(key, std::move(gemm)).first;
        cache.order.push_back(key);
      }
      status = it->second->run(stream);
    }
    if (status != cutlass::Status::kSuccess) {
      throw std::runtime_error("sm100 moe_gemm: CUTLASS run: " + status_string(status));
    }
    err = cudaGetLastError();
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("sm100 moe_gemm: kernel launch failed: ") + cudaGetErrorString(err));
    }
    return 0;
  });
}

}  // namespace megamoe::sm100
