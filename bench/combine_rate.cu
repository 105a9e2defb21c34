// Bandwidth of the two bytes-bound kernels around the GEMMs at prefill, on one Hopper GPU: the combine (a token's k
// bf16 expert rows, weighted, summed in fp32) and the per-slot staging of x (scatter_bf16: a token's row copied into
// its k slot rows), at the shapes of the presets at T = 2048 and 8192, with the slot rows of a token spread over the
// buffer as align leaves them. The kernels are the product's own (this file includes their sources): the combine as
// launch_moe_combine picks it, and each of its kernels (one slot at a time, slots in batches, kCombineCols chunks per
// thread); the scatter beside a plain 16-byte copy of the same rows to the same places (its pattern's ceiling). Beside
// them: a device-to-device copy, a read-only and a write-only pass over the same bytes.
//
//   nvcc -O3 -std=c++17 --generate-code=arch=compute_90a,code=sm_90a -I cpp/include \
//        -o /tmp/combine_rate bench/combine_rate.cu && /tmp/combine_rate bench/results/combine_rate_h100.json
//
// Every combine kernel must give the bits of the one-slot kernel (the same sums in the same order): checked here, and
// the run fails otherwise.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "../cpp/sm90/combine.cu"
#include "../cpp/sm90/stage.cu"
#include "bench_record.h"

using namespace megamoe::sm90;

namespace combine_rate {

constexpr int kRuns = 31;

#define CHECK(x)                                                                               \
  do {                                                                                         \
    const cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

// Median of kRuns launches (CUDA events), in microseconds.
template <typename F>
float median_us(F&& launch) {
  launch();  // warm-up
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> ms(kRuns);
  for (float& m : ms) {
    CHECK(cudaEventRecord(e0));
    launch();
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    CHECK(cudaEventElapsedTime(&m, e0, e1));
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return ms[kRuns / 2] * 1e3f;
}

// Reads n 16-byte words once (a sum kept so that the loads stay).
__global__ void read_kernel(const uint4* p, int64_t n, uint32_t* sink) {
  uint32_t s = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    s ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (s == 0x9E3779B9u) *sink = s;
}

__global__ void write_kernel(uint4* p, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = make_uint4(uint32_t(i), 1u, 2u, 3u);
}

FILE* g_json = nullptr;
bool g_first = true;
int64_t g_tokens = 0;  // T of the rows being recorded

void record(const char* preset, const char* what, double us, double bytes, double copy_tbps) {
  const double tbps = bytes / (us * 1e-6) / 1e12;
  std::printf("%-9s T %5lld  %-36s %8.1f us  %7.1f MB  %5.2f TB/s  %5.1f%% of copy\n", preset, (long long)g_tokens,
              what, us, bytes / 1e6, tbps, 100.0 * tbps / copy_tbps);
  if (g_json)
    std::fprintf(g_json,
                 "%s\n    {\"preset\": \"%s\", \"T\": %lld, \"kernel\": \"%s\", \"us\": %.2f, \"bytes\": %.0f, "
                 "\"tbps\": %.3f, \"pct_copy\": %.1f}",
                 g_first ? "" : ",", preset, (long long)g_tokens, what, us, bytes, tbps, 100.0 * tbps / copy_tbps);
  g_first = false;
}

template <int kBatch>
float combine_us(const __nv_bfloat16* y, const int32_t* entry_row, const float* w, int64_t tokens, int k,
                 int64_t hidden, __nv_bfloat16* out) {
  const unsigned grid = grid_of(tokens * (hidden / 8), 256);
  return median_us([&] {
    combine_kernel<__nv_bfloat16, __nv_bfloat16, kBatch><<<grid, 256>>>(y, entry_row, w, tokens, k, hidden, out);
  });
}

// The scatter's pattern with no element reordering: each token's 16-byte chunks copied as they are into its k rows.
__global__ void scatter_copy_kernel(const uint4* src, int64_t tokens, const int32_t* dst_rows, int top_k,
                                    int64_t chunks, uint4* dst) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= tokens * chunks) return;
  const int64_t t = idx / chunks, c = idx - t * chunks;
  int32_t r[kSlotBatch];
#pragma unroll
  for (int u = 0; u < kSlotBatch; ++u) r[u] = u < top_k ? __ldg(dst_rows + t * top_k + u) : -1;
  const uint4 v = __ldg(src + idx);
#pragma unroll
  for (int u = 0; u < kSlotBatch; ++u)
    if (r[u] >= 0) store16(dst + int64_t(r[u]) * chunks + c, v);
}

bool same_bytes(const void* a, const void* b, size_t n) {
  std::vector<unsigned char> ha(n), hb(n);
  CHECK(cudaMemcpy(ha.data(), a, n, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hb.data(), b, n, cudaMemcpyDeviceToHost));
  return ha == hb;
}

// One preset at `tokens` tokens: entry_row a random permutation of the slot rows (align groups them by expert, so a
// token's rows are spread over the buffer), random bf16 rows and routing weights. Returns false on a mismatch.
bool run_preset(const char* preset, int64_t tokens, int k, int64_t hidden, double copy_tbps) {
  g_tokens = tokens;
  const int64_t slots = tokens * k;
  std::mt19937_64 rng(12345);
  std::vector<int32_t> perm(slots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<float> wts(slots);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (float& v : wts) v = u(rng);
  std::vector<uint16_t> yh(size_t(slots) * hidden);
  uint64_t st = rng();
  for (auto& v : yh) {  // bf16 of +-[2^-7, 2^-3), xorshift bits
    st ^= st << 13, st ^= st >> 7, st ^= st << 17;
    v = uint16_t(0x3C00u + (st & 0x7FFu)) ^ uint16_t((st >> 20 & 1u) << 15);
  }

  __nv_bfloat16 *y, *out_ref, *out;
  int32_t* entry_row;
  float* w;
  uint16_t *x, *staged;
  CHECK(cudaMalloc(&y, yh.size() * 2));
  CHECK(cudaMalloc(&out_ref, size_t(tokens) * hidden * 2));
  CHECK(cudaMalloc(&out, size_t(tokens) * hidden * 2));
  CHECK(cudaMalloc(&entry_row, slots * 4));
  CHECK(cudaMalloc(&w, slots * 4));
  CHECK(cudaMalloc(&x, size_t(tokens) * hidden * 2));
  CHECK(cudaMalloc(&staged, size_t(slots) * hidden * 2));
  CHECK(cudaMemcpy(y, yh.data(), yh.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(x, yh.data(), size_t(tokens) * hidden * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(entry_row, perm.data(), slots * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(w, wts.data(), slots * 4, cudaMemcpyHostToDevice));

  const size_t out_bytes = size_t(tokens) * hidden * 2;
  const double combine_bytes = double(slots) * hidden * 2 + double(out_bytes) + slots * 8.0;
  bool ok = true;
  CHECK(cudaMemset(out_ref, 0xFF, out_bytes));  // poisoned: every element must be written
  record(preset, "combine, one slot at a time", combine_us<1>(y, entry_row, w, tokens, k, hidden, out_ref),
         combine_bytes, copy_tbps);
  auto check = [&](const char* name, float us) {
    record(preset, name, us, combine_bytes, copy_tbps);
    if (!same_bytes(out, out_ref, out_bytes)) {
      std::printf("%s %s: output differs from one slot at a time\n", preset, name);
      ok = false;
    }
    CHECK(cudaMemset(out, 0xFF, out_bytes));
  };
  CHECK(cudaMemset(out, 0xFF, out_bytes));
  check("combine, slots 2 at a time", combine_us<2>(y, entry_row, w, tokens, k, hidden, out));
  check("combine, slots 4 at a time", combine_us<4>(y, entry_row, w, tokens, k, hidden, out));
  check("combine, slots 8 at a time", combine_us<8>(y, entry_row, w, tokens, k, hidden, out));
  if (hidden % (8 * 32 * kCombineCols) == 0) {
    char name[64];
    std::snprintf(name, sizeof name, "combine, %d chunks per thread", kCombineCols);
    const unsigned cgrid = grid_of(tokens * (hidden / 8) / kCombineCols, 256);
    check(name, median_us([&] {
            combine_cols_kernel<__nv_bfloat16><<<cgrid, 256>>>(y, entry_row, w, tokens, k, hidden, out);
          }));
  }
  check("combine, launch_moe_combine's pick", median_us([&] {
          CHECK(launch_moe_combine(y, true, entry_row, w, tokens, k, hidden, out, megamoe::ElemType::kBFloat16,
                                   nullptr));
        }));

  const unsigned sgrid = grid_of(tokens * (hidden / 8), 256);
  const double scatter_bytes = double(slots) * hidden * 2 + double(out_bytes) + slots * 4.0;
  record(preset, "scatter_bf16 (lane order)", median_us([&] {
           scatter_bf16_kernel<__nv_bfloat16><<<sgrid, 256>>>(reinterpret_cast<const __nv_bfloat16*>(x), hidden,
                                                              tokens, entry_row, k, hidden, staged, true);
         }),
         scatter_bytes, copy_tbps);
  record(preset, "scatter as a plain 16-byte copy", median_us([&] {
           scatter_copy_kernel<<<sgrid, 256>>>(reinterpret_cast<const uint4*>(x), tokens, entry_row, k, hidden / 8,
                                               reinterpret_cast<uint4*>(staged));
         }),
         scatter_bytes, copy_tbps);

  const int64_t words = slots * hidden * 2 / 16;
  uint32_t* sink;
  CHECK(cudaMalloc(&sink, 4));
  record(preset, "read-only pass over the k rows", median_us([&] {
           read_kernel<<<grid_of(words, 256), 256>>>(reinterpret_cast<const uint4*>(y), words, sink);
         }),
         double(words) * 16, copy_tbps);
  record(preset, "write-only pass over the k rows", median_us([&] {
           write_kernel<<<grid_of(words, 256), 256>>>(reinterpret_cast<uint4*>(staged), words);
         }),
         double(words) * 16, copy_tbps);
  for (void* p : {(void*)y, (void*)out_ref, (void*)out, (void*)entry_row, (void*)w, (void*)x, (void*)staged,
                  (void*)sink})
    CHECK(cudaFree(p));
  return ok;
}

}  // namespace combine_rate

using namespace combine_rate;

int main(int argc, char** argv) {
  HopperDevice dev;
  if (!query_hopper(dev)) return 1;
  // The copy ceiling: 2 GiB device to device (read + write), as bench/moe_bench.py measures it.
  const size_t copy_bytes = size_t(1) << 31;
  void *a, *b;
  CHECK(cudaMalloc(&a, copy_bytes));
  CHECK(cudaMalloc(&b, copy_bytes));
  const float copy_us = median_us([&] { CHECK(cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice)); });
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  const double copy_tbps = 2.0 * copy_bytes / (copy_us * 1e-6) / 1e12;
  std::printf("%s, %d SMs: copy %.2f TB/s (read + write)\n", dev.prop.name, dev.sms, copy_tbps);
  if (argc > 1) {
    g_json = open_record(argv[1],
                         "nvcc -O3 -std=c++17 --generate-code=arch=compute_90a,code=sm_90a -I cpp/include "
                         "-o /tmp/combine_rate bench/combine_rate.cu && /tmp/combine_rate",
                         dev);
    if (!g_json) return 1;
    std::fprintf(g_json,
                 "  \"copy_tbps\": %.3f,\n  \"method\": \"median of %d launches (CUDA events), bf16 rows, "
                 "a token's slot rows a random permutation of the buffer; bytes = rows read + rows written + slot "
                 "entries\",\n  \"results\": [",
                 copy_tbps, kRuns);
  }
  bool ok = true;
  for (const int64_t tokens : {2048, 8192}) {
    ok = run_preset("v4-flash", tokens, 6, 4096, copy_tbps) && ok;
    ok = run_preset("v3", tokens, 8, 7168, copy_tbps) && ok;
  }
  close_record(g_json);
  std::printf(ok ? "every combine batch gave the same bits\n" : "MISMATCH\n");
  return ok ? 0 : 2;
}
