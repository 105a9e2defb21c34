// The rules of the sm90 grouped-GEMM arguments (cpp/sm90/gemm_args.cpp, grouped_gemm_args_error), on the host: a
// valid call of each kind passes, and each broken rule is refused with a message naming it. (The pointers are never
// dereferenced: only their presence and alignment matter.)
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

#include "megamoe/sm90_kernels.h"

using megamoe::sm90::Epilogue;
using megamoe::sm90::GemmKernel;
using megamoe::sm90::GroupedGemmArgs;

static int failures = 0;
static int checks = 0;

template <typename T>
static T* fake(uintptr_t addr) {
  return reinterpret_cast<T*>(addr);
}

// A valid streaming gemm1 (silu_mul into fp32 h) of E = 8 experts, N = 2 * 512, K = 1024.
static GroupedGemmArgs gemm1() {
  GroupedGemmArgs a;
  a.act = fake<const uint16_t>(0x10000);
  a.expert_offsets = fake<const int32_t>(0x20000);
  a.num_experts = 8;
  a.grid_experts = 8;
  a.w_data = fake<const uint8_t>(0x30000);
  a.w_scale = fake<const uint8_t>(0x40000);
  a.w_scale_row_bytes = 64;
  a.w_global_scale = fake<const float>(0x50000);
  a.w_gs_per_expert = 2;
  a.N = 1024;
  a.K = 1024;
  a.epilogue = Epilogue::kSiluMul;
  a.out = fake<float>(0x60000);
  a.max_total_rows = 64;
  a.kernel = GemmKernel::kStream;
  a.tokens_per_pass = 8;
  return a;
}

static void expect(const char* what, const GroupedGemmArgs& a, const char* needle) {
  ++checks;
  const char* err = megamoe::sm90::grouped_gemm_args_error(a);
  const bool ok = needle ? err && std::strstr(err, needle) : err == nullptr;
  if (!ok) {
    std::printf("FAIL %s: got \"%s\", expected %s%s\n", what, err ? err : "(accepted)", needle ? "a message with " : "",
                needle ? needle : "acceptance");
    ++failures;
  }
}

static void broken(const char* what, const std::function<void(GroupedGemmArgs&)>& f, const char* needle,
                   GroupedGemmArgs (*base)() = gemm1) {
  GroupedGemmArgs a = base();
  f(a);
  expect(what, a, needle);
}

static GroupedGemmArgs wgmma_gemm2() {
  GroupedGemmArgs a = gemm1();
  a.epilogue = Epilogue::kStore;
  a.w_gs_per_expert = 1;
  a.N = 512;
  a.kernel = GemmKernel::kWgmma64;
  a.tokens_per_pass = 64;
  return a;
}

static GroupedGemmArgs one_token_gemm1() {
  GroupedGemmArgs a = gemm1();
  a.expert_offsets = nullptr;
  a.slot_experts = fake<const void>(0x70000);
  a.out = nullptr;
  a.out_operand = fake<uint16_t>(0x80000);
  a.act_rows = fake<const int32_t>(0x90000);
  a.entry_row_out = fake<int32_t>(0xA0000);
  return a;
}

int main() {
  expect("streaming gemm1", gemm1(), nullptr);
  expect("wgmma gemm2", wgmma_gemm2(), nullptr);
  expect("one token's gemm1", one_token_gemm1(), nullptr);
  {
    GroupedGemmArgs a = gemm1();  // gpt-oss: biases on both GEMMs, its activation on gemm1
    a.bias = fake<const float>(0xB0000);
    a.swiglu_alpha = 1.702f;
    a.swiglu_up_shift = 1.f;
    expect("gpt-oss gemm1", a, nullptr);
    GroupedGemmArgs b = wgmma_gemm2();
    b.bias = fake<const float>(0xC0000);
    expect("gemm2 with a bias", b, nullptr);
  }
  for (int tpp : {16, 32, 64}) broken("tokens per pass", [&](GroupedGemmArgs& a) { a.tokens_per_pass = tpp; }, nullptr);

  broken("K % 16", [](GroupedGemmArgs& a) { a.K = 1000; }, "K must be a positive multiple of 16");
  broken("K 0", [](GroupedGemmArgs& a) { a.K = 0; }, "K must be");
  broken("N 0", [](GroupedGemmArgs& a) { a.N = 0; }, "N (weight rows)");
  broken("no act", [](GroupedGemmArgs& a) { a.act = nullptr; }, "act, w_data");
  broken("no rows", [](GroupedGemmArgs& a) { a.expert_offsets = nullptr; }, "expert_offsets (grouped rows");
  broken("offsets and slots", [](GroupedGemmArgs& a) { a.expert_offsets = fake<const int32_t>(0x20000); }, "not both",
         one_token_gemm1);
  broken("slots with active experts", [](GroupedGemmArgs& a) { a.active_experts = fake<const int32_t>(0xB0000); },
         "no active_experts or num_active", one_token_gemm1);
  broken("slots with num_active", [](GroupedGemmArgs& a) { a.num_active = fake<const int32_t>(0xC0000); },
         "no active_experts or num_active", one_token_gemm1);
  broken("grid 0", [](GroupedGemmArgs& a) { a.grid_experts = 0; }, "grid_experts");
  broken("grid 65536", [](GroupedGemmArgs& a) { a.grid_experts = 65536; }, "grid_experts");
  broken("silu_mul N", [](GroupedGemmArgs& a) { a.N = 1000; }, "I a multiple of 16");
  broken("silu_mul scales", [](GroupedGemmArgs& a) { a.w_gs_per_expert = 1; }, "2 entries per expert");
  broken("silu_mul bf16 out", [](GroupedGemmArgs& a) { a.out = nullptr; a.out_bf16 = fake<uint16_t>(0x60000); },
         "needs the store epilogue");
  broken("two outputs", [](GroupedGemmArgs& a) { a.out_bf16 = fake<uint16_t>(0x60000); }, "one of out and out_bf16",
         wgmma_gemm2);
  broken("no output", [](GroupedGemmArgs& a) { a.out = nullptr; }, "give out");
  broken("operand out of store", [](GroupedGemmArgs& a) { a.out_operand = fake<uint16_t>(0x80000); },
         "out_operand (h as the gemm2 operand) needs the silu_mul", wgmma_gemm2);
  broken("activation alpha on the store GEMM", [](GroupedGemmArgs& a) { a.swiglu_alpha = 1.702f; },
         "silu_mul epilogue only", wgmma_gemm2);
  broken("up shift on the store GEMM", [](GroupedGemmArgs& a) { a.swiglu_up_shift = 1.f; }, "silu_mul epilogue only",
         wgmma_gemm2);
  broken("clamp on the store GEMM", [](GroupedGemmArgs& a) { a.swiglu_clamp = true; }, "silu_mul epilogue only",
         wgmma_gemm2);
  broken("h quantized without operand", [](GroupedGemmArgs& a) { a.h_quant_gs = fake<const float>(0x90000); },
         "h_quant_scale (h quantized to NVFP4) needs out_operand");
  broken("entry_row_out without slots", [](GroupedGemmArgs& a) { a.entry_row_out = fake<int32_t>(0xA0000); },
         "entry_row_out");
  broken("slots on wgmma", [](GroupedGemmArgs& a) { a.kernel = GemmKernel::kWgmma32; },
         "slot_experts runs on the one-tile streaming kernel", one_token_gemm1);
  broken("tokens per pass 12", [](GroupedGemmArgs& a) { a.tokens_per_pass = 12; }, "8, 16, 32 or 64");
  broken("tokens per pass 128", [](GroupedGemmArgs& a) { a.tokens_per_pass = 128; }, "8, 16, 32 or 64");
  broken("slots with 16 tokens per pass", [](GroupedGemmArgs& a) { a.tokens_per_pass = 16; }, "K % 64 == 0",
         one_token_gemm1);
  broken("slots with K % 64", [](GroupedGemmArgs& a) { a.K = 1040; }, "K % 64 == 0", one_token_gemm1);
  broken("slots: fp32 h", [](GroupedGemmArgs& a) { a.out_operand = nullptr; a.out = fake<float>(0x60000); },
         "writes h into out_operand", one_token_gemm1);
  broken("slots: gather and quantized h", [](GroupedGemmArgs& a) { a.h_quant_gs = fake<const float>(0x90000); },
         "either gathers act", one_token_gemm1);
  broken("slots: store GEMM gathering",
         [](GroupedGemmArgs& a) { a.epilogue = Epilogue::kStore; a.out_operand = nullptr; a.entry_row_out = nullptr;
                                  a.out = fake<float>(0x60000); a.w_gs_per_expert = 1; },
         "the store GEMM reads staged rows", one_token_gemm1);
  broken("gather with quantized h, one tile",
         [](GroupedGemmArgs& a) { a.out = nullptr; a.out_operand = fake<uint16_t>(0x80000);
                                  a.h_quant_gs = fake<const float>(0x90000); a.act_rows = fake<const int32_t>(0x90000); },
         "without act_rows on the one-tile streaming kernel");
  broken("gather with quantized h, 4 tiles",
         [](GroupedGemmArgs& a) { a.out = nullptr; a.out_operand = fake<uint16_t>(0x80000); a.tokens_per_pass = 32;
                                  a.h_quant_gs = fake<const float>(0x90000); a.act_rows = fake<const int32_t>(0x90000); },
         nullptr);
  broken("auto kernel", [](GroupedGemmArgs& a) { a.kernel = GemmKernel::kAuto; }, "the plan's kernel");

  broken("wgmma K step", [](GroupedGemmArgs& a) { a.K = 1088; }, "K per stage", wgmma_gemm2);
  broken("wgmma tile 128 K step 64", [](GroupedGemmArgs& a) { a.K = 1088; a.kernel = GemmKernel::kWgmma128;
                                                               a.w_scale_row_bytes = 80; }, nullptr, wgmma_gemm2);
  broken("wgmma experts", [](GroupedGemmArgs& a) { a.num_experts = 1025; }, "at most 1024 experts", wgmma_gemm2);
  broken("wgmma scale rows", [](GroupedGemmArgs& a) { a.w_scale_row_bytes = 0; a.K = 128; }, "multiple of 16 bytes",
         wgmma_gemm2);
  broken("wgmma short scale rows", [](GroupedGemmArgs& a) { a.w_scale_row_bytes = 48; }, "at least K / 16",
         wgmma_gemm2);
  broken("wgmma alignment", [](GroupedGemmArgs& a) { a.w_data = fake<const uint8_t>(0x30008); }, "16-byte aligned",
         wgmma_gemm2);
  broken("wgmma quantized h of gathered rows",
         [](GroupedGemmArgs& a) { a.epilogue = Epilogue::kSiluMul; a.N = 1024; a.w_gs_per_expert = 2; a.out = nullptr;
                                  a.out_operand = fake<uint16_t>(0x80000); a.h_quant_gs = fake<const float>(0x90000);
                                  a.act_rows = fake<const int32_t>(0x90000); },
         "read by TMA", wgmma_gemm2);
  broken("wgmma tiles", [](GroupedGemmArgs& a) { a.max_total_rows = int64_t(64) * 65535; }, "too many token tiles",
         wgmma_gemm2);

  std::printf("sm90 grouped-GEMM arguments: %d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
