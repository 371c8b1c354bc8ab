// Small helpers over ONNX Runtime's C API for the adapter folder (the only code that sees ORT headers).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "onnxruntime_c_api.h"
#include "ortkv/cache_update.h"
#include "ortkv/core.h"
#include "ortkv/protected_writes.h"
#include "ortkv/status.h"

namespace ortkv_ort {

// Set once by RegisterCustomOps; ORT passes the same table to every kernel callback.
extern const OrtApi* g_api;

#define ORTKV_RETURN_IF_ORT_ERROR(expr)  \
  do {                                   \
    OrtStatus* _s = (expr);              \
    if (_s != nullptr) return _s;        \
  } while (0)

inline OrtStatus* ToOrtStatus(const ortkv::Status& s) {
  if (s.ok()) return nullptr;
  const OrtErrorCode code = s.code() == ortkv::Code::kRuntime ? ORT_RUNTIME_EXCEPTION : ORT_INVALID_ARGUMENT;
  return g_api->CreateStatus(code, s.Tagged().c_str());
}

// Reads a string property with ORT's size-query convention (call with nullptr, then fill).
template <typename F>
OrtStatus* ReadString(F&& getter, std::string* out) {
  size_t size = 0;
  ORTKV_RETURN_IF_ORT_ERROR(getter(nullptr, &size));
  std::vector<char> buf(size + 1, '\0');
  ORTKV_RETURN_IF_ORT_ERROR(getter(buf.data(), &size));
  out->assign(buf.data());
  return nullptr;
}

// Element type, dims, data pointer and the graph value's name of a kernel input or output; with
// device_type non-null also its device (ORTKV_DEVICE_*) and device id.
OrtStatus* ReadTensor(const OrtValue* value, const std::string& name, ortkv::TensorArg* out, int* device_type,
                      int* device_id);

// Note [Input slots]
// An adapter's TensorArgs are thread_local and cleared (capacities kept) at the start of every run, so reading a
// node's inputs allocates nothing once their dims and name buffers have grown: locals cost a std::vector and a
// std::string per input per run. Cleared, not just overwritten: an omitted optional input must not show the
// previous run's tensor. With the other per-run buffers (Linear's output dims, RotaryCacheUpdate's value shape, FnRef
// below) a float32 CPU decode step of SmolLM2 makes 1,361 mallocs instead of 2,455, the rest ORT's own
// (benchmarks/step_allocations.py, benchmarks/results/step_allocations_cpu.md).
template <size_t N>
void ClearArgs(ortkv::TensorArg (&args)[N]) {
  for (auto& a : args) {
    a.data = nullptr;
    a.elem_type = 0;
    a.dims.clear();
    a.name.clear();
  }
}

std::string Hex(const void* p);

// Note [Write-protection check] in ortkv/protected_writes.h (shared with the pool manager's requantize)
using ortkv::CheckProtectedWrites;
using ortkv::FnRef;

// Node name, input and output value names of a kernel, read once at kernel creation.
struct NodeNames {
  std::string node;
  std::vector<std::string> inputs, outputs;
};
OrtStatus* ReadNodeNames(const OrtApi* api, const OrtKernelInfo* info, size_t inputs, size_t outputs, NodeNames* out);

// An optional attribute: absent -> `fallback`; present with another type (seq_axis=1.0) -> an error
// naming the node, the attribute and the type it must have. ORT's KernelInfoGetAttribute_* answer both
// cases with an error status; only "No attribute with name" means absent (anything else refuses).
OrtStatus* OptionalAttribute(const OrtApi* api, const OrtKernelInfo* info, const std::string& node, const char* name,
                             int64_t fallback, int64_t* out);
OrtStatus* OptionalAttribute(const OrtApi* api, const OrtKernelInfo* info, const std::string& node, const char* name,
                             float fallback, float* out);
OrtStatus* OptionalAttribute(const OrtApi* api, const OrtKernelInfo* info, const std::string& node, const char* name,
                             const std::string& fallback, std::string* out);

// Zeroes `op` and fills what every ortkv op shares: version (>= 18, so GetAliasMap is honoured),
// required single inputs and outputs, default memory types, opset range [1, INT_MAX]. Each op then
// sets its name, types, kernel callbacks and shape inference.
void InitCustomOp(OrtCustomOp* op);

// The run of a CPU attention plan (CacheAttention's and PagedCacheAttention's views): its split-K partials in a
// thread_local buffer reused run to run (Note [Input slots]), its tasks on ORT's intra-op pool (inline when there is
// one), each with a per-thread scratch of view.scratch_floats(), then Combine, which merges the partials. The
// caller holds the CoreLease that keeps the caches mapped meanwhile (Note [Arena lease]).
template <typename View, void (*Run)(const View&, int64_t, int64_t, float*), void (*Combine)(const View&)>
OrtStatus* RunAttentionTasks(OrtKernelContext* ctx, View& view) {
  thread_local std::vector<float> partial;
  partial.assign(static_cast<size_t>(view.partial_floats()), 0.0f);
  view.partial = partial.empty() ? nullptr : partial.data();
  void (*task)(void*, size_t) = [](void* user, size_t i) {
    const View& v = *static_cast<const View*>(user);
    thread_local std::vector<float> scratch;
    const size_t need = static_cast<size_t>(v.scratch_floats());
    if (scratch.size() < need) scratch.resize(need);
    Run(v, static_cast<int64_t>(i), static_cast<int64_t>(i) + 1, scratch.data());
  };
  if (view.tasks() == 1)
    task(&view, 0);
  else
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_ParallelFor(ctx, task, static_cast<size_t>(view.tasks()), 0, &view));
  Combine(view);
  return nullptr;
}

// An int attribute in shape inference, or `fallback` when absent or unreadable.
int64_t InferAttr(OrtShapeInferContext* ctx, const char* name, int64_t fallback);

// Output `out` = input `in` with its last dim replaced by f(last) (-1: unknown); symbolic dims kept.
template <typename F>
OrtStatus* SetLastDimFrom(OrtShapeInferContext* ctx, size_t in, size_t out, F&& f) {
  OrtTensorTypeAndShapeInfo* src = nullptr;  // owned by the context
  ORTKV_RETURN_IF_ORT_ERROR(g_api->ShapeInferContext_GetInputTypeShape(ctx, in, &src));
  size_t rank = 0;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetDimensionsCount(src, &rank));
  if (rank == 0) return g_api->ShapeInferContext_SetOutputTypeShape(ctx, out, src);  // unknown: as the input
  std::vector<int64_t> dims(rank);
  std::vector<const char*> names(rank, nullptr);
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetDimensions(src, dims.data(), rank));
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetSymbolicDimensions(src, names.data(), rank));
  ONNXTensorElementDataType type;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorElementType(src, &type));
  dims[rank - 1] = dims[rank - 1] < 0 ? -1 : f(dims[rank - 1]);
  names[rank - 1] = "";
  for (auto& n : names)
    if (n == nullptr) n = "";
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->CreateTensorTypeAndShapeInfo(&info));
  OrtStatus* s = g_api->SetTensorElementType(info, type);
  if (s == nullptr) s = g_api->SetDimensions(info, dims.data(), rank);
  if (s == nullptr) s = g_api->SetSymbolicDimensions(info, names.data(), rank);
  if (s == nullptr) s = g_api->ShapeInferContext_SetOutputTypeShape(ctx, out, info);
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  return s;
}

}  // namespace ortkv_ort
