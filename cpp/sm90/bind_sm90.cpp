// Python bindings of the Hopper MoE kernels. Buffer allocation and the pipeline order
// live in megamoe/backends/cuda_sm90.py.
#include "megamoe/bind_util.h"
#include "megamoe/sm90_kernels.h"

#include <nanobind/stl/string.h>

#include <string>

namespace nb = nanobind;
using namespace megamoe;
using namespace megamoe::bind;

void register_sm90(nb::module_& m) {
  m.def(
      "sm90_moe_align",
      [](const Array& topk_ids, int num_experts, const Array& expert_offsets, const Array& active_experts,
         const Array& num_active, const Array& row_token, const Array& entry_row, uintptr_t stream,
         OptArray scratch) {
        if (topk_ids.ndim() != 2) throw std::invalid_argument("moe_align: topk_ids must be [T, k]");
        const int bits = topk_ids.dtype().bits;
        if (topk_ids.dtype().code != uint8_t(nb::dlpack::dtype_code::Int) || (bits != 32 && bits != 64))
          throw std::invalid_argument("moe_align: topk_ids must be int32 or int64, got " + dtype_name(topk_ids.dtype()));
        if (!is_contiguous(topk_ids)) throw std::invalid_argument("moe_align: topk_ids must be contiguous");
        if (numel(expert_offsets) != num_experts + 1) throw std::invalid_argument("moe_align: expert_offsets must be [E+1]");
        const int64_t entries = numel(topk_ids);
        if (numel(row_token) < entries || numel(entry_row) < entries)
          throw std::invalid_argument("moe_align: row_token / entry_row need T*k entries");
        check(sm90::launch_moe_align(topk_ids.data(), bits == 64, int64_t(topk_ids.shape(0)), int(topk_ids.shape(1)),
                                     num_experts, ptr<int32_t>(expert_offsets, "expert_offsets", 4),
                                     ptr<int32_t>(active_experts, "active_experts", 4),
                                     ptr<int32_t>(num_active, "num_active", 4), ptr<int32_t>(row_token, "row_token", 4),
                                     ptr<int32_t>(entry_row, "entry_row", 4),
                                     opt_ptr<int32_t>(scratch, "scratch", 4), scratch ? numel(*scratch) : 0,
                                     stream_of(stream)),
              "moe_align");
      },
      nb::arg("topk_ids"), nb::arg("num_experts"), nb::arg("expert_offsets"), nb::arg("active_experts"),
      nb::arg("num_active"), nb::arg("row_token"), nb::arg("entry_row"), nb::arg("stream"),
      nb::arg("scratch").none() = nb::none(),
      "Routing -> grouped rows; scratch: int32 of at least sm90_align_scratch_size(T*k, E) entries lets large\n"
      "T use the multi-block align.");
  m.def("sm90_align_scratch_size", &sm90::align_scratch_size, nb::arg("entries"), nb::arg("num_experts"),
        "int32 entries of moe_align's scratch for T*k entries and E experts");

  m.def(
      "sm90_stage_bf16",
      [](const Array& src, OptArray src_rows, OptArray num_rows, const Array& dst, uintptr_t stream, bool lane_order) {
        if (src.ndim() != 2 || src.stride(1) != 1 || dst.ndim() != 2) throw std::invalid_argument("stage_bf16: 2-D arrays");
        if (dst.shape(1) != src.shape(1)) throw std::invalid_argument("stage_bf16: column mismatch");
        check(sm90::launch_stage_bf16(src.data(), elem_type(src, "src"), src.stride(0),
                                      opt_ptr<const int32_t>(src_rows, "src_rows", 4),
                                      opt_ptr<const int32_t>(num_rows, "num_rows", 4), int64_t(dst.shape(0)),
                                      int64_t(dst.shape(1)), ptr<uint16_t>(dst, "dst", 2), lane_order,
                                      stream_of(stream)),
              "stage_bf16");
      },
      nb::arg("src"), nb::arg("src_rows").none(), nb::arg("num_rows").none(), nb::arg("dst"), nb::arg("stream"),
      nb::arg("lane_order") = false,
      "dst = bf16 rows of src in operand order (lane_order: the wgmma kernels' lane order; cols % 64 == 0).");

  m.def(
      "sm90_scatter_bf16",
      [](const Array& src, const Array& dst_rows, int top_k, const Array& dst, uintptr_t stream, bool lane_order) {
        if (src.ndim() != 2 || src.stride(1) != 1 || dst.ndim() != 2)
          throw std::invalid_argument("scatter_bf16: 2-D arrays");
        if (dst.shape(1) != src.shape(1)) throw std::invalid_argument("scatter_bf16: column mismatch");
        if (top_k <= 0 || numel(dst_rows) < int64_t(src.shape(0)) * top_k)
          throw std::invalid_argument("scatter_bf16: dst_rows needs tokens * top_k entries");
        check(sm90::launch_scatter_bf16(src.data(), elem_type(src, "src"), src.stride(0), int64_t(src.shape(0)),
                                        ptr<const int32_t>(dst_rows, "dst_rows", 4), top_k, int64_t(dst.shape(1)),
                                        ptr<uint16_t>(dst, "dst", 2), lane_order, stream_of(stream)),
              "scatter_bf16");
      },
      nb::arg("src"), nb::arg("dst_rows"), nb::arg("top_k"), nb::arg("dst"), nb::arg("stream"),
      nb::arg("lane_order") = false,
      "dst[dst_rows[t*top_k + j]] = bf16 row t of src (entries < 0 skipped), in operand or lane order: each source\n"
      "row read once (moe_align's entry_row places a token's rows).");

  nb::enum_<sm90::GemmKernel>(m, "Sm90GemmKernel", "Hopper grouped-GEMM kernels (cpp/include/megamoe/sm90_plan.h)")
      .value("auto", sm90::GemmKernel::kAuto)
      .value("stream", sm90::GemmKernel::kStream)
      .value("wgmma32", sm90::GemmKernel::kWgmma32)
      .value("wgmma64", sm90::GemmKernel::kWgmma64)
      .value("wgmma128", sm90::GemmKernel::kWgmma128);
  nb::enum_<sm90::Epilogue>(m, "Sm90Epilogue", "what the grouped GEMM writes")
      .value("store", sm90::Epilogue::kStore)
      .value("silu_mul", sm90::Epilogue::kSiluMul);
  nb::class_<sm90::GemmPlan>(m, "Sm90GemmPlan", "the dispatch plan of one MoE forward (sm90_plan)")
      .def_ro("kernel", &sm90::GemmPlan::kernel)
      .def_ro("token_tile", &sm90::GemmPlan::token_tile)
      .def_ro("tokens_per_pass", &sm90::GemmPlan::tokens_per_pass)
      .def_ro("gather_x", &sm90::GemmPlan::gather_x)
      .def_ro("h_operand", &sm90::GemmPlan::h_operand)
      .def_ro("lane_order", &sm90::GemmPlan::lane_order)
      .def_ro("stage_k_gemm1", &sm90::GemmPlan::stage_k_gemm1)
      .def_ro("stage_k_gemm2", &sm90::GemmPlan::stage_k_gemm2)
      .def_ro("copied_rows_gemm1", &sm90::GemmPlan::copied_rows_gemm1)
      .def_ro("without_align", &sm90::GemmPlan::without_align)
      .def_ro("token_order", &sm90::GemmPlan::token_order)
      .def("__repr__", [](const sm90::GemmPlan& p) {
        static const char* names[] = {"stream", "wgmma32", "wgmma64", "wgmma128"};
        auto flag = [](bool b) { return b ? "True" : "False"; };
        return std::string("Sm90GemmPlan(kernel=") + names[int(p.kernel)] + ", token_tile=" +
               std::to_string(p.token_tile) + ", tokens_per_pass=" + std::to_string(p.tokens_per_pass) +
               ", gather_x=" + flag(p.gather_x) + ", h_operand=" + flag(p.h_operand) +
               ", lane_order=" + flag(p.lane_order) + ", stage_k_gemm1=" + std::to_string(p.stage_k_gemm1) +
               ", stage_k_gemm2=" + std::to_string(p.stage_k_gemm2) + ", copied_rows_gemm1=" +
               flag(p.copied_rows_gemm1) + ", without_align=" + flag(p.without_align) +
               ", token_order=" + flag(p.token_order) + ")";
      });
  m.attr("sm90_token_order_from") = sm90::kTokenOrderFrom;
  m.def("sm90_weights_tileable", &sm90::sm90_weights_tileable, nb::arg("rows"), nb::arg("k"), nb::arg("silu_mul"),
        "Whether weights of `rows` rows (silu_mul: gate and up halves) and reduction length k can be in the tiled "
        "order (sm90_tiled): k % 256 == 0, each half's rows a multiple of 32; host only.");
  m.def(
      "sm90_plan",
      [](int64_t tokens_per_expert, int64_t k_gemm1, int64_t k_gemm2, int num_experts, bool w4a16, bool gather_input,
         sm90::GemmKernel kernel, int tokens_per_pass, bool h_static_scale, int64_t tokens, bool slots_quantize_alike,
         int64_t token_order_from, bool batch_invariant) {
        if (tokens_per_expert < 0 || k_gemm1 <= 0 || k_gemm2 <= 0 || num_experts <= 0)
          throw std::invalid_argument("sm90_plan: need tokens_per_expert >= 0 and positive K and E, got " +
                                      std::to_string(tokens_per_expert) + ", " + std::to_string(k_gemm1) + ", " +
                                      std::to_string(k_gemm2) + ", " + std::to_string(num_experts));
        if (tokens_per_pass != 0 && tokens_per_pass != 8 && tokens_per_pass != 16 && tokens_per_pass != 32 &&
            tokens_per_pass != 64)
          throw std::invalid_argument("sm90_plan: tokens_per_pass must be 0, 8, 16, 32 or 64, got " +
                                      std::to_string(tokens_per_pass));
        if (tokens < 0 || token_order_from < 1)
          throw std::invalid_argument("sm90_plan: need tokens >= 0 and token_order_from >= 1, got " +
                                      std::to_string(tokens) + ", " + std::to_string(token_order_from));
        sm90::GemmProblem p;
        p.tokens_per_expert = tokens_per_expert;
        p.k_gemm1 = k_gemm1;
        p.k_gemm2 = k_gemm2;
        p.num_experts = num_experts;
        p.w4a16 = w4a16;
        p.gather_input = gather_input;
        p.kernel = kernel;
        p.tokens_per_pass = tokens_per_pass;
        p.h_static_scale = h_static_scale;
        p.tokens = tokens;
        p.slots_quantize_alike = slots_quantize_alike;
        p.token_order_from = token_order_from;
        p.batch_invariant = batch_invariant;
        return sm90::plan_moe_gemms(p);
      },
      nb::kw_only(), nb::arg("tokens_per_expert"), nb::arg("k_gemm1"), nb::arg("k_gemm2"), nb::arg("num_experts"),
      nb::arg("w4a16"), nb::arg("gather_input"), nb::arg("kernel") = sm90::GemmKernel::kAuto,
      nb::arg("tokens_per_pass") = 0, nb::arg("h_static_scale") = false, nb::arg("tokens") = 0,
      nb::arg("slots_quantize_alike") = true, nb::arg("token_order_from") = sm90::kTokenOrderFrom,
      nb::arg("batch_invariant") = false,
      "The dispatch plan of a MoE forward (kernel, token tile, tokens per pass, fusions, stage K, copied rows, the\n"
      "one-token path, the token order); host only.\n"
      "h_static_scale (W4A4): h takes a static global scale, so the first GEMM may quantize it (h_operand).\n"
      "tokens: T of the forward (0: none; without_align and token_order need it). slots_quantize_alike (W4A4): a\n"
      "token's k slots quantize alike (a per-row dynamic scale, or one static scale for every expert).\n"
      "token_order_from: token_order from this many tokens (default sm90_token_order_from).\n"
      "batch_invariant: a row's bits must not depend on its batch: the automatic choice runs the wgmma kernels at\n"
      "every token count where the shape allows them (no streaming decode), else streaming at every count.");

  m.def(
      "sm90_grouped_gemm",
      [](const Array& act, OptArray act_rows, OptArray expert_offsets, OptArray active_experts, OptArray num_active,
         int grid_experts, const Array& w_data, const Array& w_scale, const Array& w_global_scale,
         OptArray a_global_scale, bool a_gs_per_expert, OptArray a_row_scale, sm90::Epilogue epilogue,
         std::optional<float> swiglu_limit, OptArray out, OptArray out_operand, OptArray h_quant_scale,
         int64_t max_total_rows, const sm90::GemmPlan& plan, uintptr_t stream, OptArray slot_experts,
         OptArray entry_row_out, OptArray bias, float swiglu_alpha, float swiglu_up_shift, bool offsets_settled,
         bool w_tiled) {
        if (w_data.ndim() != 3 || w_scale.ndim() != 3) throw std::invalid_argument("grouped_gemm: weights [E, N, K/2]");
        auto refuse = [](const char* err) {
          if (err) throw std::invalid_argument(std::string("grouped_gemm: ") + err);
        };
        // What both kernel families read (GroupedGemmCommon), then the struct of the plan's family.
        sm90::GroupedGemmCommon a;
        a.act = ptr<const uint16_t>(act, "act", 2);
        a.act_rows = opt_ptr<const int32_t>(act_rows, "act_rows", 4);
        if (a.act_rows && act.dtype().code != uint8_t(nb::dlpack::dtype_code::Bfloat))
          throw std::invalid_argument("grouped_gemm: a gathered (act_rows) activation must be bfloat16");
        a.num_experts = int(w_data.shape(0));
        if (expert_offsets) {
          a.expert_offsets = ptr<const int32_t>(*expert_offsets, "expert_offsets", 4);
          if (numel(*expert_offsets) != a.num_experts + 1)
            throw std::invalid_argument("grouped_gemm: expert_offsets must have E+1 entries");
        }
        const int32_t* active = opt_ptr<const int32_t>(active_experts, "active_experts", 4);
        const int32_t* n_active = opt_ptr<const int32_t>(num_active, "num_active", 4);
        a.grid_experts = grid_experts;
        a.w_data = ptr<const uint8_t>(w_data, "w_data", 1);
        a.w_scale = ptr<const uint8_t>(w_scale, "w_scale", 1);
        a.N = int64_t(w_data.shape(1));
        a.K = int64_t(w_data.shape(2)) * 2;
        if (int64_t(w_scale.shape(1)) != a.N || int64_t(w_scale.shape(2)) * 16 < a.K)
          throw std::invalid_argument("grouped_gemm: w_scale must be [E, N, S] with S >= K/16 (rows padded past K/16)");
        a.w_scale_row_bytes = int64_t(w_scale.shape(2));
        if (act.ndim() != 2 || int64_t(act.shape(1)) != a.K)
          throw std::invalid_argument("grouped_gemm: act must be [rows, K] with K = " + std::to_string(a.K));
        a.w_global_scale = ptr<const float>(w_global_scale, "w_global_scale", 4);
        a.w_gs_per_expert = int(numel(w_global_scale) / a.num_experts);
        a.a_global_scale = opt_ptr<const float>(a_global_scale, "a_global_scale", 4);
        a.a_gs_per_expert = a_gs_per_expert;
        a.a_row_scale = opt_ptr<const float>(a_row_scale, "a_row_scale", 4);
        a.swiglu_clamp = swiglu_limit.has_value();
        a.swiglu_limit = swiglu_limit.value_or(0.f);
        a.swiglu_alpha = swiglu_alpha;
        a.swiglu_up_shift = swiglu_up_shift;
        if (bias) {
          if (elem_type(*bias, "bias") != ElemType::kFloat32 || numel(*bias) != int64_t(a.num_experts) * a.N)
            throw std::invalid_argument("grouped_gemm: bias must be float32 [E, N] = [" + std::to_string(a.num_experts) +
                                        ", " + std::to_string(a.N) + "] (one value per expert and weight row), got " +
                                        std::to_string(numel(*bias)) + " values of " + dtype_name(bias->dtype()));
          a.bias = ptr<const float>(*bias, "bias", 4);
        }
        a.epilogue = epilogue;
        a.offsets_settled = offsets_settled;
        a.w_tiled = w_tiled;
        if (out && elem_type(*out, "out") == ElemType::kBFloat16) {
          a.out_bf16 = ptr<uint16_t>(*out, "out", 2);
        } else {
          a.out = opt_ptr<float>(out, "out", 4);
        }
        a.out_operand = opt_ptr<uint16_t>(out_operand, "out_operand", 2);
        if (h_quant_scale) {
          const int64_t n = numel(*h_quant_scale);
          if (n != 1 && n != a.num_experts)
            throw std::invalid_argument("grouped_gemm: h_quant_scale must have 1 or E = " +
                                        std::to_string(a.num_experts) + " entries, got " + std::to_string(n));
          a.h_quant_gs = ptr<const float>(*h_quant_scale, "h_quant_scale", 4);
          a.h_gs_per_expert = n != 1;
        }
        if (slot_experts) {  // one token, no align kernel: slot j is row j (GroupedGemmCommon::slot_experts)
          const int bits = slot_experts->dtype().bits;
          if (slot_experts->dtype().code != uint8_t(nb::dlpack::dtype_code::Int) || (bits != 32 && bits != 64))
            throw std::invalid_argument("grouped_gemm: slot_experts must be int32 or int64, got " +
                                        dtype_name(slot_experts->dtype()));
          a.slot_experts = ptr<const void>(*slot_experts, "slot_experts", bits / 8);  // (contiguous)
          a.slot_experts_int64 = bits == 64;
        }
        a.entry_row_out = opt_ptr<int32_t>(entry_row_out, "entry_row_out", 4);
        // With slots, after the family's rules (the silu_mul GEMM writes out_operand, the store GEMM out): the sizes.
        auto check_slots = [&] {
          if (!slot_experts) return;
          const int64_t n_slots = grid_experts;
          const int64_t rows_out = int64_t((epilogue == sm90::Epilogue::kSiluMul ? *out_operand : *out).shape(0));
          if (numel(*slot_experts) < n_slots || max_total_rows < n_slots || rows_out < n_slots ||
              (act_rows ? numel(*act_rows) : int64_t(act.shape(0))) < n_slots ||
              (entry_row_out && numel(*entry_row_out) < n_slots))
            throw std::invalid_argument("grouped_gemm: with slot_experts every grid slot j reads slot_experts[j] and "
                                        "activation row j and writes output row j (and entry_row_out[j]): each needs "
                                        "grid_experts = " + std::to_string(n_slots) +
                                        " entries or rows (and max_total_rows as many)");
        };
        const cudaStream_t st = stream_of(stream);
        refuse(sm90::gemm_kernel_error(plan.kernel));
        if (plan.kernel != sm90::GemmKernel::kStream) {  // wgmma32 / 64 / 128: the plan's tile, stage K, TMA rows
          sm90::WgmmaGemmArgs w;
          static_cast<sm90::GroupedGemmCommon&>(w) = a;
          w.act_num_rows = int64_t(act.shape(0));
          w.max_total_rows = max_total_rows;
          w.tile = plan.token_tile;
          sm90::plan_wgmma_stage(w);
          refuse(sm90::wgmma_gemm_args_error(w));
          check_slots();
          check(sm90::launch_wgmma_gemm(w, st), "grouped_gemm");
          return;
        }
        sm90::StreamGemmArgs s;
        static_cast<sm90::GroupedGemmCommon&>(s) = a;
        s.active_experts = active;
        s.num_active = n_active;
        s.tokens_per_pass = plan.tokens_per_pass;
        refuse(sm90::stream_gemm_args_error(s));
        check_slots();
        check(sm90::launch_stream_gemm(s, st), "grouped_gemm");
      },
      nb::kw_only(), nb::arg("act"), nb::arg("act_rows").none() = nb::none(),
      nb::arg("expert_offsets").none() = nb::none(),
      nb::arg("active_experts").none() = nb::none(), nb::arg("num_active").none() = nb::none(),
      nb::arg("grid_experts"), nb::arg("w_data"), nb::arg("w_scale"), nb::arg("w_global_scale"),
      nb::arg("a_global_scale").none() = nb::none(), nb::arg("a_gs_per_expert") = false,
      nb::arg("a_row_scale").none() = nb::none(), nb::arg("epilogue"), nb::arg("swiglu_limit").none() = nb::none(),
      nb::arg("out").none() = nb::none(), nb::arg("out_operand").none() = nb::none(),
      nb::arg("h_quant_scale").none() = nb::none(), nb::arg("max_total_rows"),
      nb::arg("plan"), nb::arg("stream"), nb::arg("slot_experts").none() = nb::none(),
      nb::arg("entry_row_out").none() = nb::none(), nb::arg("bias").none() = nb::none(),
      nb::arg("swiglu_alpha") = 1.0f, nb::arg("swiglu_up_shift") = 0.0f, nb::arg("offsets_settled") = false,
      nb::arg("w_tiled") = false,
      "One grouped GEMM of the MoE forward with the kernel and tiling of `plan` (sm90_plan); keywords only. With "
      "slot_experts (one token's topk_ids, int32 or int64) instead of expert_offsets, no align kernel: slot j is row j "
      "of expert slot_experts[j] (none when that id is outside [0, E)), activation row j (or act_rows[j]) its input "
      "(the one-tile streaming kernel, or wgmma tile 32); the "
      "silu_mul GEMM then writes the token's entry_row into entry_row_out (j, or -1 when dropped). bias: float32 [E, N] "
      "added to each weight row's scaled product (silu_mul: gate rows then up rows, before the activation); "
      "swiglu_alpha, swiglu_up_shift: h = (up + shift) * gate * sigmoid(alpha * gate) (gpt-oss: 1.702, 1). "
      "offsets_settled: expert_offsets and act_rows were complete before the last kernel queued on the stream started "
      "(the MoE forward, two or more kernels after the align kernel): the wgmma kernels then issue their first weight "
      "loads before they wait for that kernel (programmatic dependent launch); leave it False otherwise. "
      "w_tiled: w_data and w_scale are in the tiled order (sm90_tiled: K % 256 == 0, N % 32 == 0, silu_mul I % 32 == "
      "0), the shapes still [E, N, K/2] and [E, N, K/16].");

  m.def(
      "sm90_moe_combine",
      [](const Array& y, const Array& entry_row, const Array& topk_weights, const Array& out, uintptr_t stream) {
        if (topk_weights.ndim() != 2 || out.ndim() != 2) throw std::invalid_argument("moe_combine: 2-D arrays");
        const ElemType yt = elem_type(y, "y");
        if (yt == ElemType::kFloat16) throw std::invalid_argument("moe_combine: y must be float32 or bfloat16");
        if (y.ndim() != 2 || int64_t(y.shape(1)) != int64_t(out.shape(1)))
          throw std::invalid_argument("moe_combine: y must be [rows, H] with the H of out");
        check(sm90::launch_moe_combine(ptr<const void>(y, "y", yt == ElemType::kFloat32 ? 4 : 2),
                                       yt == ElemType::kBFloat16, ptr<const int32_t>(entry_row, "entry_row", 4),
                                       ptr<const float>(topk_weights, "topk_weights", 4), int64_t(out.shape(0)),
                                       int(topk_weights.shape(1)), int64_t(out.shape(1)), out.data(),
                                       elem_type(out, "out"), stream_of(stream)),
              "moe_combine");
      },
      nb::arg("y"), nb::arg("entry_row"), nb::arg("topk_weights"), nb::arg("out"), nb::arg("stream"));
}
