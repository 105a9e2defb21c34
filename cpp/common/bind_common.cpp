// Python bindings of the shared CUDA kernels (quantize, SF swizzle / verifier).
// Allocation, poisoning and shape policy live in megamoe/backends/cuda_common.py.
#include "megamoe/bind_util.h"
#include "megamoe/common_kernels.h"

namespace nb = nanobind;
using namespace megamoe;
using namespace megamoe::bind;

namespace {

// [batches,] rows, cols of a linear (unswizzled) scale array, [rows, cols] or [batches, rows, cols].
struct LinearScaleDims {
  int64_t batches, rows, cols;
};
LinearScaleDims linear_scale_dims(const Array& linear) {
  return {linear.ndim() == 3 ? int64_t(linear.shape(0)) : 1, int64_t(linear.shape(linear.ndim() - 2)),
          int64_t(linear.shape(linear.ndim() - 1))};
}

using ScaleLayoutLaunch = cudaError_t (*)(const uint8_t*, int64_t, int64_t, int64_t, uint8_t*, cudaStream_t);
using ScaleLayoutGroupedLaunch = cudaError_t (*)(const uint8_t*, int, const int32_t*, const int32_t*, int64_t, int64_t,
                                                 uint8_t*, cudaStream_t);

// One direction of the docs/SPEC.md §2 scale-factor layout, batched (`name`) and grouped (`grouped_name`):
// src (named src_name) -> out; the shape is the linear side's (src when src_is_linear, else out).
void def_scale_layout_pair(nb::module_& m, const char* name, ScaleLayoutLaunch launch, const char* src_name,
                           bool src_is_linear, const char* grouped_name, ScaleLayoutGroupedLaunch launch_grouped) {
  m.def(
      name,
      [=](const Array& src, const Array& out, uintptr_t stream) {
        const LinearScaleDims d = linear_scale_dims(src_is_linear ? src : out);
        check(launch(ptr<const uint8_t>(src, src_name, 1), d.batches, d.rows, d.cols, ptr<uint8_t>(out, "out", 1),
                     stream_of(stream)),
              name);
      },
      nb::arg(src_name), nb::arg("out"), nb::arg("stream"));
  m.def(
      grouped_name,
      [=](const Array& src, const Array& src_offsets, const Array& dst_row_offsets, int64_t total_rows,
          const Array& out, uintptr_t stream) {
        const Array& linear = src_is_linear ? src : out;
        check(launch_grouped(ptr<const uint8_t>(src, src_name, 1), int(numel(dst_row_offsets)),
                             ptr<const int32_t>(src_offsets, "src_offsets", 4),
                             ptr<const int32_t>(dst_row_offsets, "dst_row_offsets", 4), total_rows,
                             int64_t(linear.shape(1)), ptr<uint8_t>(out, "out", 1), stream_of(stream)),
              grouped_name);
      },
      nb::arg(src_name), nb::arg("src_offsets"), nb::arg("dst_row_offsets"), nb::arg("total_rows"), nb::arg("out"),
      nb::arg("stream"));
}

}  // namespace

void register_common(nb::module_& m) {
  nb::enum_<GlobalScaleMode>(m, "GlobalScaleMode",
                             "where the quantizer finds a row's global scale (cpp/include/megamoe/common_kernels.h)")
      .value("single", GlobalScaleMode::kSingle)
      .value("per_expert", GlobalScaleMode::kPerExpert)
      .value("per_row", GlobalScaleMode::kPerRow)
      .value("per_row_dynamic", GlobalScaleMode::kPerRowDynamic);
  m.def(
      "quantize_nvfp4",
      [](const Array& src, OptArray global_scale, GlobalScaleMode gs_mode, OptArray src_rows, OptArray expert_offsets,
         OptArray dst_offsets, OptArray data, OptArray scale, OptArray scale_swz, int64_t sf_rows, OptArray dequant,
         OptArray row_scale_out, uintptr_t stream, bool dequant_lane_order, OptArray scatter_rows, int scatter_k,
         OptArray row_experts) {
        if (src.ndim() != 2) throw std::invalid_argument("quantize_nvfp4: src must be 2-D [rows, cols]");
        QuantizeArgs a;
        a.src = src.data();
        a.src_type = elem_type(src, "src");
        a.src_row_stride = src.stride(0);
        if (src.stride(1) != 1) throw std::invalid_argument("quantize_nvfp4: src rows must be contiguous");
        a.cols = int64_t(src.shape(1));
        a.rows = src_rows ? numel(*src_rows) : int64_t(src.shape(0));
        if (a.cols % 16 != 0) throw std::invalid_argument("quantize_nvfp4: cols must be a multiple of 16, got " +
                                                          std::to_string(a.cols));
        a.src_rows = opt_ptr<const int32_t>(src_rows, "src_rows", 4);
        a.global_scale = opt_ptr<const float>(global_scale, "global_scale", 4);
        a.gs_mode = gs_mode;
        if (a.gs_mode != GlobalScaleMode::kPerRowDynamic && !a.global_scale)
          throw std::invalid_argument("quantize_nvfp4: global_scale is required unless gs_mode is per-row dynamic");
        if (a.gs_mode == GlobalScaleMode::kPerRow && numel(*global_scale) < a.rows)
          throw std::invalid_argument("quantize_nvfp4: per-row global_scale needs one value per row");
        if (expert_offsets) {
          a.num_experts = int(numel(*expert_offsets)) - 1;
          a.expert_offsets = ptr<const int32_t>(*expert_offsets, "expert_offsets", 4);
          a.dst_offsets = dst_offsets ? ptr<const int32_t>(*dst_offsets, "dst_offsets", 4) : a.expert_offsets;
        }
        a.data = opt_ptr<uint8_t>(data, "data", 1);
        a.scale = opt_ptr<uint8_t>(scale, "scale", 1);
        a.scale_swz = opt_ptr<uint8_t>(scale_swz, "scale_swz", 1);
        a.sf_rows = sf_rows;
        a.dequant = opt_ptr<uint16_t>(dequant, "dequant", 2);
        a.dequant_lane_order = dequant_lane_order;
        if (a.dequant && dequant_lane_order && a.cols % 64 != 0)
          throw std::invalid_argument("quantize_nvfp4: a lane-order dequant needs cols % 64 == 0, got " +
                                      std::to_string(a.cols));
        a.row_scale_out = opt_ptr<float>(row_scale_out, "row_scale_out", 4);
        if (scatter_rows) {
          if (scatter_k < 1 || numel(*scatter_rows) < a.rows * scatter_k)
            throw std::invalid_argument("quantize_nvfp4: scatter_rows needs rows * scatter_k entries (scatter_k >= 1)");
          if (expert_offsets || src_rows || data || scale || scale_swz)
            throw std::invalid_argument(
                "quantize_nvfp4: scatter_rows writes plain rows to dequant and row_scale_out only");
          a.scatter_rows = ptr<const int32_t>(*scatter_rows, "scatter_rows", 4);
          a.scatter_k = scatter_k;
        }
        if (row_experts) {
          const auto d = row_experts->dtype();
          if (d != nb::dtype<int32_t>() && d != nb::dtype<int64_t>())
            throw std::invalid_argument("quantize_nvfp4: row_experts must be int32 or int64, got " + dtype_name(d));
          if (numel(*row_experts) < a.rows)
            throw std::invalid_argument("quantize_nvfp4: row_experts needs one expert id per row");
          if (a.gs_mode != GlobalScaleMode::kPerExpert || expert_offsets || scatter_rows)
            throw std::invalid_argument(
                "quantize_nvfp4: row_experts needs the per-expert gs_mode on plain rows, without scatter_rows");
          a.row_experts_int64 = d == nb::dtype<int64_t>();
          a.row_experts = ptr<const void>(*row_experts, "row_experts", a.row_experts_int64 ? 8 : 4);
          a.row_experts_bound = int(numel(*global_scale));
        }
        check(launch_quantize_nvfp4(a, stream_of(stream)), "quantize_nvfp4");
      },
      nb::arg("src"), nb::arg("global_scale").none(), nb::arg("gs_mode"), nb::arg("src_rows").none(),
      nb::arg("expert_offsets").none(), nb::arg("dst_offsets").none(), nb::arg("data").none(),
      nb::arg("scale").none(), nb::arg("scale_swz").none(), nb::arg("sf_rows"), nb::arg("dequant").none(),
      nb::arg("row_scale_out").none(), nb::arg("stream"), nb::arg("dequant_lane_order") = false,
      nb::arg("scatter_rows").none() = nb::none(), nb::arg("scatter_k") = 0, nb::arg("row_experts").none() = nb::none(),
      "NVFP4-quantize rows of src [rows, cols] (docs/SPEC.md §1) into the given outputs (see common_kernels.h). "
      "row_experts (int32 or int64, plain rows, per-expert gs_mode): row r uses global_scale[row_experts[r]] and "
      "is skipped when that id is outside [0, len(global_scale)).");

  m.def(
      "nvfp4_to_operand",
      [](const Array& data, const Array& scale, const Array& out, uintptr_t stream, bool lane_order) {
        if (out.ndim() != 2) throw std::invalid_argument("nvfp4_to_operand: out must be [rows, cols]");
        const int64_t rows = int64_t(out.shape(0)), cols = int64_t(out.shape(1));
        if (numel(data) != rows * cols / 2 || numel(scale) != rows * cols / 16)
          throw std::invalid_argument("nvfp4_to_operand: data/scale do not match out [rows, cols]");
        if (lane_order && cols % 64 != 0)
          throw std::invalid_argument("nvfp4_to_operand: lane order needs cols % 64 == 0, got " + std::to_string(cols));
        check(launch_nvfp4_to_operand(ptr<const uint8_t>(data, "data", 1), ptr<const uint8_t>(scale, "scale", 1), rows,
                                      cols, ptr<uint16_t>(out, "out", 2), lane_order, stream_of(stream)),
              "nvfp4_to_operand");
      },
      nb::arg("data"), nb::arg("scale"), nb::arg("out"), nb::arg("stream"), nb::arg("lane_order") = false);

  m.def(
      "dynamic_global_scale",
      [](const Array& src, const Array& scratch, const Array& out, uintptr_t stream) {
        if (src.ndim() != 2 || src.stride(1) != 1) throw std::invalid_argument("dynamic_global_scale: src [rows, cols]");
        check(launch_dynamic_global_scale(src.data(), elem_type(src, "src"), int64_t(src.shape(0)),
                                          int64_t(src.shape(1)), src.stride(0), ptr<uint32_t>(scratch, "scratch", 4),
                                          ptr<float>(out, "out", 4), stream_of(stream)),
              "dynamic_global_scale");
      },
      nb::arg("src"), nb::arg("scratch"), nb::arg("out"), nb::arg("stream"));

  def_scale_layout_pair(m, "swizzle_scales", launch_swizzle_scales, "linear", true, "swizzle_scales_grouped",
                        launch_swizzle_scales_grouped);
  def_scale_layout_pair(m, "unswizzle_scales", launch_unswizzle_scales, "swizzled", false, "unswizzle_scales_grouped",
                        launch_unswizzle_scales_grouped);
  m.def(
      "verify_swizzled",
      [](const Array& linear, const Array& swizzled, const Array& result, uintptr_t stream) {
        const LinearScaleDims d = linear_scale_dims(linear);
        const int max_records = int((numel(result) - 1) / 3);
        check(launch_verify_swizzled(ptr<const uint8_t>(linear, "linear", 1), ptr<const uint8_t>(swizzled, "swizzled", 1),
                                     d.batches, d.rows, d.cols, ptr<int64_t>(result, "result", 8), max_records,
                                     stream_of(stream)),
              "verify_swizzled");
      },
      nb::arg("linear"), nb::arg("swizzled"), nb::arg("result"), nb::arg("stream"));
  m.def(
      "verify_swizzled_grouped",
      [](const Array& linear, const Array& swizzled, const Array& src_offsets, const Array& dst_row_offsets,
         int64_t total_rows, const Array& result, uintptr_t stream) {
        const int max_records = int((numel(result) - 1) / 3);
        check(launch_verify_swizzled_grouped(
                  ptr<const uint8_t>(linear, "linear", 1), ptr<const uint8_t>(swizzled, "swizzled", 1),
                  int(numel(dst_row_offsets)), ptr<const int32_t>(src_offsets, "src_offsets", 4),
                  ptr<const int32_t>(dst_row_offsets, "dst_row_offsets", 4), total_rows, int64_t(linear.shape(1)),
                  ptr<int64_t>(result, "result", 8), max_records, stream_of(stream)),
              "verify_swizzled_grouped");
      },
      nb::arg("linear"), nb::arg("swizzled"), nb::arg("src_offsets"), nb::arg("dst_row_offsets"),
      nb::arg("total_rows"), nb::arg("result"), nb::arg("stream"));
}
