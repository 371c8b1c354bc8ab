// PagedRequantizeCuda: one page slot of a pool in CUDA device memory from one format into another, every layer,
// by kernels on the device (ortkv/paged.h). Compiled into the Python extension (_ortkv.paged_requantize_cuda,
// the pool manager's function for a pool on CUDA), beside its host twin kernels/cpu/paged_requantize.cc.
//
// Note [Requantize on CUDA]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A page leaves the recency window, or the governor refuses a commit and an old page is demoted: the pool
// (python/ortkv/paged.py) takes a free slot of the new format, requantizes the page into it, then points the
// directory row at it and frees the old slot. On a CUDA pool the requantize runs here, between two runs (the
// device is synchronized first: whatever stream ORT used is done with the pool), in four steps:
//   1. decode: one thread per row (layer, K/V, head, token) decodes the source row with the codecs' own
//      DecodeRow into a float32 workspace [layers][2][kv_heads][page_size][head_size], rounded to the logical
//      type (what a kernel fed that type would have written);
//   2. check: one thread per row of the destination (per channel for the keys of a *_KC format) asks
//      RowScales whether it is encodable; the first failure in the host's order (layer, K/V, head, then
//      token or channel) wins an atomicMin on a 64-bit key;
//   3. the key comes back to the host (the only device-to-host copy, 8 bytes): on a failure the call returns
//      the host version's message and NOTHING has been written to the pool (the destination is a free slot
//      whose bytes stay as they were);
//   4. encode: the destination slot is zeroed (the host version's padding) and one thread per row encodes
//      it with EncodeRow (per-channel keys: one thread per byte column of a head's keys, EncodeKeyColumn).
// The same functions as the host (codecs.h, ORTKV_HD), compiled without fused multiply-adds (CMakeLists:
// --fmad=false), so the bytes equal the host version's (Note [Codec arithmetic]); tests/test_paged_pool.py
// compares them byte for byte on the device. Workspace: the float32 values of one slot and the key, allocated
// for the call and freed after it (the host version allocates the same); nothing crosses the bus but the key.
// Before this, one page was staged through host memory both ways (`bytes_staged`), which builds without the
// CUDA kernels still do.
#include <cuda_runtime.h>

#include <climits>
#include <string>

#include "codecs.h"
#include "ortkv/core.h"
#include "ortkv/paged.h"

namespace ortkv {
namespace {

using codecs::PageFormat;
using codecs::PageShape;
using codecs::PageView;
using codecs::RowResult;

constexpr int kThreads = 128;
constexpr unsigned long long kNoFailure = ULLONG_MAX;

struct Job {
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  float* values = nullptr;  // [layers][2][kv_heads][page_size][head_size]
  unsigned long long* failure = nullptr;
  PageFormat sf = PageFormat::kF16, df = PageFormat::kF16;
  PageShape shape;
  uint64_t src_page = 0, dst_page = 0;  // bytes of one layer's page
  int32_t layers = 0;
  int32_t logical = kFloat32;
  int64_t rows = 0;       // layers * 2 * kv_heads * page_size
  int32_t per_unit = 0;   // check items per (layer, K/V, head): max(page_size, head_size)
};

// row r = ((layer * 2 + kv) * kv_heads + head) * page_size + token
__device__ __forceinline__ void RowOf(const Job& j, int64_t r, int32_t* l, int32_t* kv, int32_t* h, int32_t* t) {
  *t = static_cast<int32_t>(r % j.shape.page_size);
  r /= j.shape.page_size;
  *h = static_cast<int32_t>(r % j.shape.kv_heads);
  r /= j.shape.kv_heads;
  *kv = static_cast<int32_t>(r % 2);
  *l = static_cast<int32_t>(r / 2);
}

__global__ void DecodeRows(Job j) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= j.rows) return;
  int32_t l, kv, h, t;
  RowOf(j, r, &l, &kv, &h, &t);
  const PageView src = PageView::Make(const_cast<uint8_t*>(j.src) + l * j.src_page, j.sf, j.shape);
  float* out = j.values + r * j.shape.head_size;
  src.DecodeRow(kv, h, t, out);
  codecs::RoundToLogical(out, j.shape.head_size, j.logical);
}

// item i of unit u = (layer * 2 + kv) * kv_heads + head: token i (a row), or channel i for per-channel keys
__global__ void CheckRows(Job j) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t units = static_cast<int64_t>(j.layers) * 2 * j.shape.kv_heads;
  if (i >= units * j.per_unit) return;
  const int64_t u = i / j.per_unit;
  const int32_t item = static_cast<int32_t>(i % j.per_unit);
  const int32_t kv = static_cast<int32_t>((u / j.shape.kv_heads) % 2);
  const float* unit = j.values + u * j.shape.page_size * j.shape.head_size;
  uint16_t sc[2];
  RowResult res;
  if (kv == 0 && codecs::KeysPerChannel(j.df)) {
    if (item >= j.shape.head_size) return;
    res = codecs::RowScales(j.df, unit + item, j.shape.page_size, sc, j.shape.head_size);
  } else {
    if (item >= j.shape.page_size) return;
    res = codecs::RowScales(codecs::RowFormat(j.df), unit + static_cast<int64_t>(item) * j.shape.head_size,
                            j.shape.head_size, sc);
  }
  if (res != RowResult::kOk)
    atomicMin(j.failure, (static_cast<unsigned long long>(i) << 2) | static_cast<unsigned long long>(res));
}

__global__ void EncodeRows(Job j) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= j.rows) return;
  int32_t l, kv, h, t;
  RowOf(j, r, &l, &kv, &h, &t);
  const PageView dst = PageView::Make(j.dst + l * j.dst_page, j.df, j.shape);
  const float* row = j.values + r * j.shape.head_size;
  if (kv == 0 && codecs::KeysPerChannel(j.df)) return;  // EncodeKeyColumns
  dst.EncodeRow(kv, h, t, row);
}

// Per-channel keys (*_KC destinations): one thread per (layer, head, byte column) of the keys (codecs::EncodeKeyColumn;
// the channels were checked in CheckRows). A thread per head encoding its whole page took 513 us per SmolLM2 page on
// the H200 (benchmarks/results/requantize_cuda_h200.md).
__global__ void EncodeKeyColumns(Job j) {
  const int32_t cols = j.shape.head_size / (8 / codecs::PayloadBits(j.df));
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(j.layers) * j.shape.kv_heads * cols) return;
  const int32_t b = static_cast<int32_t>(i % cols);
  const int32_t h = static_cast<int32_t>((i / cols) % j.shape.kv_heads);
  const int32_t l = static_cast<int32_t>(i / (static_cast<int64_t>(cols) * j.shape.kv_heads));
  const PageView dst = PageView::Make(j.dst + l * j.dst_page, j.df, j.shape);
  const int64_t r = ((static_cast<int64_t>(l) * 2) * j.shape.kv_heads + h) * j.shape.page_size;  // K, head h, token 0
  codecs::EncodeKeyColumn(j.df, j.values + r * j.shape.head_size, j.shape.page_size, j.shape.head_size,
                          dst.PayloadRow(0, h, 0), dst.layout.row_bytes, dst.ScaleRow(0, h, 0), b);
}

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

class DeviceBuffer {
 public:
  ~DeviceBuffer() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  cudaError_t Allocate(size_t n) { return cudaMalloc(&p_, n); }
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
};

}  // namespace

Status PagedRequantizeCuda(int32_t device, uint8_t* pool, uint64_t pool_bytes, uint64_t src_offset,
                           int32_t src_format, uint64_t dst_offset, int32_t dst_format, int32_t num_layers,
                           codecs::PageShape shape, int32_t logical) {
  const std::string what = "paged_requantize (CUDA): ";
  ORTKV_RETURN_IF_ERR(
      CheckPagedRequantize(pool_bytes, src_offset, src_format, dst_offset, dst_format, num_layers, shape, logical));
  Job j;
  j.sf = static_cast<PageFormat>(src_format);
  j.df = static_cast<PageFormat>(dst_format);
  j.shape = shape;
  j.src_page = codecs::LayoutOf(j.sf, shape).page_bytes;
  j.dst_page = codecs::LayoutOf(j.df, shape).page_bytes;
  j.layers = num_layers;
  j.logical = logical;
  j.rows = static_cast<int64_t>(num_layers) * 2 * shape.kv_heads * shape.page_size;
  j.per_unit = shape.page_size > shape.head_size ? shape.page_size : shape.head_size;
  j.src = pool + src_offset;
  j.dst = pool + dst_offset;
  const uint64_t ds = j.dst_page * num_layers;

  // Note [Arena lease]: the slots' memory stays mapped while we check and write it
  CoreLease lease;
  ORTKV_RETURN_IF_ERR(
      CheckRequantizeSlots(ORTKV_DEVICE_CUDA, device, pool, src_offset, j.src_page * num_layers, dst_offset, ds, what));

  bool writing = false;  // from the destination's cudaMemset on
  const auto cuda = [&](cudaError_t e, const char* call) {
    return e == cudaSuccess ? Status::Ok()
                            : Status(Code::kRuntime, what + call + " failed: " + cudaGetErrorString(e) +
                                                         (writing ? "; the destination (a free slot) may hold partial "
                                                                    "bytes; the page and the directory are unchanged"
                                                                  : "; nothing was written"));
  };
  ORTKV_RETURN_IF_ERR(cuda(cudaSetDevice(device), "cudaSetDevice"));
  ORTKV_RETURN_IF_ERR(cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"));  // ORT's streams are done with the pool
  DeviceBuffer work;
  const size_t value_bytes = static_cast<size_t>(j.rows) * shape.head_size * sizeof(float);
  ORTKV_RETURN_IF_ERR(cuda(work.Allocate(value_bytes + sizeof(unsigned long long)), "cudaMalloc (workspace)"));
  j.values = static_cast<float*>(work.get());
  j.failure = reinterpret_cast<unsigned long long*>(static_cast<uint8_t*>(work.get()) + value_bytes);
  ORTKV_RETURN_IF_ERR(cuda(cudaMemset(j.failure, 0xFF, sizeof(unsigned long long)), "cudaMemset"));
  const int64_t items = static_cast<int64_t>(num_layers) * 2 * shape.kv_heads * j.per_unit;
  DecodeRows<<<Blocks(j.rows), kThreads>>>(j);
  CheckRows<<<Blocks(items), kThreads>>>(j);
  ORTKV_RETURN_IF_ERR(cuda(cudaGetLastError(), "launch (decode, check)"));
  unsigned long long failure = kNoFailure;
  ORTKV_RETURN_IF_ERR(cuda(cudaMemcpy(&failure, j.failure, sizeof(failure), cudaMemcpyDeviceToHost), "cudaMemcpy"));
  if (failure != kNoFailure) {  // the host version's message for the same row or channel
    const auto res = static_cast<RowResult>(failure & 3u);
    const int64_t i = static_cast<int64_t>(failure >> 2);
    const int64_t u = i / j.per_unit;
    const int32_t item = static_cast<int32_t>(i % j.per_unit);
    const int32_t h = static_cast<int32_t>(u % shape.kv_heads), kv = static_cast<int32_t>((u / shape.kv_heads) % 2);
    const int32_t l = static_cast<int32_t>(u / (2 * shape.kv_heads));
    const std::string where = kv == 0 && codecs::KeysPerChannel(j.df)
                                  ? "K channel [head=" + std::to_string(h) + " channel=" + std::to_string(item) + "]"
                                  : codecs::RowName(kv, h, item);
    const Status s = codecs::RowError(res, j.df, where);
    return Status(s.code(), what + "layer " + std::to_string(l) + ": " + s.message() + "; nothing was written");
  }
  writing = true;
  ORTKV_RETURN_IF_ERR(cuda(cudaMemset(j.dst, 0, ds), "cudaMemset (destination)"));
  EncodeRows<<<Blocks(j.rows), kThreads>>>(j);
  if (codecs::KeysPerChannel(j.df)) {
    const int64_t cols = static_cast<int64_t>(num_layers) * shape.kv_heads * (shape.head_size / (8 / codecs::PayloadBits(j.df)));
    EncodeKeyColumns<<<Blocks(cols), kThreads>>>(j);
  }
  ORTKV_RETURN_IF_ERR(cuda(cudaGetLastError(), "launch (encode)"));
  return cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

}  // namespace ortkv
