// CacheAttention(query, key_cache, value_cache, start) -> output, domain "ortkv", opset 1.
// See Note [CacheAttention] in ortkv/cache_attention.h. The caches are read where they lie (the
// outputs of CacheUpdate); the op never copies or slices them. Attributes: num_heads, kv_num_heads
// (required), scale (default 1/sqrt(head_size)), seq_axis (1: BSNH caches, default; 2: BNSH;
// 0: SBNH).
// CPU: float32. CUDA (CUDAExecutionProvider, CUDA builds): float32, float16, bfloat16, every input in
// device memory including `start` (so that a step can be captured as a CUDA graph), launched on ORT's
// compute stream; Note [CacheAttention CUDA].
#include <memory>
#include <vector>

#include "ops.h"
#include "ort_util.h"
#include "ortkv/cache_attention.h"
#include "ortkv/core.h"
#include "cuda_util.h"

namespace ortkv_ort {
namespace {

struct CacheAttentionKernel {
  NodeNames names;
  bool cuda = false;
  int32_t label = -1;  // Note [CUDA deferred errors]
  int64_t num_heads = 0, kv_num_heads = 0, seq_axis = 1;
  float scale = 0.0f;
};

OrtStatus* Compute(void* op_kernel, OrtKernelContext* ctx) {
  const auto& k = *static_cast<const CacheAttentionKernel*>(op_kernel);
  const OrtValue* in[4] = {nullptr, nullptr, nullptr, nullptr};
  thread_local ortkv::TensorArg args[4];  // Note [Input slots]
  ClearArgs(args);
  for (size_t i = 0; i < 4; ++i) {
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetInput(ctx, i, &in[i]));
    ORTKV_RETURN_IF_ORT_ERROR(ReadTensor(in[i], k.names.inputs[i], &args[i], nullptr, nullptr));
  }
  OrtValue* out = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetOutput(ctx, 0, args[0].dims.data(), args[0].dims.size(), &out));
  void* out_data = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorMutableData(out, &out_data));
  ortkv::CacheAttentionView view;
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::PlanCacheAttention(k.names.node, args[0], args[1], args[2], args[3],
                                                                  k.num_heads, k.kv_num_heads, k.scale, k.seq_axis,
                                                                  static_cast<float*>(out_data), &view)));
  if (view.tasks() == 0) return nullptr;
  ortkv::CoreLease lease;  // the caches are read here: no Arena release/close meanwhile (Note [Arena lease])
  // split-K partials (Note [CacheAttention CPU split-K]): a few KiB, merged after every task ran
  return RunAttentionTasks<ortkv::CacheAttentionView, ortkv::CacheAttentionCpu, ortkv::CacheAttentionCombine>(ctx,
                                                                                                             view);
}

#if defined(ORTKV_WITH_CUDA)
OrtStatus* ComputeCuda(void* op_kernel, OrtKernelContext* ctx) {
  const auto& k = *static_cast<const CacheAttentionKernel*>(op_kernel);
  ORTKV_RETURN_IF_ORT_ERROR(TakeDeviceError(ctx));  // a previous run's device-side error (Note [CUDA deferred errors])
  const OrtValue* in[4] = {nullptr, nullptr, nullptr, nullptr};
  thread_local ortkv::TensorArg args[4];  // Note [Input slots]
  ClearArgs(args);
  int device_type = ORTKV_DEVICE_CUDA, device_id = 0;
  for (size_t i = 0; i < 4; ++i) {
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetInput(ctx, i, &in[i]));
    ORTKV_RETURN_IF_ORT_ERROR(
        ReadTensor(in[i], k.names.inputs[i], &args[i], i == 1 ? &device_type : nullptr, i == 1 ? &device_id : nullptr));
  }
  OrtValue* out = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetOutput(ctx, 0, args[0].dims.data(), args[0].dims.size(), &out));
  void* out_data = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorMutableData(out, &out_data));
  ortkv::CacheAttentionCudaView view;
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::PlanCacheAttentionCuda(
      k.names.node, args[0], args[1], args[2], args[3], k.num_heads, k.kv_num_heads, k.scale, k.seq_axis, out_data,
      CachedSmCount(device_id), &view)));
  if (view.units() == 0) return nullptr;
  view.label = k.label;
  void* stream = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetGPUComputeStream(ctx, &stream));
  view.error_word = ortkv::CudaErrorWord(stream);
  DeviceScratch scratch;
  if (view.splits > 1) {
    ORTKV_RETURN_IF_ORT_ERROR(scratch.Alloc(ctx, device_id, view.workspace_bytes()));
    view.partial = static_cast<float*>(scratch.ptr);
  }
  ortkv::CoreLease lease;  // the caches are read here: no Arena release/close meanwhile (Note [Arena lease])
  return ToOrtStatus(ortkv::CacheAttentionCuda(view, stream));
}
#endif

OrtStatus* Create(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel, bool cuda) {
  auto k = std::make_unique<CacheAttentionKernel>();
  k->cuda = cuda;
  ORTKV_RETURN_IF_ORT_ERROR(ReadNodeNames(api, info, 4, 1, &k->names));
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfoGetAttribute_int64(info, "num_heads", &k->num_heads));
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfoGetAttribute_int64(info, "kv_num_heads", &k->kv_num_heads));
  // absent: scale 1/sqrt(head_size) (0 here), seq_axis 1 (BSNH)
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, k->names.node, "scale", 0.0f, &k->scale));
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, k->names.node, "seq_axis", int64_t{1}, &k->seq_axis));
  if (cuda) k->label = ortkv_core_register_label("CacheAttention", k->names.node.c_str(), k->names.inputs[1].c_str());
  *kernel = k.release();
  return nullptr;
}

OrtStatus* InferShape(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
  ORTKV_RETURN_IF_ORT_ERROR(g_api->ShapeInferContext_GetInputTypeShape(ctx, 0, &info));
  return g_api->ShapeInferContext_SetOutputTypeShape(ctx, 0, info);
}

OrtCustomOp MakeOp(bool cuda) {
  OrtCustomOp op;
  InitCustomOp(&op);
  op.GetName = [](const OrtCustomOp*) { return "CacheAttention"; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 4; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  if (cuda) {
    // float32, float16 or bfloat16 (checked by the kernel with a named error); start int64 on the device
    op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CUDAExecutionProvider"; };
    op.GetInputType = [](const OrtCustomOp*, size_t i) {
      return i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    };
    op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
    op.CreateKernelV2 = [](const OrtCustomOp* o, const OrtApi* a, const OrtKernelInfo* i, void** k) {
      return Create(o, a, i, k, true);
    };
#if defined(ORTKV_WITH_CUDA)
    op.KernelComputeV2 = ComputeCuda;
#endif
  } else {
    // Note [CacheAttention CPU types]: float32 only, but declared as any type and refused by the kernel
    // with a named error. Declared FLOAT, a float16 node would pass ORT's schema check (the CUDA
    // registration of the same op takes float16) and ORT's InsertCastTransformer would then wrap it in
    // Casts on the CPU: a silent float32 copy of both caches on every run.
    op.GetInputType = [](const OrtCustomOp*, size_t i) {
      return i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    };
    op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
    op.CreateKernelV2 = [](const OrtCustomOp* o, const OrtApi* a, const OrtKernelInfo* i, void** k) {
      return Create(o, a, i, k, false);
    };
    op.KernelComputeV2 = Compute;
  }
  op.KernelDestroy = [](void* k) { delete static_cast<CacheAttentionKernel*>(k); };
  op.InferOutputShapeFn = InferShape;
  return op;
}

const OrtCustomOp kCacheAttentionCpu = MakeOp(false);
#if defined(ORTKV_WITH_CUDA)
const OrtCustomOp kCacheAttentionCuda = MakeOp(true);
#endif

}  // namespace

void AppendCacheAttentionOps(std::vector<const OrtCustomOp*>* ops) {
  ops->push_back(&kCacheAttentionCpu);
#if defined(ORTKV_WITH_CUDA)
  ops->push_back(&kCacheAttentionCuda);
#endif
}

}  // namespace ortkv_ort
