// What the CUDA benchmark programs (bench/*.cu) share: the Hopper GPU they need, and the head and tail of the JSON
// record they write (the fields every bench/results/*.json has: command, date, device, versions).
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <ctime>

struct HopperDevice {
  cudaDeviceProp prop;
  int sms = 0, driver = 0, runtime = 0;
};

// Device 0 and the CUDA versions; false, with the reason on stderr, where it is not a Hopper GPU (sm_90a).
inline bool query_hopper(HopperDevice& d) {
  cudaError_t e = cudaGetDeviceProperties(&d.prop, 0);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, 0);
  if (e == cudaSuccess) e = cudaDriverGetVersion(&d.driver);
  if (e == cudaSuccess) e = cudaRuntimeGetVersion(&d.runtime);
  if (e != cudaSuccess) {
    std::fprintf(stderr, "needs a Hopper GPU (sm_90a): %s\n", cudaGetErrorString(e));
    return false;
  }
  if (d.prop.major != 9) {
    std::fprintf(stderr, "needs a Hopper GPU (sm_90a), found %s (sm_%d%d)\n", d.prop.name, d.prop.major, d.prop.minor);
    return false;
  }
  return true;
}

// Opens the record at `path` and writes its head up to the versions: the command (`command`, then `path`), the date
// (UTC), the device, its SMs and the CUDA versions. The caller writes its own fields after it, then "results": [.
// nullptr, with the reason on stderr, where the file cannot be opened.
inline FILE* open_record(const char* path, const char* command, const HopperDevice& d) {
  FILE* f = std::fopen(path, "w");
  if (!f) {
    std::perror(path);
    return nullptr;
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::fprintf(f,
               "{\n  \"command\": \"%s %s\",\n  \"date\": \"%s\",\n  \"device\": \"%s\",\n  \"sms\": %d,\n"
               "  \"versions\": {\"cuda_driver\": %d, \"cuda_runtime\": %d},\n",
               command, path, date, d.prop.name, d.sms, d.driver, d.runtime);
  return f;
}

// Ends the results list and the record, and closes it (nothing where f is null).
inline void close_record(FILE* f) {
  if (!f) return;
  std::fprintf(f, "\n  ]\n}\n");
  std::fclose(f);
}
