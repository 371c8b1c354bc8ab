// MatMulQ4: Y[..., N] = X[..., K] @ W with W a Q4_1 matrix kept exactly (llama.cpp's block_q4_1:
// per block of 32 along K, w = d * q + m, q a 4-bit code, d and m the block's float16 scale and minimum).
//
// Note [MatMulQ4 layout]
// ~~~~~~~~~~~~~~~~~~~~~~
// The weight comes in three tensors, already in the kernel's order (python/ortkv/generate/weights.py,
// pack_matmul_q4, repacks the GGUF's blocks once at build time):
//   codes  uint8   [T, KB, 4, 16, 4]  (stored flat as [T, KB, 256])
//   scales float16 [T, KB, 16]        d
//   mins   float16 [T, KB, 16]        m
// with T = ceil(N / 16) tiles of 16 output columns and KB = K / 32 blocks. For tile t, block b, group g
// (0..3), column c (0..15) and byte j (0..3), the byte codes[t, b, g, c, j] holds the code of column
// n = 16 t + c at k = 32 b + 4 g + j in its low nibble and at k = 32 b + 16 + 4 g + j in its high nibble
// (ggml's own pairing within a block: element i low, i + 16 high). So one 64-byte line is 16 columns x 4
// consecutive k of the low half and 4 of the high half: a 32-bit lane of a zmm register is one column's 4
// products for vpdpbusd (or maddubs), a line is one vector load, and a tile's blocks follow each other:
// a tile streams through 256 + 32 + 32 = 320 contiguous-per-stream bytes per block (the GGUF's 20 bytes per
// block and column, nothing more). Columns past N in the last tile are zero (codes, d and m) and never
// stored. d and m stay float16: that is the GGUF's storage (exact, no conversion error) and half the scale
// bytes of float32 (the kernel is bound by the bytes it reads at one token); one vcvtph2ps per 16 values.
//
// Note [MatMulQ4 arithmetic]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// As llama.cpp's q4_1 x q8_1 dot: each 32-block of a row of X is quantized once per call to int8,
// a = round(x * 127 / amax) (round half to even; amax = max |x| over the block, a = 0 for an all-zero
// block) with the float scale e = amax / 127, and the block sum of the DEQUANTIZED values s = e * sum(a)
// is kept. Then
//   y[n] = sum_b ( d[n,b] * e[b] * sum_i q[n,b,i] a[b,i]  +  m[n,b] * s[b] )  =  x^ @ W  exactly (but for
// float rounding), x^ = e * a the dequantized activations. The minimum term must use x^'s sum, not x's:
// with the exact sum(x) the result is x^ @ (d q) + x @ m, whose error (x^ - x) @ (d q) is that of the
// UNcentred d q, while m ~ -8 d nearly cancels it in W (Note [Block sums as a MatMul] in builder.py); with
// s = e * sum(a) the error is (x^ - x) @ W, W's centred values. Teacher-forced top-1 agreement with
// llama.cpp (224 positions): exact float sums 211/224 (under the 95 % bar), s = e * sum(a) 217/224. The
// integer dot is exact; every ISA path runs the same quantization code, so the paths differ only in the
// order of the float additions.
//
// Note [MatMulQ4 activation terms]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Attribute act_terms = 2 quantizes each activation block into TWO int8 terms: a1 as above, then the
// rounding residual r = x - e1 a1 the same way (a2, e2), so x^ = e1 a1 + e2 a2, y sums d e1 q.a1 + d e2 q.a2
// + m (e1 sum(a1) + e2 sum(a2)). The activation error falls from ~e1 / 2 to ~e1 / 254 (float-like) for a
// second integer dot per block and row, ~1.4x the kernel's time at one thread on SmolLM2's shapes
// (benchmarks/bench_matmul_q4.py). The decoders use one term (llama.cpp's own arithmetic); the builder gives
// two where MatMulNBits would keep float activations (accuracy_level 0, tests).
//
// Note [MatMulQ4 dispatch]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Three copies of the tile kernel: AVX512-VNNI (vpdpbusd, 16 columns per zmm), AVX2 (vpmaddubsw +
// vpmaddwd, 8 columns per ymm, F16C for the scales) and portable scalar C++. Each SIMD copy is compiled
// under its own `#pragma GCC target` region, so the library loads on any x86-64, and the kernel picks
// the best the CPU reports (__builtin_cpu_supports) when the node is created. The node attribute `isa`
// ("auto", "avx512vnni", "avx2", "scalar") forces one (tests cover each path on one machine); a path the
// CPU cannot run is refused with E_INPUT at session creation, never silently replaced.
#pragma once
#include <cstdint>
#include <string>

#include "ortkv/cache_update.h"
#include "ortkv/status.h"

namespace ortkv {

constexpr int64_t kQ4Block = 32;       // Q4_1 block along K
constexpr int64_t kQ4TileCols = 16;    // output columns per tile
constexpr int64_t kQ4TileBytes = 256;  // codes per (tile, block): 16 columns x 32 codes / 2
constexpr int32_t kUint8 = 2;          // ONNX element type of the codes

enum class Q4Isa : int { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };

const char* Q4IsaName(Q4Isa isa);
bool Q4IsaSupported(Q4Isa isa);
Q4Isa Q4IsaBest();
// "auto" -> the best the CPU runs; a known name the CPU cannot run, or an unknown name: E_INPUT naming
// the node and the remedy.
Status ParseQ4Isa(const std::string& node, const std::string& name, Q4Isa* out);

struct MatMulQ4View {
  const float* x = nullptr;        // [M, K]
  const uint8_t* codes = nullptr;  // [T, KB, 256]
  const uint16_t* scales = nullptr;  // [T, KB, 16] float16 bits
  const uint16_t* mins = nullptr;    // [T, KB, 16] float16 bits
  float* y = nullptr;              // [M, N]
  int64_t M = 0, K = 0, N = 0;
  Q4Isa isa = Q4Isa::kScalar;
  int64_t act_terms = 1;  // int8 terms per activation block, 1 or 2 (Note [MatMulQ4 activation terms])
  // the quantized activations (Note [MatMulQ4 arithmetic]), owned by the caller
  int8_t* xq = nullptr;  // [M, KB, act_terms, 32]
  float* xe = nullptr;   // [M, KB, act_terms] scales e
  float* xs = nullptr;   // [M, KB] sums s

  int64_t blocks() const { return K / kQ4Block; }
  int64_t tiles() const { return (N + kQ4TileCols - 1) / kQ4TileCols; }
};

// Validates X / codes / scales / mins against the node's K and N (user-input errors name the tensor, the
// numbers and the remedy) and fills `view` except the activation buffers and y.
Status PlanMatMulQ4(const std::string& node, const TensorArg& x, const TensorArg& codes, const TensorArg& scales,
                    const TensorArg& mins, int64_t K, int64_t N, MatMulQ4View* view);

// Quantizes rows [m0, m1) of X into view.xq / xe / xs.
void MatMulQ4QuantizeRows(const MatMulQ4View& view, int64_t m0, int64_t m1);
// Computes Y for tiles [t0, t1) and every row (rows go 4 at a time over a tile: its weights are read once
// per 4 rows and stay in cache between them).
void MatMulQ4Tiles(const MatMulQ4View& view, int64_t t0, int64_t t1);

}  // namespace ortkv
