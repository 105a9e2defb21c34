// nanobind layer of the Blackwell grouped GEMM (megamoe._C.sm100_*).
// Host-only functions work without a GPU; sm100_moe_gemm launches on the device.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "megamoe/sm100_grouped_gemm.h"

namespace nb = nanobind;
namespace sm100 = megamoe::sm100;

namespace {

sm100::MoeGemmGeometry make_geometry(int num_experts, int parts, int n_part, int k, int a_scale_count,
                                     int tile_n = sm100::kWideTileN) {
  sm100::MoeGemmGeometry geo;
  geo.tile_n = tile_n;
  geo.num_experts = num_experts;
  geo.parts = parts;
  geo.n_part = n_part;
  geo.k = k;
  geo.a_scale_count = a_scale_count;
  return geo;
}

nb::list samples_to_list(std::vector<sm100::SfSample> const& samples) {
  nb::list out;
  for (auto const& s : samples) out.append(nb::make_tuple(s.m, s.kb, s.offset));
  return out;
}

nb::dict args_layout_to_dict(sm100::ArgsLayout const& a) {
  nb::dict d;
  d["problem_shapes"] = a.problem_shapes;
  d["ptr_a"] = a.ptr_a;
  d["ptr_b"] = a.ptr_b;
  d["ptr_sfa"] = a.ptr_sfa;
  d["ptr_sfb"] = a.ptr_sfb;
  d["ptr_d"] = a.ptr_d;
  d["alpha"] = a.alpha;
  d["ptr_alpha"] = a.ptr_alpha;
  d["stride_a"] = a.stride_a;
  d["stride_b"] = a.stride_b;
  d["stride_d"] = a.stride_d;
  d["layout_sfa"] = a.layout_sfa;
  d["layout_sfb"] = a.layout_sfb;
  d["total_bytes"] = a.total_bytes;
  return d;
}

nb::dict group_to_dict(sm100::GroupPlan const& g) {
  nb::dict d;
  d["expert"] = g.geo.expert;
  d["part"] = g.geo.part;
  d["problem_shape"] = nb::make_tuple(g.geo.m, g.geo.n, g.geo.k);
  d["tokens"] = g.geo.tokens;
  d["row_offset"] = g.geo.row_offset;
  d["sf_row_offset"] = g.geo.sf_row_offset;
  d["a_offset_bytes"] = g.geo.a_offset_bytes;
  d["sfa_offset_bytes"] = g.geo.sfa_offset_bytes;
  d["b_offset_bytes"] = g.geo.b_offset_bytes;
  d["sfb_offset_bytes"] = g.geo.sfb_offset_bytes;
  d["d_offset_elems"] = g.geo.d_offset_elems;
  d["ldd"] = g.geo.ldd;
  d["a_scale_index"] = g.geo.a_scale_index;
  d["b_scale_index"] = g.geo.b_scale_index;
  d["alpha"] = g.alpha;
  d["stride_a"] = g.stride_a;
  d["stride_b"] = g.stride_b;
  d["stride_d"] = g.stride_d;
  d["layout_sfa"] = g.layout_sfa;
  d["layout_sfb"] = g.layout_sfb;
  d["sfa_bytes"] = g.sfa_bytes;
  d["sfb_bytes"] = g.sfb_bytes;
  d["sfa_cosize"] = g.sfa_cosize;
  d["sfb_cosize"] = g.sfb_cosize;
  d["sfa_samples"] = samples_to_list(g.sfa_samples);
  d["sfb_samples"] = samples_to_list(g.sfb_samples);
  d["sfa_mismatches"] = g.sfa_mismatches;
  d["sfb_mismatches"] = g.sfb_mismatches;
  d["ptr_a"] = g.ptr_a;
  d["ptr_b"] = g.ptr_b;
  d["ptr_sfa"] = g.ptr_sfa;
  d["ptr_sfb"] = g.ptr_sfb;
  d["ptr_d"] = g.ptr_d;
  d["ptr_alpha_index"] = g.ptr_alpha_index;
  d["can_implement"] = g.can_implement;
  return d;
}

nb::dict plan_to_dict(sm100::MoeGemmPlan const& p) {
  nb::dict d;
  d["num_experts"] = p.geo.num_experts;
  d["parts"] = p.geo.parts;
  d["n_part"] = p.geo.n_part;
  d["k"] = p.geo.k;
  d["a_scale_count"] = p.geo.a_scale_count;
  d["num_groups"] = int(p.groups.size());
  d["sm_count"] = p.sm_count;
  d["tile_n"] = p.geo.tile_n;
  d["total_rows"] = p.total_rows;
  d["sf_rows"] = p.sf_rows;
  d["a_bytes"] = p.a_bytes;
  d["sfa_bytes"] = p.sfa_bytes;
  d["b_bytes"] = p.b_bytes;
  d["sfb_bytes"] = p.sfb_bytes;
  d["d_elems"] = p.d_elems;
  d["d_element_bytes"] = sm100::kOutputElementBytes;
  nb::list groups;
  for (auto const& g : p.groups) groups.append(group_to_dict(g));
  d["groups"] = groups;
  d["args_layout"] = args_layout_to_dict(p.args);
  d["args_bytes"] = p.args.total_bytes;
  d["workspace_bytes"] = p.workspace_bytes;
  d["workspace_bytes_host_shapes"] = p.workspace_bytes_host_shapes;
  d["can_implement"] = p.can_implement;
  d["can_implement_status"] = p.can_implement_status;
  d["problems"] = p.problems;
  return d;
}

}  // namespace

void register_sm100(nb::module_& m) {
  m.def("sm100_kernel_info", [](int tile_n) {
    sm100::KernelInfo const k = sm100::kernel_info(tile_n);
    nb::dict d;
    d["tile_shape"] = nb::make_tuple(k.tile_m, k.tile_n, k.tile_k);
    d["cluster_shape"] = nb::make_tuple(k.cluster_m, k.cluster_n);
    d["stages"] = k.stages;
    d["shared_storage_bytes"] = k.shared_storage_bytes;
    d["smem_capacity_bytes"] = k.smem_capacity_bytes;
    d["threads_per_cta"] = k.threads_per_cta;
    d["alignment_a_elems"] = k.alignment_a_elems;
    d["alignment_b_elems"] = k.alignment_b_elems;
    d["alignment_d_elems"] = k.alignment_d_elems;
    d["sf_vec_size"] = k.sf_vec_size;
    d["schedule"] = k.schedule;
    d["element_a"] = k.element_a;
    d["element_b"] = k.element_b;
    d["element_sf"] = k.element_sf;
    d["element_d"] = k.element_d;
    d["element_d_bytes"] = k.element_d_bytes;
    d["default_sm_count"] = sm100::kDefaultSmCount;
    d["expert_row_align"] = sm100::kExpertRowAlign;
    d["tile_n_options"] = nb::make_tuple(sm100::kWideTileN, sm100::kNarrowTileN);
    return d;
  }, nb::arg("tile_n") = sm100::kWideTileN,
     "Compile-time facts about the sm_100a kernel configuration with this N tile (128 or 64).");

  m.def("sm100_cuda_versions", []() {
    nb::dict d;
    d["runtime"] = int(CUDART_VERSION);  // the CUDA runtime linked into megamoe._C (static)
    int driver = 0;
    cudaError_t const err = cudaDriverGetVersion(&driver);  // 0 when no driver is installed
    d["driver"] = err == cudaSuccess ? driver : 0;
    d["driver_error"] = err == cudaSuccess ? std::string() : std::string(cudaGetErrorString(err));
    return d;
  }, "CUDA versions as 1000 * major + 10 * minor: `runtime`, the CUDA runtime megamoe._C was built with "
     "and links statically; `driver`, the newest CUDA version the installed driver supports (0: no driver).");

  m.def("sm100_select_tile_n", &sm100::select_tile_n, nb::arg("pairs"), nb::arg("num_experts"), nb::arg("parts"),
        nb::arg("n_part"), nb::arg("sm_count") = sm100::kDefaultSmCount,
        "N tile (64 or 128) the launcher uses for `pairs` = T * k routed rows (host-only, from T * k alone): 64 "
        "when a bound of the 128-wide grid's CTAs is below sm_count.");

  m.def("sm100_plan_moe_gemm",
        [](std::vector<int32_t> const& token_counts, int parts, int n_part, int k,
           std::vector<float> const& a_global_scale, std::vector<float> const& b_global_scale, int sm_count,
           int tile_n) {
          auto const geo =
              make_geometry(int(token_counts.size()), parts, n_part, k, int(a_global_scale.size()), tile_n);
          return plan_to_dict(sm100::plan_moe_gemm(geo, token_counts, a_global_scale, b_global_scale, sm_count));
        },
        nb::arg("token_counts"), nb::arg("parts"), nb::arg("n_part"), nb::arg("k"), nb::arg("a_global_scale"),
        nb::arg("b_global_scale"), nb::arg("sm_count") = sm100::kDefaultSmCount, nb::arg("tile_n") = sm100::kWideTileN,
        "Host-only plan of the grouped NVFP4 GEMM (no GPU needed): per-group problem shapes, strides, SF "
        "layouts as CuTe builds them, pointer offsets (operand bases at 0), alphas, CUTLASS can_implement and "
        "workspace size. token_counts: tokens per expert; a_global_scale: 1 or E values; b_global_scale: "
        "E * parts values (expert-major).");

  m.def("sm100_sf_layout_offsets",
        [](int rows, int k, std::string const& operand) {
          if (operand.size() != 1) throw nb::value_error("operand must be 'A' or 'B'");
          return sm100::sf_layout_offsets(rows, k, operand[0]);
        },
        nb::arg("rows"), nb::arg("k"), nb::arg("operand") = "A",
        "Byte offset of every scale (m, kb), row-major over [rows, k/16], in the SF layout CUTLASS is given "
        "(tile_atom_to_shape_SFA / SFB of Sm1xxBlockScaledConfig).");

  m.def("sm100_args_bytes", [](int groups) { return sm100::args_layout(groups).total_bytes; }, nb::arg("groups"),
        "Bytes of the device buffer holding the per-group argument arrays.");
  m.def("sm100_workspace_bytes", &sm100::workspace_bytes, nb::arg("groups"),
        nb::arg("sm_count") = sm100::kDefaultSmCount,
        "CUTLASS workspace bytes for a launch (Gemm::get_workspace_size).");

  m.def("sm100_host_args_bytes",
        [](std::vector<int32_t> const& token_counts, int parts, int n_part, int k,
           std::vector<float> const& a_global_scale, std::vector<float> const& b_global_scale,
           std::vector<uint64_t> const& bases, uint64_t args_base, int fill) {
          if (bases.size() != 5) throw nb::value_error("bases must be (a, a_sf, b, b_sf, d)");
          if (fill < 0 || fill > 255) throw nb::value_error("fill must be a byte value 0..255");
          auto const geo = make_geometry(int(token_counts.size()), parts, n_part, k, int(a_global_scale.size()));
          sm100::OperandAddresses addr;
          addr.a = bases[0];
          addr.a_sf = bases[1];
          addr.b = bases[2];
          addr.b_sf = bases[3];
          addr.d = bases[4];
          std::vector<uint8_t> const bytes = sm100::host_args_bytes(geo, token_counts, a_global_scale, b_global_scale,
                                                                    addr, args_base, uint8_t(fill));
          return nb::bytes(reinterpret_cast<char const*>(bytes.data()), bytes.size());
        },
        nb::arg("token_counts"), nb::arg("parts"), nb::arg("n_part"), nb::arg("k"), nb::arg("a_global_scale"),
        nb::arg("b_global_scale"), nb::arg("bases"), nb::arg("args_base"), nb::arg("fill") = 0,
        "Host-only: the args buffer (sm100_args_bytes(groups) bytes) exactly as the device argument builder "
        "fills it for these counts, operand addresses (a, a_sf, b, b_sf, d) and a buffer at args_base; bytes "
        "between the arrays keep `fill`.");
  m.def("sm100_cached_gemm_count", &sm100::cached_gemm_count,
        "Initialized CUTLASS Gemm objects the launcher keeps (launches with device token counts).");

  m.def("sm100_moe_gemm",
        [](int num_experts, int parts, int n_part, int k, int a_scale_count, uintptr_t a, uintptr_t a_sf,
           uintptr_t b, uintptr_t b_sf, uintptr_t d, uintptr_t token_counts, uintptr_t a_global_scale,
           uintptr_t b_global_scale, uintptr_t args, int64_t args_bytes, uintptr_t workspace,
           int64_t workspace_bytes, std::optional<std::vector<int32_t>> host_token_counts, int sm_count,
           uintptr_t stream, int tile_n) {
          auto const geo = make_geometry(num_experts, parts, n_part, k, a_scale_count, tile_n);
          if (host_token_counts && int(host_token_counts->size()) != num_experts) {
            throw nb::value_error("host_token_counts must have num_experts entries");
          }
          sm100::MoeGemmDevicePointers p;
          p.a = reinterpret_cast<void const*>(a);
          p.a_sf = reinterpret_cast<void const*>(a_sf);
          p.b = reinterpret_cast<void const*>(b);
          p.b_sf = reinterpret_cast<void const*>(b_sf);
          p.d = reinterpret_cast<void*>(d);
          p.token_counts = reinterpret_cast<int32_t const*>(token_counts);
          p.a_global_scale = reinterpret_cast<float const*>(a_global_scale);
          p.b_global_scale = reinterpret_cast<float const*>(b_global_scale);
          p.args = reinterpret_cast<void*>(args);
          p.args_bytes = args_bytes;
          p.workspace = reinterpret_cast<void*>(workspace);
          p.workspace_bytes = workspace_bytes;
          sm100::moe_gemm_run(geo, p, host_token_counts ? host_token_counts->data() : nullptr, sm_count,
                              reinterpret_cast<void*>(stream));
        },
        nb::arg("num_experts"), nb::arg("parts"), nb::arg("n_part"), nb::arg("k"), nb::arg("a_scale_count"),
        nb::arg("a"), nb::arg("a_sf"), nb::arg("b"), nb::arg("b_sf"), nb::arg("d"), nb::arg("token_counts"),
        nb::arg("a_global_scale"), nb::arg("b_global_scale"), nb::arg("args"), nb::arg("args_bytes"),
        nb::arg("workspace"), nb::arg("workspace_bytes"), nb::arg("host_token_counts").none() = nb::none(),
        nb::arg("sm_count"), nb::arg("stream"), nb::arg("tile_n") = sm100::kWideTileN,
        "Launch the grouped NVFP4 GEMM on `stream` (device pointers as integers, see sm100_moe_groups.hpp "
        "for the buffer layouts). Asynchronous; raises on bad arguments or CUTLASS errors.");
}
