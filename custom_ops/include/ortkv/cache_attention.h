// CacheAttention: grouped-query attention of T new queries over a dense cache read in place.
//
// Note [CacheAttention]
// ~~~~~~~~~~~~~~~~~~~~~
// query  [B, T, Hq * D]; key/value cache [B, C, Hkv, D] (BSNH, seq_axis 1) or [B, Hkv, C, D] (BNSH);
// start  [B] (or a scalar): the position of the first new token of each row, i.e. the number of
// tokens the row held before this block (CacheUpdate wrote the block at [start, start + T)).
// Query t of row b attends to keys [0, start_b + t] (causal inside the new block); nothing past a
// row's own valid length is read, so rows of different lengths share one batch and no Slice or
// Concat of the cache is needed. Query head h reads KV head h / (Hq / Hkv).
//   out[b, t, h*D:(h+1)*D] = sum_j softmax_j(scale * q . k_j) v_j
//
// Note [CacheAttention CPU split-K]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Decode is memory-bound: each key and value row must be read from memory exactly once per call,
// and every core must be reading. One unit of work is a (row, KV head, query token); it serves all
// G = Hq / Hkv query heads of the group, so K/V are read once per group, not once per query head.
// A unit's keys go by in blocks of kBlockKeys (K and V block in L1) with an online softmax (running
// max m, sum l and unnormalized accumulator per head: one pass, no score array the size of the cache).
// When there are fewer units than there is parallelism to fill (decode of one sequence: B * Hkv * 1
// units), each unit's keys are split into `splits` chunks of >= kMinSplitKeys keys (flash-decoding):
// task (unit, chunk) writes its (m, l, acc) partial, and CacheAttentionCombine merges the chunks of
// every unit after all tasks ran. With splits == 1 a task normalizes straight into the output.
#pragma once
#include <cstdint>
#include <string>

#include "ortkv/cache_update.h"
#include "ortkv/status.h"

namespace ortkv {

constexpr int64_t kAttnBlockKeys = 64;    // keys per block: 16 KiB of K + 16 KiB of V at D = 64
constexpr int64_t kAttnMinSplitKeys = 256;  // a split-K chunk reads at least this many keys
constexpr int64_t kAttnTargetTasks = 24;    // split until there are this many tasks (divides 2, 3, 4, 6, 8)
constexpr int64_t kCpuTileLanes = 64;       // a CPU query tile's rows at most (Note [Paged CPU query tiles])

struct CacheAttentionView {
  const float* q = nullptr;    // [B, T, Hq * D]
  const float* k = nullptr;    // cache, see strides
  const float* v = nullptr;    // cache, same layout as k
  float* out = nullptr;        // [B, T, Hq * D]
  const int64_t* start = nullptr;
  int64_t start_stride = 0;    // 0: one start for all rows; 1: one per row
  int64_t B = 0, T = 0, Hq = 0, Hkv = 0, D = 0, C = 0;
  int64_t row_stride = 0, tok_stride = 0, head_stride = 0;  // elements, in k and v
  float scale = 1.0f;
  int64_t splits = 1;          // key chunks per unit (Note [CacheAttention CPU split-K])
  int64_t tile = 1;            // query tokens per unit (Note [Paged CPU query tiles]); > 1 only with splits == 1
  float* partial = nullptr;    // splits > 1: partial_floats() floats, owned by the caller

  int64_t tiles() const { return (T + tile - 1) / tile; }
  int64_t units() const { return B * Hkv * tiles(); }  // one unit: one (row, kv head, query token or tile)
  int64_t tasks() const { return units() * splits; }  // one task: one key chunk of a unit
  int64_t group() const { return Hq / Hkv; }
  int64_t partial_floats() const { return splits > 1 ? tasks() * group() * (D + 2) : 0; }
  int64_t scratch_floats() const {  // scores, scaled q, acc, m, l; a tile's qt, ot, scores and an output row
    return tile > 1 ? kCpuTileLanes * (2 * D + kAttnBlockKeys) + D : group() * (kAttnBlockKeys + 2 * D + 2);
  }
};

// Validates inputs and fills `view` (user-input errors name the node and the numbers), including
// the split count; the caller provides view->partial when view->splits > 1.
Status PlanCacheAttention(const std::string& node, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                          const TensorArg& start, int64_t num_heads, int64_t kv_num_heads, float scale,
                          int64_t seq_axis, float* out, CacheAttentionView* view);

// CPU: tasks [begin, end); `scratch` holds view.scratch_floats() floats (per thread).
void CacheAttentionCpu(const CacheAttentionView& view, int64_t begin, int64_t end, float* scratch);

// CPU, after every task ran: merges the split-K partials into the output (no-op when splits == 1).
void CacheAttentionCombine(const CacheAttentionView& view);

// Note [CacheAttention CUDA]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// One thread block serves one (row, KV head, query token) unit, a chunk of its keys (split) and up to
// kAttnCudaHeads of the group's query heads: K and V are read once for all of them. Inside the block,
// each key row is read by D / 8 threads (8 elements each: one 16-byte load for float16 / bfloat16,
// two for float32), so a warp reads 32 / (D / 8) keys at once; each such key group keeps its own
// online softmax (m, l, acc) in registers over the keys it sees (4 keys in flight per group), and the
// key groups are merged through shared memory at the end. Accumulation is float32.
// Decode (T = 1) of few rows would give a handful of blocks, so the keys are split (flash-decoding)
// into `splits` chunks chosen from the CAPACITY (start lives on the device, and a captured graph must
// not depend on it): enough blocks for ~4 per SM, each chunk >= kAttnCudaMinChunk keys of the capacity
// (kAttnCudaClusterChunk when the splits merge in one cluster: Note [Cluster split chunks]) and
// >= kAttnCudaClusterChunk keys of the row's actual length (later chunks of a short row are empty and
// exit at once). Each (unit, head, chunk)
// writes (acc[D], m, l) to a float32 workspace from ORT's allocator for the op's device (stream-ordered,
// no cudaMalloc in a step), and CacheAttentionCombineKernel merges the chunks. With splits == 1 the
// block writes the output directly. Prefill uses the same kernel (one unit per query token).
// `start` is read on the device and clamped to [0, capacity - T], so a bad start never reads outside
// the cache; the bad value is reported through Note [CUDA deferred errors].
// For float16 / bfloat16 with aligned rows the loop above is replaced by a cp.async pipeline and the
// split count trimmed to one wave: Note [CacheAttention CUDA v2] in kernels/cuda/cache_attention.cu.
constexpr int kAttnCudaHeads = 8;          // query heads per block (a larger group takes several blocks)
constexpr int64_t kAttnCudaMinChunk = 256;  // a split of a node merged by a combine launch: keys of the capacity
constexpr int64_t kAttnCudaClusterChunk = 128;  // of a node merged in one cluster; the kernels' least chunk
constexpr int64_t kAttnCudaClusterSplits = 8;  // the most splits one cluster merges (tile16::kMaxClusterRanks)
constexpr int64_t kAttnCudaMaxSplits = 512;

// Note [Cluster split chunks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The splits of a decode attention node (dense CacheAttention v3, both paged v3 kernels) come from the capacity: at
// most capacity / kAttnCudaMinChunk (256) of them, since each split past one wave costs a partial row and the
// combine launch reads them all. When the node's splits merge in ONE cluster instead (at most 8 splits and one
// block per SM: Note [Cluster merge] in kernels/cuda/tile_mma.cuh), the combine is gone and more splits cost only
// cluster ranks, so where twice the splits still fit one cluster the keys are split into chunks of 128 (a 1K table
// of one row: 8 splits of 128 instead of 4 of 256; a 512-key table 4 instead of 2). Tables below 512 keys keep one
// split (the one-launch node of the short rows). may_cluster: the kernel clusters this node when its grid fits
// (the paged kernels: one batch row).
// H200 harnesses (attention_sweep / paged_sweep, SmolLM2's heads, two alternated rounds; benchmarks/results/
// paged_attention_cuda_h200.md, twelfth session), us before -> after: one row of 1K keys dense 4.39 -> 3.97, uniform
// F16 pages (static tables) 5.06 -> 4.47, INT4 6.28 -> 6.21; 1K keys in a 2K table (paged) 5.06 -> 4.47; 512 keys
// dense 4.28 -> 3.67, paged 4.96 -> 4.45. Not kept: any split count that fits the cluster (1K x 8 rows dense: 5
// splits of 208 keys, 5.03 -> 5.47) and a least chunk of 128 for every node (8K x 1: 6.6 -> 8.0 us, a combine
// over 64 partials).
inline int64_t AttnCudaSplits(int64_t cap, int64_t blocks, int sm_count, bool may_cluster) {
  const int64_t sms = sm_count > 1 ? sm_count : 1, target = 4 * sms;
  if (blocks <= 0 || blocks >= target) return 1;
  int64_t s = (target + blocks - 1) / blocks;
  const int64_t by_keys = cap / kAttnCudaMinChunk > 1 ? cap / kAttnCudaMinChunk : 1;
  s = s < by_keys ? s : by_keys;
  s = s < kAttnCudaMaxSplits ? s : kAttnCudaMaxSplits;
  if (may_cluster && cap >= 2 * kAttnCudaMinChunk && 2 * s <= kAttnCudaClusterSplits &&
      2 * s <= cap / kAttnCudaClusterChunk && 2 * s * blocks <= sms)
    s *= 2;
  return s;
}
constexpr int64_t kAttnCudaMaxHeadSize = 256;

struct CacheAttentionCudaView {
  const void* q = nullptr;      // [B, T, Hq * D]
  const void* k = nullptr;      // cache, see strides
  const void* v = nullptr;
  void* out = nullptr;          // [B, T, Hq * D], the query's type
  const int64_t* start = nullptr;  // DEVICE memory: start[b * start_stride]
  int64_t start_stride = 0;
  int32_t elem_type = 0;        // kFloat32, kFloat16, kBFloat16
  int64_t B = 0, T = 0, Hq = 0, Hkv = 0, D = 0, C = 0;
  int64_t row_stride = 0, tok_stride = 0, head_stride = 0;  // elements
  float scale = 1.0f;
  int64_t splits = 1;
  bool vec = false;             // 16-byte loads are aligned (D * size and every stride * size % 16 == 0)
  float* partial = nullptr;     // splits > 1: workspace_bytes() of device memory
  int32_t label = -1;           // Note [CUDA deferred errors]
  void* error_word = nullptr;   // device pointer of the ortkv_device_error word (may be null)

  int64_t units() const { return B * Hkv * T; }
  int64_t group() const { return Hq / Hkv; }
  size_t workspace_bytes() const {
    return splits > 1 ? static_cast<size_t>(units() * group() * splits * (D + 2)) * sizeof(float) : 0;
  }
  // The shape v3 runs (Note [CacheAttention CUDA v3]): 16-bit, aligned rows, head size 64 or 128; its launch also
  // needs the kernel choice and the device, and the plan clusters such a node's splits (Note [Cluster split chunks]).
  bool v3_shape() const {
    return vec && (D == 64 || D == 128) && (elem_type == kFloat16 || elem_type == kBFloat16);
  }
};

// Validates shapes, types and attributes (nothing that needs `start`'s values: it is on the device)
// and fills `view` including the split count for a device with `sm_count` SMs.
Status PlanCacheAttentionCuda(const std::string& node, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                              const TensorArg& start, int64_t num_heads, int64_t kv_num_heads, float scale,
                              int64_t seq_axis, void* out, int sm_count, CacheAttentionCudaView* view);

#if defined(ORTKV_WITH_CUDA)
// Launches the attention (and the combine when splits > 1) on `stream` (a cudaStream_t).
Status CacheAttentionCuda(const CacheAttentionCudaView& view, void* stream);
// ORTKV_CUDA_ATTENTION (for A/B runs): *level = 0 when unset or empty (the newest kernel that applies), 1, 2
// or 3 for "v1", "v2", "v3"; anything else is an error.
Status CudaAttentionKernelChoice(int* level);
// ORTKV_CUDA_EARLY (for A/B runs): false when set to "0", else true: the decode attention kernels may start as
// programmatic dependents of the kernel before them (Note [CUDA attention early start] in
// kernels/cuda/cache_attention.cu).
bool CudaEarlyLaunch();
// The number of SMs of a CUDA device (0 if the query fails).
int CudaSmCount(int device);
// The device pointer of the process-wide error words ([0] CacheUpdate, [1] CacheAttention) (Note [CUDA deferred errors] in ortkv/core.h),
// mapped in the context of `stream` (a cudaStream_t; Note [CUDA error word lifetime] in
// kernels/cuda/device.cu); null if that failed (the kernels then report nothing but still refuse).
void* CudaErrorWord(void* stream);
// Waits for `stream` (a cudaStream_t) unless it is being captured into a CUDA graph: before a Compute takes a
// report, so that no kernel launched before it can still write the word (Note [Settled reports] in ortkv/core.h).
void CudaSettleReports(void* stream);
#endif

}  // namespace ortkv
