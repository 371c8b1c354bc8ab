// RotaryCacheUpdate(qkv, k_cache, v_cache, positions, cos_cache, sin_cache) -> q_rot, k_cache_out, v_cache_out
// and SwiGLU(x) -> y, domain "ortkv", opset 1 (Note [RotaryCacheUpdate], Note [SwiGLU] in
// ortkv/rotary_cache_update.h).
//
// RotaryCacheUpdate declares outputs 1 and 2 as aliases of inputs 1 and 2 (GetAliasMap) and enforces them as
// CacheUpdate does (Note [Aliasing CacheUpdate output]): both pointers are compared before any store, a
// difference is E_ALIAS and nothing is written. Host-side checks (shapes, types, aliases, overlaps, and on the
// CPU the positions and the protected ranges) return at once; on CUDA the positions and the protected ranges
// are checked on the device (Note [CUDA deferred errors]; reported with this op's name, the node and the cache).
#include <algorithm>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cache_write.h"
#include "cuda_util.h"
#include "ops.h"
#include "ort_util.h"
#include "ortkv/core.h"
#include "ortkv/rotary_cache_update.h"

namespace ortkv_ort {
namespace {

using ortkv::Code;
using ortkv::RotaryCacheUpdateView;
using ortkv::Status;
using ortkv::TensorArg;

constexpr const char* kOp = "RotaryCacheUpdate";

struct RotaryKernel {
  NodeNames names;
  int64_t heads = 0, kv_heads = 0, seq_axis = -2;
  bool cuda = false;
  int32_t label_k = -1, label_v = -1;  // Note [CUDA deferred errors]
};

struct RotaryJob {
  const RotaryCacheUpdateView* view;
  int64_t chunk;
};

void RotaryJobFn(void* user, size_t i) {
  const auto* j = static_cast<const RotaryJob*>(user);
  const int64_t begin = static_cast<int64_t>(i) * j->chunk;
  ortkv::RotaryCacheUpdateCpu(*j->view, begin, std::min(begin + j->chunk, j->view->rows * j->view->n));
}

OrtStatus* ComputeRotary(void* op_kernel, OrtKernelContext* ctx) {
  const auto& k = *static_cast<const RotaryKernel*>(op_kernel);
  thread_local TensorArg args[6];  // Note [Input slots]
  ClearArgs(args);
  int device_type = ORTKV_DEVICE_CPU, device_id = 0;
  for (size_t i = 0; i < 6; ++i) {
    const OrtValue* in = nullptr;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetInput(ctx, i, &in));
    ORTKV_RETURN_IF_ORT_ERROR(ReadTensor(in, k.names.inputs[i], &args[i], i == 1 ? &device_type : nullptr,
                                         i == 1 ? &device_id : nullptr));
  }
#if defined(ORTKV_WITH_CUDA)
  if (k.cuda) ORTKV_RETURN_IF_ORT_ERROR(TakeDeviceError(ctx));  // a previous launch's report
#endif
  if (!k.cuda && args[0].elem_type != ortkv::kFloat32) {
    std::ostringstream m;
    m << kOp << " node '" << k.names.node << "': input '" << args[0].name << "' is "
      << ortkv::ElemTypeName(args[0].elem_type) << "; the CPU kernel takes float32 (float16 / bfloat16 run on "
      << "CUDAExecutionProvider). Remedy: build the model in float32 for the CPU";
    return ToOrtStatus(Status(Code::kInvalidArgument, m.str()));
  }
  RotaryCacheUpdateView view;
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::PlanRotaryCacheUpdate(
      k.names.node, args[0], args[1], args[2], args[3], args[4], args[5], k.heads, k.kv_heads, k.seq_axis,
      /*read_positions=*/!k.cuda, &view)));

  const int64_t q_dims[3] = {view.rows, view.n, view.heads * view.head_size};
  OrtValue* outs[3] = {nullptr, nullptr, nullptr};
  void* out_data[3] = {nullptr, nullptr, nullptr};
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetOutput(ctx, 0, q_dims, 3, &outs[0]));
  ORTKV_RETURN_IF_ORT_ERROR(
      g_api->KernelContext_GetOutput(ctx, 1, args[1].dims.data(), args[1].dims.size(), &outs[1]));
  ORTKV_RETURN_IF_ORT_ERROR(
      g_api->KernelContext_GetOutput(ctx, 2, args[2].dims.data(), args[2].dims.size(), &outs[2]));
  for (int i = 0; i < 3; ++i) ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorMutableData(outs[i], &out_data[i]));
  for (int i = 1; i <= 2; ++i) {
    ORTKV_RETURN_IF_ORT_ERROR(
        CheckCacheAlias(kOp, k.names.node, k.names.outputs[i], k.names.inputs[i], out_data[i], args[i].data));
  }
  {  // q_rot must not be bound onto a cache (it is written with the caches, in any order)
    const size_t es = ortkv::ElemSize(view.elem_type);
    const uintptr_t qlo = reinterpret_cast<uintptr_t>(out_data[0]);
    const uintptr_t qhi = qlo + static_cast<uintptr_t>(view.rows * view.n * view.heads * view.head_size) * es;
    for (int i = 1; i <= 2; ++i) {
      const ortkv::CacheUpdateView& c = i == 1 ? view.k : view.v;
      const uintptr_t lo = reinterpret_cast<uintptr_t>(c.cache);
      const uintptr_t hi = lo + static_cast<uintptr_t>(c.rows * c.outer * c.capacity * c.token_bytes);
      if (qlo < hi && lo < qhi) {
        std::ostringstream m;
        m << kOp << " node '" << k.names.node << "': output '" << k.names.outputs[0] << "' at " << Hex(out_data[0])
          << " overlaps the cache '" << k.names.inputs[i] << "'; nothing was written. Remedy: bind '"
          << k.names.outputs[0] << "' to a buffer of its own (or leave it unbound)";
        return ToOrtStatus(Status(Code::kInvalidArgument, m.str()));
      }
    }
  }
  view.q_out = out_data[0];
  ortkv::CoreLease lease;  // check and write as one, against Arena release/close (Note [Arena lease])
  if (k.cuda) {
#if defined(ORTKV_WITH_CUDA)
    ortkv::DeviceRangeCheck rk, rv;
    ORTKV_RETURN_IF_ORT_ERROR(
        ToOrtStatus(CollectCacheDeviceRanges(kOp, k.names.node, k.names.inputs[1], view.k, device_id, &rk)));
    ORTKV_RETURN_IF_ORT_ERROR(
        ToOrtStatus(CollectCacheDeviceRanges(kOp, k.names.node, k.names.inputs[2], view.v, device_id, &rv)));
    void* stream = nullptr;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetGPUComputeStream(ctx, &stream));
    return ToOrtStatus(ortkv::RotaryCacheUpdateCuda(view, rk, rv, ortkv::CudaErrorWord(stream), k.label_k,
                                                    k.label_v, stream));
#else
    return ToOrtStatus(Status(Code::kRuntime, "RotaryCacheUpdate: this build of ortkv has no CUDA kernels"));
#endif
  }
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(
      CheckCacheWriteProtection(kOp, k.names.node, k.names.inputs[1], view.k, device_type, device_id)));
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(
      CheckCacheWriteProtection(kOp, k.names.node, k.names.inputs[2], view.v, device_type, device_id)));
  const int64_t tokens = view.rows * view.n;
  // a decode step (a few tokens) is cheaper than a thread-pool dispatch; split a prefill by tokens
  constexpr int64_t kTokensPerTask = 32;
  if (tokens <= kTokensPerTask) {
    ortkv::RotaryCacheUpdateCpu(view, 0, tokens);
    return nullptr;
  }
  RotaryJob job{&view, kTokensPerTask};
  return g_api->KernelContext_ParallelFor(ctx, RotaryJobFn, static_cast<size_t>((tokens + kTokensPerTask - 1) / kTokensPerTask),
                                          0, &job);
}

OrtStatus* CreateRotary(const OrtApi* api, const OrtKernelInfo* info, void** kernel, bool cuda) {
  auto k = std::make_unique<RotaryKernel>();
  k->cuda = cuda;
  ORTKV_RETURN_IF_ORT_ERROR(ReadNodeNames(api, info, 6, 3, &k->names));
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfoGetAttribute_int64(info, "num_heads", &k->heads));
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfoGetAttribute_int64(info, "kv_num_heads", &k->kv_heads));
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, k->names.node, "seq_axis", int64_t{-2}, &k->seq_axis));
  if (cuda) {
    k->label_k = ortkv_core_register_label(kOp, k->names.node.c_str(), k->names.inputs[1].c_str());
    k->label_v = ortkv_core_register_label(kOp, k->names.node.c_str(), k->names.inputs[2].c_str());
  }
  *kernel = k.release();
  return nullptr;
}

OrtStatus* InferRotary(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  const int64_t h = InferAttr(ctx, "num_heads", -1), hkv = InferAttr(ctx, "kv_num_heads", -1);
  ORTKV_RETURN_IF_ORT_ERROR(SetLastDimFrom(ctx, 0, 0, [&](int64_t w) -> int64_t {
    if (h < 1 || hkv < 1 || w % (h + 2 * hkv) != 0) return -1;
    return w / (h + 2 * hkv) * h;
  }));
  for (size_t i = 1; i <= 2; ++i) {  // the caches' type and shape
    OrtTensorTypeAndShapeInfo* info = nullptr;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->ShapeInferContext_GetInputTypeShape(ctx, i, &info));
    ORTKV_RETURN_IF_ORT_ERROR(g_api->ShapeInferContext_SetOutputTypeShape(ctx, i, info));
  }
  return nullptr;
}

size_t RotaryAliasMap(int** input_index, int** output_index) {
  *input_index = new int[2]{1, 2};
  *output_index = new int[2]{1, 2};
  return 2;
}

void ReleaseAliasMap(int* input_index, int* output_index) {
  delete[] input_index;
  delete[] output_index;
}

OrtCustomOp MakeRotary(bool cuda) {
  OrtCustomOp op;
  InitCustomOp(&op);  // version >= 18: GetAliasMap is honoured
  op.GetName = [](const OrtCustomOp*) { return "RotaryCacheUpdate"; };
  op.GetExecutionProviderType = cuda ? [](const OrtCustomOp*) -> const char* { return "CUDAExecutionProvider"; }
                                     : [](const OrtCustomOp*) -> const char* { return nullptr; };
  // floats of one type (checked by the kernel with a named error: declared as any type so that ORT never wraps
  // a float16 node in Casts on the CPU, Note [CacheAttention CPU types]); positions int64, on the op's device
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 6; };
  op.GetInputType = [](const OrtCustomOp*, size_t i) {
    return i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 3; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
  op.CreateKernelV2 = cuda ? [](const OrtCustomOp*, const OrtApi* a, const OrtKernelInfo* i, void** k) {
    return CreateRotary(a, i, k, true);
  }
                           : [](const OrtCustomOp*, const OrtApi* a, const OrtKernelInfo* i, void** k) {
                               return CreateRotary(a, i, k, false);
                             };
  op.KernelComputeV2 = ComputeRotary;
  op.KernelDestroy = [](void* k) { delete static_cast<RotaryKernel*>(k); };
  op.InferOutputShapeFn = InferRotary;
  op.GetAliasMap = RotaryAliasMap;
  op.ReleaseAliasMap = ReleaseAliasMap;
  return op;
}

// --- SwiGLU ---------------------------------------------------------------------------------------------
struct SwiGLUKernel {
  NodeNames names;
  bool cuda = false;
};

struct SwiGLUJob {
  const float* x;
  float* y;
  int64_t f, rows, chunk;
};

void SwiGLUJobFn(void* user, size_t i) {
  const auto* j = static_cast<const SwiGLUJob*>(user);
  const int64_t begin = static_cast<int64_t>(i) * j->chunk;
  ortkv::SwiGLUCpu(j->x, j->y, j->f, begin, std::min(begin + j->chunk, j->rows));
}

OrtStatus* ComputeSwiGLU(void* op_kernel, OrtKernelContext* ctx) {
  const auto& k = *static_cast<const SwiGLUKernel*>(op_kernel);
  const OrtValue* in = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetInput(ctx, 0, &in));
  thread_local TensorArg xs[1];  // Note [Input slots]
  ClearArgs(xs);
  TensorArg& x = xs[0];
  ORTKV_RETURN_IF_ORT_ERROR(ReadTensor(in, k.names.inputs[0], &x, nullptr, nullptr));
  int64_t rows = 0, f = 0;
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::CheckSwiGLU(k.names.node, x, &rows, &f)));
  if (!k.cuda && x.elem_type != ortkv::kFloat32) {
    std::ostringstream m;
    m << "SwiGLU node '" << k.names.node << "': input '" << x.name << "' is " << ortkv::ElemTypeName(x.elem_type)
      << "; the CPU kernel takes float32 (float16 / bfloat16 run on CUDAExecutionProvider)";
    return ToOrtStatus(Status(Code::kInvalidArgument, m.str()));
  }
  std::vector<int64_t> dims = x.dims;
  dims.back() = f;
  OrtValue* out = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetOutput(ctx, 0, dims.data(), dims.size(), &out));
  void* y = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorMutableData(out, &y));
  if (rows == 0) return nullptr;
  if (k.cuda) {
#if defined(ORTKV_WITH_CUDA)
    void* stream = nullptr;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetGPUComputeStream(ctx, &stream));
    return ToOrtStatus(ortkv::SwiGLUCuda(x.data, y, x.elem_type, rows, f, stream));
#else
    return ToOrtStatus(Status(Code::kRuntime, "SwiGLU: this build of ortkv has no CUDA kernels"));
#endif
  }
  constexpr int64_t kElemsPerTask = 64 << 10;
  const int64_t chunk = std::max<int64_t>(1, kElemsPerTask / f);
  if (rows <= chunk) {
    ortkv::SwiGLUCpu(static_cast<const float*>(x.data), static_cast<float*>(y), f, 0, rows);
    return nullptr;
  }
  SwiGLUJob job{static_cast<const float*>(x.data), static_cast<float*>(y), f, rows, chunk};
  return g_api->KernelContext_ParallelFor(ctx, SwiGLUJobFn, static_cast<size_t>((rows + chunk - 1) / chunk), 0, &job);
}

OrtStatus* InferSwiGLU(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  return SetLastDimFrom(ctx, 0, 0, [](int64_t w) -> int64_t { return w % 2 == 0 ? w / 2 : -1; });
}

OrtCustomOp MakeSwiGLU(bool cuda) {
  OrtCustomOp op;
  InitCustomOp(&op);
  op.GetName = [](const OrtCustomOp*) { return "SwiGLU"; };
  op.GetExecutionProviderType = cuda ? [](const OrtCustomOp*) -> const char* { return "CUDAExecutionProvider"; }
                                     : [](const OrtCustomOp*) -> const char* { return nullptr; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetInputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
  op.CreateKernelV2 = cuda ? [](const OrtCustomOp*, const OrtApi* a, const OrtKernelInfo* i, void** kernel) {
    auto k = std::make_unique<SwiGLUKernel>();
    k->cuda = true;
    ORTKV_RETURN_IF_ORT_ERROR(ReadNodeNames(a, i, 1, 1, &k->names));
    *kernel = k.release();
    return static_cast<OrtStatus*>(nullptr);
  }
                           : [](const OrtCustomOp*, const OrtApi* a, const OrtKernelInfo* i, void** kernel) {
                               auto k = std::make_unique<SwiGLUKernel>();
                               ORTKV_RETURN_IF_ORT_ERROR(ReadNodeNames(a, i, 1, 1, &k->names));
                               *kernel = k.release();
                               return static_cast<OrtStatus*>(nullptr);
                             };
  op.KernelComputeV2 = ComputeSwiGLU;
  op.KernelDestroy = [](void* k) { delete static_cast<SwiGLUKernel*>(k); };
  op.InferOutputShapeFn = InferSwiGLU;
  return op;
}

const OrtCustomOp kRotaryCpu = MakeRotary(false);
const OrtCustomOp kSwiGLUCpu = MakeSwiGLU(false);
#if defined(ORTKV_WITH_CUDA)
const OrtCustomOp kRotaryCuda = MakeRotary(true);
const OrtCustomOp kSwiGLUCuda = MakeSwiGLU(true);
#endif

}  // namespace

void AppendFusedOps(std::vector<const OrtCustomOp*>* ops) {
  ops->push_back(&kRotaryCpu);
  ops->push_back(&kSwiGLUCpu);
#if defined(ORTKV_WITH_CUDA)
  ops->push_back(&kRotaryCuda);
  ops->push_back(&kSwiGLUCuda);
#endif
}

}  // namespace ortkv_ort
