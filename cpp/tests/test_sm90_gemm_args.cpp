// The rules of the sm90 grouped-GEMM arguments (cpp/sm90/gemm_args.cpp: stream_gemm_args_error,
// wgmma_gemm_args_error, gemm_kernel_error), on the host: a valid call of each kind passes, and each broken rule is
// refused with a message naming it. The wgmma arguments are checked as the binding builds them: the kernel instance
// (TMA or copied rows, stage K) set by plan_wgmma_stage first. (The pointers are never dereferenced: only their
// presence and alignment matter.)
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "megamoe/sm90_kernels.h"

using megamoe::sm90::Epilogue;
using megamoe::sm90::GemmKernel;
using megamoe::sm90::GroupedGemmCommon;
using megamoe::sm90::StreamGemmArgs;
using megamoe::sm90::WgmmaGemmArgs;

static int failures = 0;
static int checks = 0;

template <typename T>
static T* fake(uintptr_t addr) {
  return reinterpret_cast<T*>(addr);
}

// The common part of a gemm1 (silu_mul into fp32 h) of E = 8 experts, N = 2 * 512, K = 1024.
static void gemm1_common(GroupedGemmCommon& a) {
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
}

// A valid streaming gemm1.
static StreamGemmArgs gemm1() {
  StreamGemmArgs a;
  gemm1_common(a);
  a.tokens_per_pass = 8;
  return a;
}

static void report(const char* what, const char* err, const char* needle) {
  ++checks;
  const bool ok = needle ? err && std::strstr(err, needle) : err == nullptr;
  if (!ok) {
    std::printf("FAIL %s: got \"%s\", expected %s%s\n", what, err ? err : "(accepted)", needle ? "a message with " : "",
                needle ? needle : "acceptance");
    ++failures;
  }
}

static void expect(const char* what, const StreamGemmArgs& a, const char* needle) {
  report(what, megamoe::sm90::stream_gemm_args_error(a), needle);
}

// As the binding checks them: plan_wgmma_stage sets the kernel instance, then the rules.
static void expect(const char* what, WgmmaGemmArgs a, const char* needle) {
  megamoe::sm90::plan_wgmma_stage(a);
  report(what, megamoe::sm90::wgmma_gemm_args_error(a), needle);
}

static void broken(const char* what, const std::function<void(StreamGemmArgs&)>& f, const char* needle,
                   StreamGemmArgs (*base)() = gemm1) {
  StreamGemmArgs a = base();
  f(a);
  expect(what, a, needle);
}

// A valid wgmma gemm2 (store into fp32 out) of tile 64, N = 512, K = 1024.
static WgmmaGemmArgs wgmma_gemm2() {
  WgmmaGemmArgs a;
  gemm1_common(a);
  a.epilogue = Epilogue::kStore;
  a.w_gs_per_expert = 1;
  a.N = 512;
  a.max_total_rows = 64;
  a.tile = megamoe::sm90::kTile64;
  return a;
}

static void broken_wg(const char* what, const std::function<void(WgmmaGemmArgs&)>& f, const char* needle,
                      WgmmaGemmArgs (*base)() = wgmma_gemm2) {
  WgmmaGemmArgs a = base();
  f(a);
  expect(what, a, needle);
}

static StreamGemmArgs one_token_gemm1() {
  StreamGemmArgs a = gemm1();
  a.expert_offsets = nullptr;
  a.slot_experts = fake<const void>(0x70000);
  a.out = nullptr;
  a.out_operand = fake<uint16_t>(0x80000);
  a.act_rows = fake<const int32_t>(0x90000);
  a.entry_row_out = fake<int32_t>(0xA0000);
  return a;
}

// one_token_gemm1's common part on a wgmma plan (tile 32: its kPdl instances read the slots).
static WgmmaGemmArgs one_token_gemm1_on_wgmma() {
  WgmmaGemmArgs a;
  static_cast<GroupedGemmCommon&>(a) = one_token_gemm1();
  a.max_total_rows = 8;
  a.tile = megamoe::sm90::kTile32;
  return a;
}

// The streaming gemm2 (store into fp32 out) of the same shape.
static StreamGemmArgs gemm2() {
  StreamGemmArgs a = gemm1();
  a.epilogue = Epilogue::kStore;
  a.w_gs_per_expert = 1;
  a.N = 512;
  return a;
}

// The wgmma gemm1 (tile 64).
static WgmmaGemmArgs wgmma_gemm1() {
  WgmmaGemmArgs a;
  gemm1_common(a);
  a.max_total_rows = 64;
  a.tile = megamoe::sm90::kTile64;
  return a;
}

// A rule of the common part: refused the same by both families (on their gemm1, or with store on their gemm2).
static void common(const char* what, const std::function<void(GroupedGemmCommon&)>& f, const char* needle,
                   bool store = false) {
  StreamGemmArgs s = store ? gemm2() : gemm1();
  f(s);
  expect((std::string(what) + " (streaming)").c_str(), s, needle);
  WgmmaGemmArgs w = store ? wgmma_gemm2() : wgmma_gemm1();
  f(w);
  expect((std::string(what) + " (wgmma)").c_str(), w, needle);
}

int main() {
  using megamoe::sm90::kTile128;
  using megamoe::sm90::kTile32;
  using megamoe::sm90::kTile64;
  expect("streaming gemm1", gemm1(), nullptr);
  expect("streaming gemm2", gemm2(), nullptr);
  expect("wgmma gemm1", wgmma_gemm1(), nullptr);
  expect("wgmma gemm2", wgmma_gemm2(), nullptr);
  {
    StreamGemmArgs a = gemm1();  // gpt-oss: biases on both GEMMs, its activation on gemm1
    a.bias = fake<const float>(0xB0000);
    a.swiglu_alpha = 1.702f;
    a.swiglu_up_shift = 1.f;
    expect("gpt-oss gemm1", a, nullptr);
    WgmmaGemmArgs b = wgmma_gemm2();
    b.bias = fake<const float>(0xC0000);
    expect("gemm2 with a bias", b, nullptr);
  }
  for (int tpp : {16, 32, 64}) broken("tokens per pass", [&](StreamGemmArgs& a) { a.tokens_per_pass = tpp; }, nullptr);
  for (GemmKernel k : {GemmKernel::kStream, GemmKernel::kWgmma32, GemmKernel::kWgmma64, GemmKernel::kWgmma128})
    report("a plan's kernel", megamoe::sm90::gemm_kernel_error(k), nullptr);
  report("auto kernel", megamoe::sm90::gemm_kernel_error(GemmKernel::kAuto), "the plan's kernel");

  // the rules both families share
  common("K % 16", [](GroupedGemmCommon& a) { a.K = 1000; }, "K must be a positive multiple of 16");
  common("K 0", [](GroupedGemmCommon& a) { a.K = 0; }, "K must be");
  common("N 0", [](GroupedGemmCommon& a) { a.N = 0; }, "N (weight rows)");
  common("no act", [](GroupedGemmCommon& a) { a.act = nullptr; }, "act, w_data");
  common("no rows", [](GroupedGemmCommon& a) { a.expert_offsets = nullptr; }, "expert_offsets (grouped rows");
  common("grid 0", [](GroupedGemmCommon& a) { a.grid_experts = 0; }, "grid_experts");
  common("grid 65536", [](GroupedGemmCommon& a) { a.grid_experts = 65536; }, "grid_experts");
  common("silu_mul N", [](GroupedGemmCommon& a) { a.N = 1000; }, "I a multiple of 16");
  common("silu_mul scales", [](GroupedGemmCommon& a) { a.w_gs_per_expert = 1; }, "2 entries per expert");
  common("silu_mul bf16 out", [](GroupedGemmCommon& a) { a.out = nullptr; a.out_bf16 = fake<uint16_t>(0x60000); },
         "needs the store epilogue");
  common("two outputs", [](GroupedGemmCommon& a) { a.out_bf16 = fake<uint16_t>(0x60000); }, "one of out and out_bf16",
         true);
  common("no output", [](GroupedGemmCommon& a) { a.out = nullptr; }, "give out");
  common("operand out of store", [](GroupedGemmCommon& a) { a.out_operand = fake<uint16_t>(0x80000); },
         "out_operand (h as the gemm2 operand) needs the silu_mul", true);
  common("activation alpha on the store GEMM", [](GroupedGemmCommon& a) { a.swiglu_alpha = 1.702f; },
         "silu_mul epilogue only", true);
  common("up shift on the store GEMM", [](GroupedGemmCommon& a) { a.swiglu_up_shift = 1.f; }, "silu_mul epilogue only",
         true);
  common("clamp on the store GEMM", [](GroupedGemmCommon& a) { a.swiglu_clamp = true; }, "silu_mul epilogue only", true);
  common("h quantized without operand", [](GroupedGemmCommon& a) { a.h_quant_gs = fake<const float>(0x90000); },
         "h_quant_scale (h quantized to NVFP4) needs out_operand");
  // the tiled weight order (w_tiled): K % 256, rows in groups of 32 (silu_mul: each half), scale rows of K / 16
  common("tiled weights", [](GroupedGemmCommon& a) { a.w_tiled = true; }, nullptr);
  common("tiled weights, store", [](GroupedGemmCommon& a) { a.w_tiled = true; }, nullptr, true);
  common("tiled K % 256", [](GroupedGemmCommon& a) { a.w_tiled = true; a.K = 1152; a.w_scale_row_bytes = 80; },
         "w_tiled weights need K % 256 == 0");
  common("tiled I % 32", [](GroupedGemmCommon& a) { a.w_tiled = true; a.N = 2 * 48; }, "w_tiled weights need");
  common("tiled N % 32", [](GroupedGemmCommon& a) { a.w_tiled = true; a.N = 1008; }, "w_tiled weights need", true);
  common("tiled padded scale rows", [](GroupedGemmCommon& a) { a.w_tiled = true; a.w_scale_row_bytes = 80; },
         "scale rows of K / 16 bytes");
  {
    // sm90_weight_tile_offset: a bijection of [64 rows x 512 bytes] (K 1024) onto itself, each 32 x 128 block whole
    // and contiguous; the scale codes (64 bytes per row, chunks of 16) alike
    for (const int chunk : {128, 16}) {
      const int64_t row_bytes = chunk == 128 ? 512 : 64;
      std::vector<int> seen(size_t(64 * row_bytes), 0);
      bool runs = true;
      for (int64_t n = 0; n < 64; ++n)
        for (int64_t b = 0; b < row_bytes; ++b) {
          const int64_t o = megamoe::sm90::sm90_weight_tile_offset(n, b, row_bytes, chunk);
          if (o >= 0 && o < 64 * row_bytes) ++seen[size_t(o)];
          const int64_t tile0 = megamoe::sm90::sm90_weight_tile_offset(n - n % 32, b - b % chunk, row_bytes, chunk);
          runs = runs && o - tile0 == (n % 32) * chunk + b % chunk;
        }
      bool bijective = true;
      for (int v : seen) bijective = bijective && v == 1;
      report(chunk == 128 ? "tile offsets of the codes" : "tile offsets of the scale codes",
             bijective && runs ? nullptr : "not a bijection of whole tiles", nullptr);
    }
    report("tile offset of row 33, byte 130", megamoe::sm90::sm90_weight_tile_offset(33, 130, 512, 128) == 20610
           ? nullptr : "wrong offset", nullptr);
  }

  // the streaming kernels
  broken("slots with active experts", [](StreamGemmArgs& a) { a.active_experts = fake<const int32_t>(0xB0000); },
         "no active_experts or num_active", one_token_gemm1);
  broken("slots with num_active", [](StreamGemmArgs& a) { a.num_active = fake<const int32_t>(0xC0000); },
         "no active_experts or num_active", one_token_gemm1);
  broken("entry_row_out without slots", [](StreamGemmArgs& a) { a.entry_row_out = fake<int32_t>(0xA0000); },
         "entry_row_out");
  broken("tokens per pass 12", [](StreamGemmArgs& a) { a.tokens_per_pass = 12; }, "8, 16, 32 or 64");
  broken("tokens per pass 128", [](StreamGemmArgs& a) { a.tokens_per_pass = 128; }, "8, 16, 32 or 64");
  broken("slots with 16 tokens per pass", [](StreamGemmArgs& a) { a.tokens_per_pass = 16; }, "K % 64 == 0",
         one_token_gemm1);
  broken("slots with K % 64", [](StreamGemmArgs& a) { a.K = 1040; }, "K % 64 == 0", one_token_gemm1);
  broken("gather with quantized h, one tile",
         [](StreamGemmArgs& a) { a.out = nullptr; a.out_operand = fake<uint16_t>(0x80000);
                                 a.h_quant_gs = fake<const float>(0x90000); a.act_rows = fake<const int32_t>(0x90000); },
         "without act_rows on the one-tile streaming kernel");
  broken("gather with quantized h, 4 tiles",
         [](StreamGemmArgs& a) { a.out = nullptr; a.out_operand = fake<uint16_t>(0x80000); a.tokens_per_pass = 32;
                                 a.h_quant_gs = fake<const float>(0x90000); a.act_rows = fake<const int32_t>(0x90000); },
         nullptr);

  // one token's slots, the rules both families share: on the streaming gemm1 and on wgmma tile 32
  auto one_token = [](const char* what, const std::function<void(GroupedGemmCommon&)>& f, const char* needle) {
    StreamGemmArgs s = one_token_gemm1();
    f(s);
    expect((std::string(what) + " (streaming)").c_str(), s, needle);
    WgmmaGemmArgs w = one_token_gemm1_on_wgmma();
    f(w);
    expect((std::string(what) + " (wgmma)").c_str(), w, needle);
  };
  one_token("one token's gemm1", [](GroupedGemmCommon&) {}, nullptr);
  one_token("one token's W4A4 gemm1", [](GroupedGemmCommon& a) { a.act_rows = nullptr;
                                                                  a.h_quant_gs = fake<const float>(0x90000); },
            nullptr);
  one_token("one token's gemm2",
            [](GroupedGemmCommon& a) { a.epilogue = Epilogue::kStore; a.out_operand = nullptr; a.entry_row_out = nullptr;
                                       a.act_rows = nullptr; a.out_bf16 = fake<uint16_t>(0x60000); a.N = 512;
                                       a.w_gs_per_expert = 1; },
            nullptr);
  one_token("slots: fp32 h", [](GroupedGemmCommon& a) { a.out_operand = nullptr; a.out = fake<float>(0x60000); },
            "writes h into out_operand");
  one_token("slots: gather and quantized h", [](GroupedGemmCommon& a) { a.h_quant_gs = fake<const float>(0x90000); },
            "either gathers act");
  one_token("slots: staged rows, h not quantized", [](GroupedGemmCommon& a) { a.act_rows = nullptr; },
            "either gathers act");
  one_token("slots: store GEMM gathering",
            [](GroupedGemmCommon& a) { a.epilogue = Epilogue::kStore; a.out_operand = nullptr; a.entry_row_out = nullptr;
                                       a.out = fake<float>(0x60000); a.w_gs_per_expert = 1; },
            "the store GEMM reads staged rows");
  one_token("offsets and slots", [](GroupedGemmCommon& a) { a.expert_offsets = fake<const int32_t>(0x20000); },
            "not both");

  // the wgmma kernels: the slots on tile 32 only (its kPdl instances, tile 8 included, read them)
  for (int tile : {kTile64, kTile128}) {
    WgmmaGemmArgs a = one_token_gemm1_on_wgmma();
    a.tile = tile;
    expect(("slots on wgmma tile " + std::to_string(tile)).c_str(), a, "slot_experts runs on wgmma tile 32");
  }
  {
    WgmmaGemmArgs a = wgmma_gemm1();
    a.out = nullptr;
    a.out_operand = fake<uint16_t>(0x80000);
    a.entry_row_out = fake<int32_t>(0xA0000);
    expect("entry_row_out without slots on wgmma", a, "entry_row_out");
  }
  broken_wg("wgmma K step", [](WgmmaGemmArgs& a) { a.K = 1088; }, "K per stage");
  broken_wg("wgmma tile 128 K step 64", [](WgmmaGemmArgs& a) { a.K = 1088; a.tile = kTile128;
                                                               a.w_scale_row_bytes = 80; }, nullptr);
  broken_wg("wgmma tile 48", [](WgmmaGemmArgs& a) { a.tile = 48; }, "token tiles of 32, 64 or 128");
  broken_wg("wgmma experts", [](WgmmaGemmArgs& a) { a.num_experts = 1025; }, "at most 1024 experts");
  broken_wg("wgmma scale rows", [](WgmmaGemmArgs& a) { a.w_scale_row_bytes = 0; a.K = 128; }, "multiple of 16 bytes");
  broken_wg("wgmma short scale rows", [](WgmmaGemmArgs& a) { a.w_scale_row_bytes = 48; }, "at least K / 16");
  broken_wg("wgmma alignment", [](WgmmaGemmArgs& a) { a.w_data = fake<const uint8_t>(0x30008); }, "16-byte aligned");
  broken_wg("wgmma quantized h of gathered rows",
            [](WgmmaGemmArgs& a) { a.epilogue = Epilogue::kSiluMul; a.N = 1024; a.w_gs_per_expert = 2; a.out = nullptr;
                                   a.out_operand = fake<uint16_t>(0x80000); a.h_quant_gs = fake<const float>(0x90000);
                                   a.act_rows = fake<const int32_t>(0x90000); },
            "read by TMA");
  broken_wg("wgmma quantized h of unaligned rows",
            [](WgmmaGemmArgs& a) { a.epilogue = Epilogue::kSiluMul; a.N = 1024; a.w_gs_per_expert = 2; a.out = nullptr;
                                   a.out_operand = fake<uint16_t>(0x80000); a.h_quant_gs = fake<const float>(0x90000);
                                   a.act = fake<const uint16_t>(0x10008); },
            "read by TMA");
  broken_wg("wgmma tiles", [](WgmmaGemmArgs& a) { a.max_total_rows = int64_t(64) * 65535; }, "too many token tiles");

  // the kernel instance: plan_wgmma_stage gives the plan's (GemmPlan::stage_k_gemm1 / 2, copied_rows_gemm1), and
  // the rules refuse one that is not
  struct Stage {
    int tile;
    int64_t K;
    bool gathered, unaligned;
    bool act_tma;
    int stage_k;
  };
  for (const Stage& c : {Stage{kTile32, 1024, false, false, true, 256}, Stage{kTile32, 1024, true, false, false, 256},
                         Stage{kTile64, 1024, false, false, true, 256}, Stage{kTile64, 1152, false, false, true, 128},
                         Stage{kTile64, 1024, true, false, false, 128}, Stage{kTile64, 1024, false, true, false, 128},
                         Stage{kTile128, 1024, false, false, true, 128}, Stage{kTile128, 1088, false, false, true, 64},
                         Stage{kTile128, 1024, true, false, false, 64}}) {
    WgmmaGemmArgs a = wgmma_gemm2();
    a.tile = c.tile;
    a.K = c.K;
    a.w_scale_row_bytes = (c.K / 16 + 15) / 16 * 16;
    if (c.gathered) a.act_rows = fake<const int32_t>(0x90000);
    if (c.unaligned) a.act = fake<const uint16_t>(0x10008);
    megamoe::sm90::plan_wgmma_stage(a);
    const std::string what = "plan_wgmma_stage tile " + std::to_string(c.tile) + " K " + std::to_string(c.K) +
                             (c.gathered ? " gathered" : c.unaligned ? " unaligned" : "");
    ++checks;
    if (a.act_tma != c.act_tma || a.stage_k != c.stage_k) {
      std::printf("FAIL %s: act_tma %d stage_k %d, expected %d %d\n", what.c_str(), a.act_tma, a.stage_k, c.act_tma,
                  c.stage_k);
      ++failures;
    }
    report(what.c_str(), megamoe::sm90::wgmma_gemm_args_error(a), nullptr);
    WgmmaGemmArgs other = a;  // the tile's other K per stage
    other.stage_k = a.stage_k == megamoe::sm90::wg_stage_k(c.tile) ? megamoe::sm90::wg_min_stage_k(c.tile)
                                                                   : megamoe::sm90::wg_stage_k(c.tile);
    if (other.stage_k != a.stage_k)
      report((what + ", the other stage K").c_str(), megamoe::sm90::wgmma_gemm_args_error(other), "stage_k");
    if (!a.act_tma) {
      WgmmaGemmArgs tma = a;  // gathered or unaligned rows cannot come by TMA
      tma.act_tma = true;
      report((what + ", by TMA").c_str(), megamoe::sm90::wgmma_gemm_args_error(tma), "act_tma");
    }
  }
  {
    WgmmaGemmArgs a = wgmma_gemm1();  // copied rows of a contiguous act: allowed, with the smallest stage K
    a.act_tma = false;
    a.stage_k = megamoe::sm90::wg_min_stage_k(kTile64);
    report("wgmma copied contiguous rows", megamoe::sm90::wgmma_gemm_args_error(a), nullptr);
    a.out = nullptr;  // ... but not with h quantized (that kernel reads its rows by TMA)
    a.out_operand = fake<uint16_t>(0x80000);
    a.h_quant_gs = fake<const float>(0x90000);
    report("wgmma quantized h of copied rows", megamoe::sm90::wgmma_gemm_args_error(a), "read by TMA");
  }

  {
    // The launcher's grid choices at the shapes docs/PERFORMANCE.md works through (132 SMs): one token of v4-flash
    // (k = 6 of 256 experts, I = 2048, H = 4096) and v3 (k = 8, I = 2048, H = 7168), and eight tokens of v4-flash.
    using megamoe::sm90::kTile8;
    using megamoe::sm90::kTile32;
    using megamoe::sm90::plan_pair_row_blocks;
    using megamoe::sm90::plan_tile8;
    using megamoe::sm90::wg_tiles_bound;
    auto truth = [](const char* what, bool got, bool want) {
      ++checks;
      if (got != want) {
        std::printf("FAIL %s: %d, expected %d\n", what, int(got), int(want));
        ++failures;
      }
    };
    truth("tiles bound: one row each", wg_tiles_bound(kTile32, 6, 6) == 6, true);
    truth("tiles bound: rows / tile + experts", wg_tiles_bound(kTile32, 100, 2) == 6, true);
    truth("tiles bound of tile 8", wg_tiles_bound(kTile8, 48, 48) == 48 && wg_tiles_bound(kTile8, 64, 2) == 10, true);
    // gemm2 of tile 32 (128-row blocks): v4-flash one token 6 x 32 blocks fit 132 SMs x 2: unpaired; v3 6 x 56 and
    // v4-flash at eight tokens (48 tiles) do not: pairs
    truth("v4-flash T=1 gemm2 unpaired", plan_pair_row_blocks(kTile32, 32, 6, 132), false);
    truth("v3 T=1 gemm2 paired", plan_pair_row_blocks(kTile32, 56, 8, 132), true);
    truth("v4-flash T=8 gemm2 paired", plan_pair_row_blocks(kTile32, 32, 48, 132), true);
    truth("one block per SM in tile 64", plan_pair_row_blocks(megamoe::sm90::kTile64, 16, 9, 132), true);
    // tile 8: 64-row blocks (gemm1's silu_mul blocks: 32 columns of I; gemm2: 64 of H) against tile 32's 128-row ones
    truth("v4-flash T=1 gemm1 on tile 8", plan_tile8(6 * 64, 6 * 32, 132), true);    // 3 per SM, not 2 x 2
    truth("v4-flash T=1 gemm2 on tile 8", plan_tile8(6 * 64, 6 * 32, 132), true);
    truth("v3 T=1 gemm1 stays tile 32", plan_tile8(8 * 64, 8 * 32, 132), false);     // 512 blocks: not one wave
    truth("v3 T=1 gemm2 stays tile 32", plan_tile8(8 * 112, 8 * 56, 132), false);    // nor 896
    truth("one wave of tile 8 ends at 3 per SM", plan_tile8(396, 198, 132) && !plan_tile8(397, 199, 132), true);
    truth("two experts on tile 8", plan_tile8(2 * 64, 2 * 32, 132), true);           // 1 of 64 rows, not 1 of 128
    truth("v4-flash T=8 stays tile 32", plan_tile8(wg_tiles_bound(kTile8, 48, 48) * 64, 48 * 32, 132), false);
    // programmatic dependent launch for a grid of one wave: 3 blocks per SM in tile 8, 2 in tile 32, 1 in tiles 64, 128
    using megamoe::sm90::plan_pdl_launch;
    truth("pdl: tile 8 at 396 blocks", plan_pdl_launch(kTile8, 396, 132), true);
    truth("pdl: tile 8 at 397 blocks", plan_pdl_launch(kTile8, 397, 132), false);
    truth("pdl: v3 T=1 gemm2, 8 x 28 pairs", plan_pdl_launch(kTile32, 8 * 28, 132), true);
    truth("pdl: tile 32 at 265 blocks", plan_pdl_launch(kTile32, 265, 132), false);
    truth("pdl: tile 128 at 133 blocks", plan_pdl_launch(megamoe::sm90::kTile128, 133, 132), false);
    truth("pdl: never tiles 64 and 128", plan_pdl_launch(megamoe::sm90::kTile64, 100, 132) ||
                                             plan_pdl_launch(megamoe::sm90::kTile128, 1, 132), false);
  }

  std::printf("sm90 grouped-GEMM arguments: %d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
