// Host-only check of the shared-memory layout of the warp-specialized wgmma kernel
// (cpp/sm90/grouped_gemm_wgmma_ws.cuh) against the PTX ISA model of what wgmma reads.
// Built and run by tests/test_sm90_ws_layout.py (needs nvcc; no GPU).
//
// Model (PTX ISA, "Matrix descriptor" / K-major canonical layout with 128-byte swizzle): for a
// descriptor with start address S (inside a 1024-aligned tile), stride byte offset 1024 and
// 128B swizzle, element (row, k) of a k16 slice (k < 16, bf16) is read at the address
// L = S + (row / 8) * 1024 + (row % 8) * 128 + 2k with address bits [4,7) XORed with bits [7,10).
// The kernels advance S by 32 bytes per k16 step (ks) inside the 128-byte rows.
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>

#include "../../cpp/sm90/grouped_gemm_wgmma_ws.cuh"

using megamoe::sm90::ws_sw128_offset;

static uint32_t swz(uint32_t a) { return a ^ (((a >> 7) & 7u) << 4); }
static int fails = 0;
#define CHECK(c, ...) do { if (!(c)) { if (fails++ < 10) { std::printf(__VA_ARGS__); std::printf("\n"); } } } while (0)

// Operand order: stored position p (0..7) of an 8-element group holds natural element perm(p).
static int perm(int p) { return (p & 1) ? (p >> 1) + 4 : (p >> 1); }

int main() {
  // 1) the store-side swizzle is the PTX 128B swizzle of the unswizzled row-major address
  for (uint32_t r = 0; r < 256; ++r)
    for (uint32_t c = 0; c < 8; ++c) CHECK(ws_sw128_offset(r, c) == swz(r * 128 + c * 16), "swizzle r=%u c=%u", r, c);

  // 2) producer activation chunks (P = 128 or 256 producer threads, kRowStep = P / 8): thread pt, i ->
  //    row (pt>>3) + kRowStep i, chunk pt & 7 at ws_sw128_offset(pt>>3, pt&7) + 128 kRowStep i; every
  //    (row < N, chunk) exactly once; the valid_chunks rule of ws_producer
  for (int P : {128, 256})
    for (int N : {32, 64, 96, 128, 160, 192, 224, 256}) {
      const int step = P / 8, chunks = N * 8 / P;
      CHECK(N * 8 % P == 0, "N=%d P=%d", N, P);
      std::vector<int> seen(N * 8, 0);
      for (int pt = 0; pt < P; ++pt)
        for (int i = 0; i < chunks; ++i) {
          const int r = (pt >> 3) + step * i, ch = pt & 7;
          CHECK(ws_sw128_offset(pt >> 3, ch) + 128u * step * i == ws_sw128_offset(r, ch), "act dst N=%d pt=%d i=%d", N, pt, i);
          seen[r * 8 + ch]++;
        }
      for (int x = 0; x < N * 8; ++x) CHECK(seen[x] == 1, "act chunk coverage P=%d N=%d chunk %d seen %d", P, N, x, seen[x]);
      for (int left = -40; left <= 300; ++left)  // left = rows - m0
        for (int r0 = 0; r0 < step; ++r0) {
          int want = 0;
          for (int i = 0; i < chunks; ++i) want += (r0 + step * i < left);
          int got = std::min(chunks, std::max(0, (left - r0 + step - 1) / step));
          CHECK(want == got, "valid_chunks P=%d N=%d left=%d r0=%d: %d vs %d", P, N, left, r0, got, want);
        }
    }

  // 2b) packed-weight copies and decode ownership: every (row, 16-byte half) of the 128 x 32-byte stage is
  //     copied exactly once, and (kPWG 2) each decoding thread copied its own half; every word decoded once.
  for (int pwg : {1, 2}) {
    const int P = 128 * pwg, words = 8 / pwg;
    std::vector<int> copied(256, 0), decoded(128 * 8, 0);
    for (int pt = 0; pt < P; ++pt) {
      const int lane = pt & 31, half = lane & 1;
      const int lr0 = pwg == 1 ? (pt & ~31) + (lane >> 1) : (pt >> 1);
      copied[lr0 * 2 + half]++;
      if (pwg == 1) copied[(lr0 + 16) * 2 + half]++;
      const int d_row = pt / pwg, w0 = (pt % pwg) * words;
      for (int j = 0; j < words; ++j) decoded[d_row * 8 + w0 + j]++;
      if (pwg == 2) CHECK(lr0 == d_row && half * 4 == w0, "kPWG 2: thread %d decodes bytes it did not copy", pt);
      // the copy of the row a thread decodes comes from a lane of the same warp
      if (pwg == 1) CHECK(((d_row & ~31) == (pt & ~31)), "copy of row %d outside warp", d_row);
    }
    for (int x = 0; x < 256; ++x) CHECK(copied[x] == 1, "kPWG %d: row half %d copied %d times", pwg, x, copied[x]);
    for (int x = 0; x < 128 * 8; ++x) CHECK(decoded[x] == 1, "kPWG %d: word %d decoded %d times", pwg, x, decoded[x]);
  }

  // 3) one 64-K stage end to end: weights decoded word c -> chunk c in pair order (n_j, n_j+4),
  //    activations copied chunk-wise in operand order; emulated wgmma (both consumers, all N)
  //    must equal the plain dot product over natural k. Small integers: exact in float.
  srand(7);
  const int R = 128, KS = 64, NMAX = 256;
  std::vector<int> W(R * KS), X(NMAX * KS);
  for (auto& v : W) v = rand() % 13 - 6;
  for (auto& v : X) v = rand() % 11 - 5;
  std::vector<float> wt(R * 64, 0.f), at(NMAX * 64, 0.f);  // bf16 tiles, one float per 2-byte slot
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 8; ++c)      // packed word c = natural elements 8c..8c+7
      for (int j = 0; j < 4; ++j) {  // dequant_word: p[j] = (n_j, n_{j+4}), low half first
        const uint32_t byte = ws_sw128_offset(r, c) + 4 * j;
        wt[byte / 2] = float(W[r * KS + 8 * c + j]);
        wt[byte / 2 + 1] = float(W[r * KS + 8 * c + j + 4]);
      }
  for (int n = 0; n < NMAX; ++n)
    for (int ch = 0; ch < 8; ++ch)  // global chunk ch of an operand-order row -> swizzled chunk
      for (int p = 0; p < 8; ++p) at[(ws_sw128_offset(n, ch) + 2 * p) / 2] = float(X[n * KS + 8 * ch + perm(p)]);
  for (int N : {32, 64, 96, 128, 160, 192, 224, 256})
    for (int cw = 0; cw < 2; ++cw)
      for (int m = 0; m < 64; ++m)
        for (int n = 0; n < N; ++n) {
          double acc = 0, ref = 0;
          for (int ks = 0; ks < 4; ++ks)
            for (int k = 0; k < 16; ++k) {
              const uint32_t la = cw * 64 * 128 + ks * 32 + (m / 8) * 1024 + (m % 8) * 128 + 2 * k;  // A desc start: cw*8192 + 32 ks
              const uint32_t lb = ks * 32 + (n / 8) * 1024 + (n % 8) * 128 + 2 * k;
              acc += double(wt[swz(la) / 2]) * at[swz(lb) / 2];
            }
          for (int k = 0; k < KS; ++k) ref += double(W[(64 * cw + m) * KS + k]) * X[n * KS + k];
          CHECK(acc == ref, "gemm N=%d cw=%d m=%d n=%d: %f vs %f", N, cw, m, n, acc, ref);
        }
  if (fails) {
    std::printf("ws layout check: %d FAILURES\n", fails);
    return 1;
  }
  std::printf("ws layout check: ok\n");
  return 0;
}
