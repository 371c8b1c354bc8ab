// CacheUpdate(cache, values, position) -> updated_cache, domain "ortkv", opset 1.
//
// Note [Aliasing CacheUpdate output]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Contract: `updated_cache` MUST be the storage of `cache`. ORT never guarantees that by itself
// (docs/DESIGN_FACTS.md): a graph output always gets its own buffer unless the caller binds one buffer
// to both names through IOBinding. So the kernel is the enforcer: it compares the two data pointers
// and, when they differ, fails with E_ALIAS before writing anything. It never copies a cache.
//
// Declaration: we declare GetAliasMap (output 0 <- input 0) and not GetMayInplace.
//   * GetMayInplace is a hint that never fires for graph inputs, so a cache consumed by another node
//     inside the graph (updated_cache not a graph output) would always get a fresh buffer and the
//     kernel would always refuse. That topology would be impossible.
//   * GetAliasMap forces ORT to hand the kernel the input's buffer as the output whenever the output
//     is not a graph output, so the in-graph topology runs in place. When the output IS a graph
//     output, ORT still allocates it separately unless the caller binds the same buffer, and then
//     the pointer check catches an unbound or wrongly bound call.
// Hazard implied by GetAliasMap: ORT writes through the alias without any ordering or ownership:
//   (1) plain session.run() writes into the caller's numpy feed, and into an initializer (the change
//       persists across runs) or a READ_ONLY input if a model aliases one;
//   (2) another node that reads the pre-update `cache` may run after the write and see new data
//       (observed in 4 of 6 orderings).
// Guards: ortkv.graph's checker rejects an aliased initializer, an alias of a non-READ_WRITE input
// and any reader of the pre-update name that is not ordered before the write; MutableCacheSession
// refuses read-only, overlapping and concurrently used storage. The kernel additionally refuses to
// write into ranges registered as write-protected in ortkv_core (read-only shared prefixes), and
// `values` that share bytes with `cache` (Note [CacheUpdate values must not overlap the cache]).
//
// CUDA: the same op is registered for CUDAExecutionProvider; every input, `position` included, is in
// device memory (OrtMemTypeDefault) so that a decode step can be captured as a CUDA graph. The host
// checks what needs no data (shapes, types, the alias pointers, overlap of values and cache) and
// returns those errors at once; the kernel checks the positions and the protected ranges on the
// device before any store and reports through Note [CUDA deferred errors] (ortkv/core.h).
#include <algorithm>
#include <memory>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "ops.h"
#include "ort_util.h"
#include "ortkv/cache_update.h"
#include "ortkv/core.h"
#include "cuda_util.h"
#include "cache_write.h"

namespace ortkv_ort {
namespace {

using ortkv::CacheUpdateView;
using ortkv::Code;
using ortkv::Status;
using ortkv::TensorArg;

struct CacheUpdateKernel {
  NodeNames names;
  int64_t seq_axis = -2;
  bool cuda = false;
  int32_t label = -1;  // Note [CUDA deferred errors]
};

}  // namespace

// What CacheUpdate and RotaryCacheUpdate share (declared in cache_write.h).

// The protected ranges (write-protected or uncommitted) that overlap the whole cache on its device,
// for the CUDA kernel to check each row's span against on the device (the positions are not on the
// host). Under a captured CUDA graph the ranges in force at capture time stay in the graph.
Status CollectCacheDeviceRanges(const char* op, const std::string& node, const std::string& cache_name,
                                const CacheUpdateView& v, int device_id, ortkv::DeviceRangeCheck* out) {
  out->count = 0;
  if (ortkv_core_protected_count() == 0) return Status::Ok();
  const uintptr_t lo = reinterpret_cast<uintptr_t>(v.cache);
  const uintptr_t hi = lo + static_cast<uintptr_t>(v.rows * v.outer * v.capacity * v.token_bytes);
  // the registry answers the first overlapping range in its own order, so search the windows left
  // of and right of every hit as well
  std::vector<std::pair<uintptr_t, uintptr_t>> windows{{lo, hi}};
  while (!windows.empty()) {
    const auto w = windows.back();
    windows.pop_back();
    if (w.first >= w.second) continue;
    uintptr_t hit = 0;
    uint64_t hit_len = 0;
    const int kind =
        ortkv_core_find_protected(ORTKV_DEVICE_CUDA, device_id, w.first, w.second - w.first, 0, &hit, &hit_len, nullptr, 0);
    if (kind == 0) continue;
    if (out->count == ortkv::kMaxDeviceRanges) {
      std::ostringstream m;
      m << op << " node '" << node << "': more than " << ortkv::kMaxDeviceRanges
        << " write-protected or uncommitted ranges overlap the cache '" << cache_name
        << "' on cuda:" << device_id << "; the CUDA kernel checks at most " << ortkv::kMaxDeviceRanges
        << ". Nothing was written. Remedy: commit the arena further, or merge the read-only prefixes";
      return Status(Code::kInvalidArgument, m.str());
    }
    out->lo[out->count] = hit;
    out->hi[out->count] = hit + hit_len;
    out->kind[out->count] = kind;
    ++out->count;
    windows.push_back({w.first, std::max(w.first, std::min<uintptr_t>(w.second, hit))});
    windows.push_back({std::max(w.first, std::min<uintptr_t>(w.second, hit + hit_len)), w.second});
  }
  return Status::Ok();
}

Status CheckCacheWriteProtection(const char* op, const std::string& node, const std::string& cache_name,
                                 const CacheUpdateView& v, int device_type, int device_id) {
  // Note [Write-protection check] in ortkv/protected_writes.h
  return CheckProtectedWrites(
      device_type, device_id, v.pairs(),
      [&](int64_t pair, uintptr_t* first, uintptr_t* last) { ortkv::CacheUpdatePairSpan(v, pair, first, last); },
      [&](int64_t pair) {
        std::ostringstream m;
        m << op << " node '" << node << "': row " << v.pair_row(pair) << " of '" << cache_name
          << "' would write";
        return std::make_pair(m.str(), std::string());
      },
      "commit the arena up to the last token before the run (Arena.commit).",
      "bind the owner's writable storage, or fork the sequence into its own pages.");
}


OrtStatus* CheckCacheAlias(const char* op, const std::string& node, const std::string& out_name,
                           const std::string& in_name, const void* out_data, const void* in_data) {
  if (out_data == in_data) return nullptr;
  ortkv::Message m;  // Note [Messages on the error path only]
  m << op << " node '" << node << "': output '" << out_name << "' at " << Hex(out_data)
    << " is not the storage of input '" << in_name << "' at " << Hex(in_data)
    << "; the updated cache MUST alias the cache and ortkv never copies a cache, so nothing was written. "
    << "Remedy: bind ONE buffer to both names through IOBinding (bind_ortvalue_input('" << in_name
    << "', v) and bind_ortvalue_output('" << out_name << "', v) with the same OrtValue v, or "
    << "bind_input/bind_output with the same buffer_ptr), or run the model through ortkv.MutableCacheSession.";
  return ToOrtStatus(Status(Code::kAlias, m.str()));
}

namespace {

// Note [CacheUpdate flat values]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// For a cache of rank >= 4 whose sequence axis is 1 (BSNH [batch, capacity, heads, head_size]), `values` may
// also come flat, [batch, n, heads * head_size]: a projection's own output. Its bytes are exactly those of
// [batch, n, heads, head_size] (row-major), so the op reads it with the cache's trailing dims and nothing is
// copied or moved; a decoder then needs no Reshape per K / V per layer (issue 12: at one token per step
// ORT's cost per node is a large share of the step). Any other layout would need a transposition of the
// new tokens, so it takes values in the cache's rank only. Only the shape is reinterpreted here, before
// PlanCacheUpdate validates everything else, so the CPU and CUDA kernels are unchanged.
Status UnflattenValues(const CacheUpdateKernel& k, const TensorArg& cache, TensorArg* values) {
  const int64_t rank = static_cast<int64_t>(cache.dims.size());
  if (rank < 4 || values->dims.size() != 3) return Status::Ok();  // same rank, or a mismatch Plan reports
  const int64_t axis = k.seq_axis < 0 ? k.seq_axis + rank : k.seq_axis;
  if (axis != 1) return Status::Ok();  // PlanCacheUpdate reports the rank mismatch
  int64_t width = 1;
  std::ostringstream dims, listed;
  for (int64_t i = 2; i < rank; ++i) {
    width *= cache.dims[i];
    dims << (i > 2 ? " x " : "") << cache.dims[i];
    listed << ", " << cache.dims[i];
  }
  if (values->dims[2] != width) {
    std::ostringstream m;
    m << "CacheUpdate node '" << k.names.node << "': input '" << values->name << "' has shape [" << values->dims[0]
      << ", " << values->dims[1] << ", " << values->dims[2] << "]: flat values [batch, n, width] for the cache '"
      << cache.name << "' (sequence axis 1) need width " << dims.str() << " = " << width << ", the cache's "
      << "elements per token. Nothing was written. Remedy: pass values of width " << width
      << ", or in the cache's rank [batch, n" << listed.str() << "]";
    return Status(Code::kInvalidArgument, m.str());
  }
  std::vector<int64_t> full{values->dims[0], values->dims[1]};
  full.insert(full.end(), cache.dims.begin() + 2, cache.dims.end());
  values->dims = full;
  return Status::Ok();
}

struct ParallelCopy {
  const CacheUpdateView* view;
  int64_t chunk;
};

void ParallelCopyFn(void* user, size_t i) {
  const auto* p = static_cast<const ParallelCopy*>(user);
  const int64_t begin = static_cast<int64_t>(i) * p->chunk;
  const int64_t end = std::min(begin + p->chunk, p->view->pairs());
  ortkv::CacheUpdateCpu(*p->view, begin, end);
}

OrtStatus* Compute(void* op_kernel, OrtKernelContext* ctx) {
  const auto& k = *static_cast<const CacheUpdateKernel*>(op_kernel);
  const OrtValue* in[3] = {nullptr, nullptr, nullptr};
  for (size_t i = 0; i < 3; ++i) ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetInput(ctx, i, &in[i]));
  thread_local TensorArg slots[3];  // Note [Input slots]
  ClearArgs(slots);
  TensorArg &cache = slots[0], &values = slots[1], &position = slots[2];
  int device_type = ORTKV_DEVICE_CPU, device_id = 0;
  ORTKV_RETURN_IF_ORT_ERROR(ReadTensor(in[0], k.names.inputs[0], &cache, &device_type, &device_id));
  ORTKV_RETURN_IF_ORT_ERROR(ReadTensor(in[1], k.names.inputs[1], &values, nullptr, nullptr));
  ORTKV_RETURN_IF_ORT_ERROR(ReadTensor(in[2], k.names.inputs[2], &position, nullptr, nullptr));

#if defined(ORTKV_WITH_CUDA)
  if (k.cuda) ORTKV_RETURN_IF_ORT_ERROR(TakeDeviceError(ctx));  // a previous launch's report (Note [CUDA deferred errors])
#endif
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(UnflattenValues(k, cache, &values)));  // Note [CacheUpdate flat values]
  CacheUpdateView view;
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(
      k.cuda ? ortkv::PlanCacheUpdateDevice(k.names.node, cache, values, position, k.seq_axis, &view)
             : ortkv::PlanCacheUpdate(k.names.node, cache, values, position, k.seq_axis, &view)));

  OrtValue* out = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetOutput(ctx, 0, cache.dims.data(), cache.dims.size(), &out));
  void* out_data = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorMutableData(out, &out_data));
  ORTKV_RETURN_IF_ORT_ERROR(
      CheckCacheAlias("CacheUpdate", k.names.node, k.names.outputs[0], k.names.inputs[0], out_data, cache.data));
  ortkv::CoreLease lease;  // check and write as one, against Arena release/close (Note [Arena lease])
  if (k.cuda) {
#if defined(ORTKV_WITH_CUDA)
    ortkv::DeviceRangeCheck ranges;
    ORTKV_RETURN_IF_ORT_ERROR(
        ToOrtStatus(CollectCacheDeviceRanges("CacheUpdate", k.names.node, k.names.inputs[0], view, device_id, &ranges)));
    if (view.bytes_written() == 0) return nullptr;
    void* stream = nullptr;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetGPUComputeStream(ctx, &stream));
    return ToOrtStatus(ortkv::CacheUpdateCuda(view, ranges, ortkv::CudaErrorWord(stream), k.label, stream));
#else
    return ToOrtStatus(Status(Code::kRuntime, "CacheUpdate: this build of ortkv has no CUDA kernels"));
#endif
  }
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(
      CheckCacheWriteProtection("CacheUpdate", k.names.node, k.names.inputs[0], view, device_type, device_id)));
  if (view.bytes_written() == 0) return nullptr;
  // Small updates (one decode step) are cheaper than a thread-pool dispatch; split big ones.
  constexpr int64_t kParallelBytes = 1 << 20;
  constexpr int64_t kChunkBytes = 256 << 10;
  if (view.bytes_written() < kParallelBytes || view.pairs() < 2) {
    ortkv::CacheUpdateCpu(view, 0, view.pairs());
    return nullptr;
  }
  const int64_t pair_bytes = view.bytes_written() / view.pairs();
  ParallelCopy job{&view, std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(1, pair_bytes))};
  const size_t tasks = static_cast<size_t>((view.pairs() + job.chunk - 1) / job.chunk);
  return g_api->KernelContext_ParallelFor(ctx, ParallelCopyFn, tasks, 0, &job);
}

OrtStatus* CreateKernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel,
                        bool cuda) {
  (void)op;
  auto k = std::make_unique<CacheUpdateKernel>();
  k->cuda = cuda;
  ORTKV_RETURN_IF_ORT_ERROR(ReadNodeNames(api, info, 3, 1, &k->names));
  // absent: the default, BNSH
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, k->names.node, "seq_axis", int64_t{-2}, &k->seq_axis));
  if (cuda) k->label = ortkv_core_register_label("CacheUpdate", k->names.node.c_str(), k->names.inputs[0].c_str());
  *kernel = k.release();
  return nullptr;
}

OrtStatus* InferShape(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  // updated_cache has the type and shape of cache. The info belongs to the context: not released.
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->ShapeInferContext_GetInputTypeShape(ctx, 0, &info));
  return g_api->ShapeInferContext_SetOutputTypeShape(ctx, 0, info);
}

size_t AliasMap(int** input_index, int** output_index) {
  *input_index = new int[1]{0};
  *output_index = new int[1]{0};
  return 1;
}

void ReleaseAliasMap(int* input_index, int* output_index) {
  delete[] input_index;
  delete[] output_index;
}

OrtCustomOp MakeOp(bool cuda) {
  OrtCustomOp op;
  InitCustomOp(&op);  // version >= 18: GetAliasMap is honoured
  op.GetName = [](const OrtCustomOp*) { return "CacheUpdate"; };
  op.GetExecutionProviderType = cuda ? [](const OrtCustomOp*) -> const char* { return "CUDAExecutionProvider"; }
                                     : [](const OrtCustomOp*) -> const char* { return nullptr; };
  // cache and values: float32, float16 or bfloat16 (checked by the kernel with a named error);
  // position: int64.
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 3; };
  op.GetInputType = [](const OrtCustomOp*, size_t i) {
    return i == 2 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
  // every input in the op's device memory, `position` too (graph capture; Note [CUDA deferred errors])
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
  op.CreateKernelV2 = cuda ? [](const OrtCustomOp* o, const OrtApi* a, const OrtKernelInfo* i, void** k) {
    return CreateKernel(o, a, i, k, true);
  }
                           : [](const OrtCustomOp* o, const OrtApi* a, const OrtKernelInfo* i, void** k) {
                               return CreateKernel(o, a, i, k, false);
                             };
  op.KernelComputeV2 = Compute;
  op.KernelDestroy = [](void* k) { delete static_cast<CacheUpdateKernel*>(k); };
  op.InferOutputShapeFn = InferShape;
  op.GetAliasMap = AliasMap;
  op.ReleaseAliasMap = ReleaseAliasMap;
  return op;
}

const OrtCustomOp kCacheUpdateCpu = MakeOp(false);
#if defined(ORTKV_WITH_CUDA)
const OrtCustomOp kCacheUpdateCuda = MakeOp(true);
#endif

}  // namespace

void AppendCacheUpdateOps(std::vector<const OrtCustomOp*>* ops) {
  ops->push_back(&kCacheUpdateCpu);
#if defined(ORTKV_WITH_CUDA)
  ops->push_back(&kCacheUpdateCuda);
#endif
}

}  // namespace ortkv_ort
