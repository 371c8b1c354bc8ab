// Tensor-core tiles of 16 keys for the decode attention kernels (dense CacheAttention v3, Note [CacheAttention
// CUDA v3]; PagedCacheAttention v3, Note [Paged CUDA v3]): the swizzled 16-bit tile layout in shared memory,
// ldmatrix / mma.sync m16n8k16 wrappers and one tile's products with the online softmax.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cooperative_groups.h>
#include <cstdint>

#include "device_common.cuh"

namespace ortkv {
namespace {
namespace tile16 {

constexpr int kTile = 16;  // keys per tile

// byte offset of 16-byte chunk ch of row r in a swizzled tile
template <int D>
__device__ __forceinline__ int Sw(int r, int ch) {
  return r * (D * 2) + ((ch ^ (r & 7)) << 4);
}

__device__ __forceinline__ void LdMatrix4(unsigned addr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrix4T(unsigned addr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// c += a * b, m16n8k16, a1 = a3 = 0 (rows 8..15 of A are padding)
template <bool BF>
__device__ __forceinline__ void Mma(float* c, uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  const uint32_t z = 0;
  if constexpr (BF) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(z), "r"(a2), "r"(z), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(z), "r"(a2), "r"(z), "r"(b0), "r"(b1));
  }
}
template <bool BF>
__device__ __forceinline__ uint32_t Pack2(float x, float y) {
  if constexpr (BF) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// The query side of both v3 kernels, in two steps so that the load can overlap the kernel's read of `start`:
// LoadQueryPairs reads this lane's raw 16-bit pairs of the mma's A fragments (row g = lane / 4 is query head
// g0 + g of the block, zeros for g >= gn, the padding rows; columns 2 * (lane % 4) + {0, 1} of each 8-column half
// of every 16-column k step), qp pointing at row g's query; QueryFragments then scales them by qscale
// (a.scale * log2 e: base-2 scores) in float and rounds them back to 16 bits.
template <typename T, int D>
__device__ __forceinline__ void LoadQueryPairs(const T* qp, int g, int gn, int c, uint32_t (*qr)[2]) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      qr[ks][h] = g < gn ? *reinterpret_cast<const uint32_t*>(qp + ks * 16 + h * 8 + 2 * c) : 0u;
}
template <bool BF, int D>
__device__ __forceinline__ void QueryFragments(const uint32_t (*qr)[2], float qscale, uint32_t (*qa)[2]) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float2 f;
      if constexpr (BF) {
        f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qr[ks][h]));
      } else {
        f = __half22float2(*reinterpret_cast<const __half2*>(&qr[ks][h]));
      }
      qa[ks][h] = Pack2<BF>(f.x * qscale, f.y * qscale);
    }
}

// Zeroes the value rows of a 16-bit tile that are not in `valid`.
template <int D>
__device__ __forceinline__ void ZeroInvalidV(uint8_t* st, int lane, uint32_t valid) {
  constexpr int kCh = D / 8;
#pragma unroll
  for (int i = lane; i < kTile * kCh; i += 32) {
    const int r = i / kCh, ch = i % kCh;
    if (!((valid >> r) & 1u)) *reinterpret_cast<uint4*>(st + kTile * D * 2 + Sw<D>(r, ch)) = make_uint4(0u, 0u, 0u, 0u);
  }
  __syncwarp();
}

// The online softmax's lazy rescale for the query-head row of a quad of lanes: mx is this lane's max over its keys
// of the tile (or step); the quad's max, when above m, rescales l, o (row g's C fragments) and *extra by 2^(m - mx)
// and becomes m. The tile holds a valid key, so that max is finite.
template <int D>
__device__ __forceinline__ void QuadMaxRescale(float mx, float& m, float& l, float (*o)[4], float* extra = nullptr) {
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  if (mx > m) {
    const float corr = Exp2(m - mx);
    l *= corr;
    if (extra != nullptr) *extra *= corr;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      o[nt][0] *= corr;
      o[nt][1] *= corr;
    }
    m = mx;
  }
}

// The tile's products: s = Q K^T for its 16 keys, the online softmax, o += P V. BF: bf16 operands.
template <bool BF, int D>
__device__ __forceinline__ void TileProducts(const uint8_t* st, const uint32_t (*qa)[2], int lane, uint32_t valid,
                                             float& m, float& l, float (*o)[4]) {
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(st));
  float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  {
    const int r = ((lane >> 4) << 3) + (lane & 7);  // key row this lane addresses
    const int hi = (lane >> 3) & 1;                 // second 8 dims of the k-step
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t b[4];
      LdMatrix4(base + Sw<D>(r, 2 * ks + hi), b);
      Mma<BF>(s[0], qa[ks][0], qa[ks][1], b[0], b[1]);
      Mma<BF>(s[1], qa[ks][0], qa[ks][1], b[2], b[3]);
    }
  }
  const int c = lane & 3;
  float mx = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = nt * 8 + 2 * c + e;
      s[nt][e] = ((valid >> key) & 1u) ? s[nt][e] : -INFINITY;
      mx = fmaxf(mx, s[nt][e]);
    }
  QuadMaxRescale<D>(mx, m, l, o);
  float p[2][2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      p[nt][e] = Exp2(s[nt][e] - m);  // 0 for an invalid key
      l += p[nt][e];
    }
  const uint32_t pa0 = Pack2<BF>(p[0][0], p[0][1]), pa2 = Pack2<BF>(p[1][0], p[1][1]);
  {
    const int r = (((lane >> 3) & 1) << 3) + (lane & 7);  // key row
    const int hi = lane >> 4;                              // second n-tile of the pair
#pragma unroll
    for (int nt2 = 0; nt2 < D / 16; ++nt2) {
      uint32_t b[4];
      LdMatrix4T(base + kTile * D * 2 + Sw<D>(r, 2 * nt2 + hi), b);
      Mma<BF>(o[2 * nt2], pa0, pa2, b[0], b[1]);
      Mma<BF>(o[2 * nt2 + 1], pa0, pa2, b[2], b[3]);
    }
  }
}


// The key loop of a decode block whose pages (or dense rows) are all in the tile's 16-bit type (dense v3, Note
// [CacheAttention CUDA v3]; the uniform paged kernel, Note [Paged CUDA uniform 16-bit]): warp w's tiles w, w + NW,
// ... of the block's keys [j0, j1) (`mine` of them) stream through its ring of ST slots of STAGE bytes, where
// `issue` has put the first ST - 1 in flight and puts one more per tile (one cp.async group each, empty or not).
// A tile's rows at or past j1 get zero values and -inf scores. The query fragments come from the raw pairs qr
// (scale folded in); (m, l, o) leave as the warp's online-softmax state in base 2 with l summed over the quad,
// every copy landed (the caller's barrier then frees the ring).
template <bool BF, int D, int NW, int ST, int STAGE, typename Issue>
__device__ __forceinline__ void StreamWarpTiles(uint8_t* wring, const uint32_t (*qr)[2], float qscale, int64_t j0,
                                                int64_t j1, int mine, int warp, int lane, Issue& issue, float& m,
                                                float& l, float (*o)[4]) {
  uint32_t qa[D / 16][2];
  QueryFragments<BF, D>(qr, qscale, qa);
  m = -INFINITY, l = 0.0f;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  int stage = 0;
  for (int it = 0; it < mine; ++it, stage = stage + 1 == ST ? 0 : stage + 1) {
    CpAsyncWait<ST - 2>();
    __syncwarp();  // this tile's copies landed for the whole warp; the slot refilled next was read
    issue();
    const int64_t k0 = j0 + static_cast<int64_t>(warp + it * NW) * kTile;
    const uint32_t valid = k0 + kTile <= j1 ? 0xFFFFu : (1u << static_cast<int>(j1 - k0)) - 1u;
    uint8_t* sg = wring + stage * STAGE;
    if (valid != 0xFFFFu) ZeroInvalidV<D>(sg, lane, valid);
    TileProducts<BF, D>(sg, qa, lane, valid, m, l, o);
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  CpAsyncWait<0>();
}

// The merge half of MergeWarpTiles (below), for callers that store their warps' states into mg themselves (the paged
// uniform INT4 / INT8 kernel's transposed windows: Note [Uniform transposed finish]), a barrier after the stores.
template <int NW, int D, typename Emit>
__device__ __forceinline__ void MergeWarpStates(const WarpMerge<NW, 8>& mg, int gn, Emit emit) {
  const int tid = threadIdx.x;
  for (int x = tid; x < gn * D; x += NW * 32) {
    const int gg = x / D, d = x % D;
    float mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mb = fmaxf(mb, mg.m[w][gg]);
    float lb = 0.0f, ab = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float mw = mg.m[w][gg];
      const float f = mw == -INFINITY ? 0.0f : Exp2(mw - mb);
      lb += mg.l[w][gg] * f;
      ab += mg.acc[w][gg][d] * f;
    }
    emit(gg, d, mb, lb, ab);
  }
}
// The end of a block of NW tile-streaming warps (dense and paged v3): each warp's online-softmax state of the 8
// query-head rows of its mma tiles (row g = lane / 4: m, l summed over the row's quad, o in the C fragments)
// goes into mg (shared memory the caller freed with a barrier), then, after one barrier, every (head gg < gn,
// element d) of the block gets the warps' merged (mb, lb, ab), base 2, through emit(gg, d, mb, lb, ab).
// dim(nt, n): the head element that column n of the C fragments' n-tile nt holds (nt * 8 + n for the tiles above;
// the paged kernel's register-decoded values permute it, Note [Paged CUDA v3 register decode]).
template <int NW, int D, typename Emit, typename DimMap>
__device__ __forceinline__ void MergeWarpTiles(WarpMerge<NW, 8>& mg, float m, float l, const float (*o)[4], int gn,
                                               Emit emit, DimMap dim) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
  if (c == 0) {
    mg.m[warp][g] = m;
    mg.l[warp][g] = l;
  }
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    mg.acc[warp][g][dim(nt, 2 * c)] = o[nt][0];
    mg.acc[warp][g][dim(nt, 2 * c + 1)] = o[nt][1];
  }
  __syncthreads();
  MergeWarpStates<NW, D>(mg, gn, emit);
}
template <int NW, int D, typename Emit>
__device__ __forceinline__ void MergeWarpTiles(WarpMerge<NW, 8>& mg, float m, float l, const float (*o)[4], int gn,
                                               Emit emit) {
  MergeWarpTiles<NW, D>(mg, m, l, o, gn, emit, [](int nt, int n) { return nt * 8 + n; });
}

// Note [Cluster merge]
// ~~~~~~~~~~~~~~~~~~~~
// A decode step's short rows split over 2..8 blocks would need a second launch to merge the splits (a combine over a
// partial workspace). Launched as one thread-block cluster per unit (split = rank; LaunchEx, sm_90+), the blocks merge
// through distributed shared memory instead: each leaves its merged (acc[D], m, l) of its gn query heads in `fin`
// ([8][D + 2] floats of its own shared memory), and rank 0 reads every rank's and writes the output rows (out_row(gg):
// head gg's row). `after(cluster, flagged)` runs on rank 0's threads after that merge, still between the two cluster
// barriers (Note [Cluster merge flag]), where the other ranks' shared memory may be read too (the paged kernels take
// the smallest failure key there). A head whose chunks hold no key (m = -inf everywhere: a refused row) gets zeros.
// Serves dense CacheAttention v3 (Note [CacheAttention CUDA v3]) and PagedCacheAttention v3 / uniform (Note [Paged CUDA
// cluster merge]).
//
// Note [Cluster merge loads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Rank 0 reads the other ranks' (m, l, acc) through distributed shared memory. In a loop over the runtime rank count
// each load waited for the one before (2 S round trips per output value: the max over m, then l and acc); unrolled
// to kMaxClusterRanks with the absent ranks predicated off, the loads of all ranks are in flight together (one round
// trip). H200 harnesses (benchmarks/cuda/attention_sweep.cu, paged_sweep.cu; SmolLM2 heads; us per node, before ->
// after): dense CacheAttention v3 1K keys x 1 row (4 ranks) 4.93 -> 4.41, 128 keys in a 2K cache (8 ranks) 4.43 ->
// 3.76; PagedCacheAttention uniform F16 1K x 1 5.63 -> 5.06, INT4 pages 1K x 1 7.05 -> 6.27, 128 keys in a 2K table
// 6.79 -> 5.85 (benchmarks/results/paged_attention_cuda_h200.md, 2026-12-04).
//
// Note [Cluster merge flag]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// `after(cluster, flagged)` runs on rank 0's threads after its merge, still between the barriers; `flagged` is true in
// a thread whose first output element saw a NaN l in some rank's `fin` (rank 0's thread 0: head 0). The paged kernels
// (Note [Paged CUDA cluster merge]) use it to learn, from loads the merge makes anyway, that a rank failed: a block
// with a bad page leaves m = -inf (the merge skips it) and l = NaN, and only then (or with a bad `start`, which every
// rank of a row sees alike) does thread 0 read the ranks' failure keys. The keys used to be read in every node, before
// the merge (a `rank0` hook, since removed), a round trip of distributed shared memory on rank 0's thread 0 ahead of
// its merge loads; loading them together with the merge's instead, and using them after it, was slower still (+0.18 us
// at 512 / 1K keys x 1 row). H100 harness (`sweep_ab.py --rounds 5 h=... flag=... -- 20 11,5,9,4,8,0 F84`, uniform
// kernels with static tables, us, before -> after): F16 512 x 1 5.07 -> 4.87, 1K x 1 4.96 -> 4.82, 128 keys in a 2K
// table 4.75 -> 4.56; INT4 5.11 -> 4.93, 5.18 -> 5.06, 4.92 -> 4.75; nodes without a cluster (16 / 128 / 8K keys x 1)
// unchanged. A harness build without any failure key or report (not a valid kernel: the floor) was 4.77 / 4.71 / 4.46
// us for F16. Through ORT (bench_paged_attention_cuda.py --rounds 9, H100), F16 static pages / dense at 512 / 1K keys x
// 1 row and 1K keys in a 2K table: 1.15 / 1.12 / 1.11 -> 1.09 / 1.08 / 1.08
// (benchmarks/results/paged_attention_cuda_h200.md, twenty-fifth session).
// A block's merged (acc, m, l) of head gg, element d (MergeWarpTiles' emit) into its `fin`, the layout ClusterMerge
// reads: [8][D + 2] floats, acc then m, l (at the compile-time head size: shared-memory stores).
template <int D>
__device__ __forceinline__ void StoreFin(float* fin, int gg, int d, float mb, float lb, float ab) {
  fin[gg * (D + 2) + d] = ab;
  if (d == 0) {
    fin[gg * (D + 2) + D] = mb;
    fin[gg * (D + 2) + D + 1] = lb;
  }
}
constexpr int kMaxClusterRanks = 8;  // the portable cluster size: every launch's splits are at most this
template <typename T, int D, typename OutRow, typename After>
__device__ __forceinline__ void ClusterMerge(float* fin, int S, int gn, int tid, int nthreads, OutRow out_row,
                                             After after) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cl = cg::this_cluster();
  cl.sync();  // every rank's fin is written
  if (cl.block_rank() == 0) {
    // every rank's three values are loaded before any is used (Note [Cluster merge loads])
    const float* fr[kMaxClusterRanks];
#pragma unroll
    for (int r = 0; r < kMaxClusterRanks; ++r) fr[r] = cl.map_shared_rank(fin, r < S ? r : 0);
    bool flagged = false;  // some rank's l of this thread's first head is NaN (Note [Cluster merge flag])
    for (int x = tid; x < gn * D; x += nthreads) {
      const int gg = x / D, d = x % D;
      float mr[kMaxClusterRanks], lr[kMaxClusterRanks], ar[kMaxClusterRanks];
#pragma unroll
      for (int r = 0; r < kMaxClusterRanks; ++r) {
        mr[r] = -INFINITY, lr[r] = ar[r] = 0.0f;
        if (r < S) {
          const float* f = fr[r] + gg * (D + 2);
          mr[r] = f[D], lr[r] = f[D + 1], ar[r] = f[d];
        }
      }
      if (x == tid) {
#pragma unroll
        for (int r = 0; r < kMaxClusterRanks; ++r) flagged |= lr[r] != lr[r];
      }
      float mx = -INFINITY;
#pragma unroll
      for (int r = 0; r < kMaxClusterRanks; ++r) mx = fmaxf(mx, mr[r]);
      float num = 0.0f, den = 0.0f;
#pragma unroll
      for (int r = 0; r < kMaxClusterRanks; ++r) {
        if (mr[r] == -INFINITY) continue;  // a chunk with no keys, or no such rank
        const float wr = Exp2(mr[r] - mx);
        den += wr * lr[r];
        num += wr * ar[r];
      }
      out_row(gg)[d] = FromF<T>(den > 0.0f ? num / den : 0.0f);
    }
    after(cl, flagged);  // still between the barriers: the other ranks' shared memory may be read
  }
  cl.sync();  // nobody leaves before rank 0 has read its shared memory
#endif
}
template <typename T, int D, typename OutRow>
__device__ __forceinline__ void ClusterMerge(float* fin, int S, int gn, int tid, int nthreads, OutRow out_row) {
  ClusterMerge<T, D>(fin, S, gn, tid, nthreads, out_row, [](auto&, bool) {});
}

}  // namespace tile16
}  // namespace
}  // namespace ortkv
