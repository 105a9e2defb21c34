// docs/SPEC.md §2 checked against CuTe: the closed form in megamoe/sf_layout.hpp must equal
// Sm1xxBlockScaledConfig<16>::tile_atom_to_shape_SFA for every logical (m, k, b), and
// size(filter_zeros(layout)) must equal the padded size. Also checks that the map is
// injective over the logical coordinates (no two scales share a byte) and stays
// inside the padded buffer.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cute/tensor.hpp>
#include <cutlass/detail/sm100_blockscaled_layout.hpp>

#include "megamoe/sf_layout.hpp"

using namespace cute;
using Config = cutlass::detail::Sm1xxBlockScaledConfig<16>;

static int failures = 0;

static void check(int M, int K, int L) {
  const int kb = K / 16;
  const int64_t mt = (M + 127) / 128, kt = (kb + 3) / 4;
  auto layout = Config::tile_atom_to_shape_SFA(make_shape(M, 1, K, L));
  auto layout_b = Config::tile_atom_to_shape_SFB(make_shape(1, M, K, L));
  const int64_t padded = megamoe::sf_padded_bytes(M, kb);
  const int64_t cute_size = size(filter_zeros(layout));
  if (cute_size != padded * L || int64_t(cosize(filter_zeros(layout))) != padded * L) {
    std::printf("FAIL M=%d K=%d L=%d: size(filter_zeros)=%lld cosize=%lld, expected %lld\n", M, K, L,
                (long long)cute_size, (long long)cosize(filter_zeros(layout)), (long long)(padded * L));
    ++failures;
  }
  std::vector<int> hits(padded * L, 0);
  int bad = 0;
  for (int b = 0; b < L; ++b)
    for (int m = 0; m < M; ++m)
      for (int k = 0; k < kb; ++k) {
        const int64_t ours = megamoe::sf_offset(b, m, k, mt, kt);
        const int64_t theirs = layout(make_coord(m, k * 16, b));
        const int64_t theirs_b = layout_b(make_coord(m, k * 16, b));  // B uses the same atom over (N, K)
        if (ours != theirs || ours != theirs_b || ours < 0 || ours >= padded * L) {
          if (bad < 5)
            std::printf("FAIL M=%d K=%d L=%d at (m=%d,k=%d,b=%d): closed form %lld, CuTe SFA %lld, SFB %lld\n", M,
                        K, L, m, k, b, (long long)ours, (long long)theirs, (long long)theirs_b);
          ++bad;
          continue;
        }
        hits[ours]++;
      }
  for (int64_t i = 0; i < padded * L; ++i)
    if (hits[i] > 1) {
      if (bad < 5) std::printf("FAIL M=%d K=%d L=%d: byte %lld written %d times\n", M, K, L, (long long)i, hits[i]);
      ++bad;
    }
  if (bad) ++failures;
}

int main() {
  const int ms[] = {1, 7, 31, 32, 33, 127, 128, 129, 255, 256, 300, 464, 1000};
  const int ks[] = {16, 48, 64, 80, 128, 208, 256, 464, 1024, 2048, 7168};
  int cases = 0;
  for (int m : ms)
    for (int k : ks)
      for (int l : {1, 3}) {
        check(m, k, l);
        ++cases;
      }
  // Large MoE-like shapes, one batch.
  check(4096, 7168, 1);
  check(2 * 2048, 4096, 1);
  cases += 2;
  std::printf("%d shapes checked, %d failed\n", cases, failures);
  return failures ? 1 : 0;
}
