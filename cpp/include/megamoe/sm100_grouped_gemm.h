// Blackwell (sm_100a) NVFP4 x NVFP4 -> fp32 grouped GEMM for the MoE experts,
// through CUTLASS's block-scaled ptr-array grouped kernel.
//
// Plain C++ interface (no CUDA or CUTLASS headers) so that the nanobind layer
// (bind_sm100.cpp, a host .cpp) can include it. Implemented in
// cpp/sm100/grouped_gemm_nvfp4.cu, compiled for sm_100a only.
//
// Everything except moe_gemm_run is host-only and needs no GPU: the planner
// builds the same per-group CUTLASS arguments the device builds (shapes,
// strides, SF layouts, pointer offsets, alphas) and asks CUTLASS for
// can_implement and the workspace size, so it can be tested on the CPU.
// Layouts and offsets are described in sm100_moe_groups.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "megamoe/sm100_moe_groups.hpp"

namespace megamoe::sm100 {

// Scale-factor bases must be 128-byte aligned (TMA); every group's SF block then starts on a
// 512-byte scale atom (128 rows x 4 scale columns) from there.
constexpr int kSfAlignmentBytes = 128;

// B200 has 148 SMs. The planner needs an SM count for the workspace size
// (tensor-map workspace is per SM); the launcher gets the real one from the caller.
constexpr int kDefaultSmCount = 148;

// Compile-time facts about a kernel configuration (tile_n = 128 or 64).
struct KernelInfo {
  int tile_m = 0, tile_n = 0, tile_k = 0;
  int cluster_m = 0, cluster_n = 0;
  int stages = 0;
  int shared_storage_bytes = 0;  // dynamic shared memory per CTA
  int smem_capacity_bytes = 0;   // what an sm_100 CTA may use
  int threads_per_cta = 0;
  int alignment_a_elems = 0;  // fp4 elements: K must be a multiple of this
  int alignment_b_elems = 0;
  int alignment_d_elems = 0;  // output elements: N and ldd must be multiples of this
  int element_d_bytes = 0;
  int sf_vec_size = 0;
  std::string schedule;
  std::string element_a, element_b, element_sf, element_d;
};

KernelInfo kernel_info(int tile_n = kWideTileN);

// The N tile for a grouped GEMM of `pairs` routed (token, slot) rows over num_experts experts,
// chosen on the host from T * k alone (no token counts): 64 when even an upper bound of the
// 128-wide grid's CTAs, (min(E, pairs) + pairs / 128) * parts * ceil(n_part / 128), is below
// sm_count (the wide grid would leave SMs idle; the narrow one has twice the CTAs), else 128.
int select_tile_n(int64_t pairs, int num_experts, int parts, int n_part, int sm_count);

// One (m, kb) -> byte offset sample of a group's SF layout, as CuTe evaluates it.
struct SfSample {
  int m = 0;
  int kb = 0;
  int64_t offset = 0;
};

struct GroupPlan {
  GroupGeometry geo;
  float alpha = 0.0f;
  std::vector<int64_t> stride_a;  // CuTe (M, K, L) strides in elements as stored for CUTLASS
  std::vector<int64_t> stride_b;  // (N, K, L)
  std::vector<int64_t> stride_d;  // (M, N, L)
  std::string layout_sfa;         // CuTe's printout of tile_atom_to_shape_SFA for this group
  std::string layout_sfb;
  int64_t sfa_bytes = 0;          // size(filter_zeros(layout_SFA)): bytes the group's SF block spans
  int64_t sfb_bytes = 0;
  int64_t sfa_cosize = 0;         // cosize(layout_SFA)
  int64_t sfb_cosize = 0;
  std::vector<SfSample> sfa_samples;  // sampled from the layout object stored for this group
  std::vector<SfSample> sfb_samples;
  int64_t sfa_mismatches = 0;     // (m, kb) of the group's SF layouts that differ from megamoe::sf_offset
  int64_t sfb_mismatches = 0;     // (every scale visited)
  // The pointer arrays as filled, with every operand base at 0: byte offsets
  // (D: byte offset of the fp32 output). ptr_alpha_index: alpha slot the group reads.
  uint64_t ptr_a = 0, ptr_b = 0, ptr_sfa = 0, ptr_sfb = 0, ptr_d = 0;
  int64_t ptr_alpha_index = 0;
  bool can_implement = false;     // CUTLASS can_implement for this group alone
};

struct ArgsLayout {  // byte offsets of the per-group arrays inside the args buffer
  int64_t problem_shapes = 0, ptr_a = 0, ptr_b = 0, ptr_sfa = 0, ptr_sfb = 0, ptr_d = 0;
  int64_t alpha = 0, ptr_alpha = 0, stride_a = 0, stride_b = 0, stride_d = 0, layout_sfa = 0, layout_sfb = 0;
  int64_t total_bytes = 0;
};

struct MoeGemmPlan {
  MoeGemmGeometry geo;
  int sm_count = 0;
  int64_t total_rows = 0;         // rows of A and D (compact: the sum of the token counts)
  int64_t sf_rows = 0;            // rows of the SFA matrix (every expert's block padded to 128 rows)
  int64_t a_bytes = 0, sfa_bytes = 0, b_bytes = 0, sfb_bytes = 0, d_elems = 0;  // buffer sizes the groups span
  std::vector<GroupPlan> groups;
  ArgsLayout args;                // device args buffer the launcher fills
  int64_t workspace_bytes = 0;    // Gemm::get_workspace_size as the launcher asks (device problem shapes only)
  int64_t workspace_bytes_host_shapes = 0;  // the same with host problem shapes (must not exceed the above)
  bool can_implement = false;     // CUTLASS can_implement for all groups (host problem shapes) and no `problems`
  std::string can_implement_status;  // CUTLASS's status string alone
  std::vector<std::string> problems;  // megamoe's own checks (alignment of K, N, ldd); empty when fine
};

// Host-only planning. token_counts: tokens per expert [E]; a_global_scale:
// [geo.a_scale_count]; b_global_scale: [E * parts]. Dereferences no device pointer.
MoeGemmPlan plan_moe_gemm(MoeGemmGeometry const& geo, std::vector<int32_t> const& token_counts,
                          std::vector<float> const& a_global_scale, std::vector<float> const& b_global_scale,
                          int sm_count = kDefaultSmCount);

// Byte offsets of every (m, kb) of a [rows, k/16] scale matrix in the SF layout
// CUTLASS is given for operand A (which = 'A') or B ('B'), row-major over (m, kb),
// from the same layout constructor the planner and the device use.
std::vector<int64_t> sf_layout_offsets(int rows, int k, char which);

// Size of the device args buffer and of the CUTLASS workspace for a launch (no GPU needed).
ArgsLayout args_layout(int groups);
int64_t workspace_bytes(int groups, int sm_count);

struct MoeGemmDevicePointers {
  void const* a = nullptr;              // fp4 [rows, k/2]
  void const* a_sf = nullptr;           // docs/SPEC.md §2 swizzled, see sm100_moe_groups.hpp
  void const* b = nullptr;              // fp4 [E, parts * n_part, k/2]
  void const* b_sf = nullptr;           // [E, parts, round_up(n_part,128) * KT * 4]
  void* d = nullptr;                    // fp32 [rows, parts * n_part]
  int32_t const* token_counts = nullptr;  // device [E]
  float const* a_global_scale = nullptr;  // device [a_scale_count]
  float const* b_global_scale = nullptr;  // device [E * parts]
  void* args = nullptr;                 // device, args_layout(groups).total_bytes, 16-byte aligned
  int64_t args_bytes = 0;
  void* workspace = nullptr;            // device, workspace_bytes(groups, sm_count), 64-byte aligned
  int64_t workspace_bytes = 0;
};

// The args buffer exactly as the device argument builder fills it for these token counts
// and operand addresses, with the buffer at device address args_base; bytes between the
// arrays keep `fill`. Host-only: what a Blackwell test compares the device's buffer with.
struct OperandAddresses {
  uint64_t a = 0, a_sf = 0, b = 0, b_sf = 0, d = 0;
};
std::vector<uint8_t> host_args_bytes(MoeGemmGeometry const& geo, std::vector<int32_t> const& token_counts,
                                     std::vector<float> const& a_global_scale,
                                     std::vector<float> const& b_global_scale, OperandAddresses const& bases,
                                     uint64_t args_base, uint8_t fill);

// Number of initialized CUTLASS Gemm objects the launcher keeps (per configuration, device,
// args buffer, workspace, group count and SM count).
int64_t cached_gemm_count();

// Fills the per-group arrays on the device (no host synchronisation) and
// launches the grouped GEMM on `stream` (a cudaStream_t). host_token_counts,
// when given, are the same counts on the host: CUTLASS then also checks every
// group in can_implement, and a problem with no tile at all returns without
// launching anything. Every check (geometry, alignment, buffer sizes,
// can_implement, workspace) runs on the host before the first CUDA call.
// Every launch reuses an initialized Gemm kept per (configuration, device, args,
// workspace, groups, sm_count): host counts only add checks, the kernel reads the problem
// shapes from the device arrays either way. Throws std::invalid_argument / std::runtime_error
// on a bad argument or a CUTLASS / CUDA error.
void moe_gemm_run(MoeGemmGeometry const& geo, MoeGemmDevicePointers const& ptrs,
                  int32_t const* host_token_counts, int sm_count, void* stream);

}  // namespace megamoe::sm100
