// PagedCacheUpdate, PagedRotaryCacheUpdate and PagedCacheAttention, domain "ortkv", opset 1 (CPU; and CUDA in CUDA builds: Note
// [Paged CUDA] in ortkv/paged_cuda.h, every input in device memory, positions / starts included). The physical form (pool,
// directory, page table) is Note [Paged cache physical form] in ortkv/paged.h.
//
//   updated_pool = PagedCacheUpdate(pool, directory, page_table, key, value, position[, page_fill])
//       attributes layer, num_layers, kv_num_heads, page_size (all required)
//   output = PagedCacheAttention(query, pool, directory, page_table, start[, page_fill])
//       attributes num_heads, kv_num_heads, layer, num_layers, page_size (required), scale (default
//       1/sqrt(head_size)), page_format (default "": any; a format name: every page read must have it, and on
//       CUDA F16 / BF16 under queries of that type run Note [Paged CUDA uniform 16-bit])
//
// PagedCacheUpdate's output MUST be the pool's storage: declared with GetAliasMap (0 <- 0) and
// enforced by a pointer check before anything is written, exactly as CacheUpdate (Note [Aliasing
// CacheUpdate output] in cache_update_op.cc says why GetAliasMap and not GetMayInplace). The directory
// and the page table are read, never written: the host changes them between runs. page_fill, int32
// [batch, max_pages], is optional (INPUT_OUTPUT_OPTIONAL; Note [Page fill] in ortkv/paged.h; on CUDA
// Note [Page fill] on CUDA in ortkv/paged_cuda.h).
#include <algorithm>
#include <cctype>
#include <memory>
#include <sstream>
#include <vector>

#include "ops.h"
#include "ort_util.h"
#include "ortkv/core.h"
#include "ortkv/paged.h"
#include "ortkv/paged_cuda.h"
#include "cuda_util.h"

namespace ortkv_ort {
namespace {

using ortkv::Code;
using ortkv::Status;
using ortkv::TensorArg;

struct PagedKernel {
  const char* op = "PagedCacheUpdate";  // the updates' messages: PagedCacheUpdate or PagedRotaryCacheUpdate
  NodeNames names;
  int32_t label = -1;  // CUDA: Note [CUDA deferred errors]
  ortkv::PagedAttrs attrs;
  int64_t num_heads = 0;  // attention and PagedRotaryCacheUpdate
  float scale = 0.0f;     // attention only
#if defined(ORTKV_WITH_CUDA)
  // CUDA attention: Note [Paged CUDA last block reports] (kernels/cuda/paged_cuda.cu)
  std::unique_ptr<ortkv::PagedReportWords> report_words;
#endif
};

OrtStatus* ReadAttrs(const OrtApi* api, const OrtKernelInfo* info, PagedKernel* k) {
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfoGetAttribute_int64(info, "layer", &k->attrs.layer));
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfoGetAttribute_int64(info, "num_layers", &k->attrs.num_layers));
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfoGetAttribute_int64(info, "kv_num_heads", &k->attrs.kv_num_heads));
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfoGetAttribute_int64(info, "page_size", &k->attrs.page_size));
  return nullptr;
}

OrtStatus* ReadInputs(OrtKernelContext* ctx, const PagedKernel& k, size_t n, TensorArg* args, int* device_type,
                      int* device_id) {
  for (size_t i = 0; i < n; ++i) {
    const OrtValue* v = nullptr;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetInput(ctx, i, &v));
    ORTKV_RETURN_IF_ORT_ERROR(ReadTensor(v, k.names.inputs[i], &args[i], i == 0 ? device_type : nullptr,
                                         i == 0 ? device_id : nullptr));
  }
  return nullptr;
}

// Note [Page fill]: the optional last input. The node's own input count (a node may omit the port),
// capped at `all`; names are read for the present ports only.
OrtStatus* ReadNames(const OrtApi* api, const OrtKernelInfo* info, size_t required, size_t all, NodeNames* names,
                     size_t outputs = 1) {
  size_t n = 0;
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfo_GetInputCount(info, &n));
  ORTKV_RETURN_IF_ORT_ERROR(ReadNodeNames(api, info, std::min(std::max(n, required), all), outputs, names));
  return nullptr;
}

// The optional input `index` (page_fill): *present false when the node omits it or binds nothing.
OrtStatus* ReadOptionalInput(OrtKernelContext* ctx, const PagedKernel& k, size_t index, TensorArg* arg, bool* present) {
  *present = false;
  size_t n = 0;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetInputCount(ctx, &n));
  if (index >= n || index >= k.names.inputs.size()) return nullptr;
  const OrtValue* v = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetInput(ctx, index, &v));
  if (v == nullptr) return nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(ReadTensor(v, k.names.inputs[index], arg, nullptr, nullptr));
  *present = true;
  return nullptr;
}

// ---- PagedCacheUpdate --------------------------------------------------------------------------------
struct UpdateJob {
  const ortkv::PagedUpdateView* view;
  int64_t chunk;
};

void UpdateTask(void* user, size_t i) {
  const auto* j = static_cast<const UpdateJob*>(user);
  const int64_t begin = static_cast<int64_t>(i) * j->chunk;
  ortkv::PagedCacheUpdateCpu(*j->view, begin, std::min(begin + j->chunk, j->view->units()));
}

Status CheckWriteProtection(const PagedKernel& k, const ortkv::PagedUpdateView& v, int device_type, int device_id) {
  // Note [Write-protection check] in ortkv/protected_writes.h
  return CheckProtectedWrites(
      device_type, device_id, v.units(),
      [&](int64_t u, uintptr_t* first, uintptr_t* last) { ortkv::PagedUpdateUnitSpan(v, u, first, last); },
      [&](int64_t u) {
        std::ostringstream m;
        m << k.op << " node '" << k.names.node << "': row " << u / v.T << " token " << u % v.T
          << " would write into the page layer";
        return std::make_pair(m.str(), " of '" + k.names.inputs[0] + "',");
      },
      "commit the page's slot before the run.", "give the sequence its own copy of the page (copy on write).");
}

// MUST_ALIAS: the updated pool (output 0) is the pool's own storage (input 0), on the CPU and on CUDA alike.
OrtStatus* CheckPoolAliased(OrtKernelContext* ctx, const PagedKernel& k, const TensorArg& pool) {
  OrtValue* out = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetOutput(ctx, 0, pool.dims.data(), pool.dims.size(), &out));
  void* out_data = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorMutableData(out, &out_data));
  if (out_data == pool.data) return nullptr;
  ortkv::Message m;  // Note [Messages on the error path only]
  m << k.op << " node '" << k.names.node << "': output '" << k.names.outputs[0] << "' at " << Hex(out_data)
    << " is not the storage of the pool '" << k.names.inputs[0] << "' at " << Hex(pool.data)
    << "; the updated pool MUST alias the pool and ortkv never copies a cache, so nothing was written. "
    << "Remedy: bind ONE buffer to both names through IOBinding (bind_ortvalue_input('" << k.names.inputs[0]
    << "', v) and bind_ortvalue_output('" << k.names.outputs[0] << "', v) with the same OrtValue v), or run the "
    << "model through ortkv.MutableCacheSession.";
  return ToOrtStatus(Status(Code::kAlias, m.str()));
}

OrtStatus* StoreUpdate(OrtKernelContext* ctx, const PagedKernel& k, const ortkv::PagedUpdateView& view, int device_type,
                       int device_id);

OrtStatus* UpdateCompute(void* op_kernel, OrtKernelContext* ctx) {
  const auto& k = *static_cast<const PagedKernel*>(op_kernel);
  thread_local TensorArg in[7];  // Note [Input slots]
  ClearArgs(in);
  int device_type = ORTKV_DEVICE_CPU, device_id = 0;
  ORTKV_RETURN_IF_ORT_ERROR(ReadInputs(ctx, k, 6, in, &device_type, &device_id));
  bool fill = false;
  ORTKV_RETURN_IF_ORT_ERROR(ReadOptionalInput(ctx, k, 6, &in[6], &fill));
  ortkv::PagedUpdateView view;
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::PlanPagedCacheUpdate(k.names.node, in[0], in[1], in[2], in[3], in[4], in[5],
                                                                    k.attrs, &view, fill ? &in[6] : nullptr)));
  ORTKV_RETURN_IF_ORT_ERROR(CheckPoolAliased(ctx, k, in[0]));
  return StoreUpdate(ctx, k, view, device_type, device_id);
}

// The write-protection check and the encode of a planned update (the pool's alias checked).
OrtStatus* StoreUpdate(OrtKernelContext* ctx, const PagedKernel& k, const ortkv::PagedUpdateView& view, int device_type,
                       int device_id) {
  ortkv::CoreLease lease;  // check and write as one (Note [Arena lease])
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(CheckWriteProtection(k, view, device_type, device_id)));
  const int64_t units = view.units();
  if (units == 0) return nullptr;
  // one unit encodes 2 * kv_heads rows; a decode step (a few units) is cheaper than a dispatch
  const int64_t rows_per_unit = 2 * view.p.shape.kv_heads;
  const int64_t chunk = std::max<int64_t>(1, 256 / std::max<int64_t>(1, rows_per_unit));
  if (units <= chunk) {
    ortkv::PagedCacheUpdateCpu(view, 0, units);
    return nullptr;
  }
  UpdateJob job{&view, chunk};
  return g_api->KernelContext_ParallelFor(ctx, UpdateTask, static_cast<size_t>((units + chunk - 1) / chunk), 0, &job);
}

OrtStatus* UpdateCreate(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
  auto k = std::make_unique<PagedKernel>();
  ORTKV_RETURN_IF_ORT_ERROR(ReadNames(api, info, 6, 7, &k->names));
  ORTKV_RETURN_IF_ORT_ERROR(ReadAttrs(api, info, k.get()));
  *kernel = k.release();
  return nullptr;
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

OrtStatus* SameAsInput(OrtShapeInferContext* ctx, size_t input) {
  OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
  ORTKV_RETURN_IF_ORT_ERROR(g_api->ShapeInferContext_GetInputTypeShape(ctx, input, &info));
  return g_api->ShapeInferContext_SetOutputTypeShape(ctx, 0, info);
}

OrtCustomOp MakeUpdate() {
  OrtCustomOp op;
  InitCustomOp(&op);
  op.GetName = [](const OrtCustomOp*) { return "PagedCacheUpdate"; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 7; };
  // pool uint8, directory int64, page_table int32, key/value float32/float16/bfloat16 (checked by the
  // kernel with a named error), position int64, page_fill int32 (optional, Note [Page fill])
  op.GetInputType = [](const OrtCustomOp*, size_t i) {
    switch (i) {
      case 0: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
      case 1: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
      case 2: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
      case 5: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
      case 6: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
      default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    }
  };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
    return i == 6 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8; };
  op.CreateKernelV2 = UpdateCreate;
  op.KernelComputeV2 = UpdateCompute;
  op.KernelDestroy = [](void* k) { delete static_cast<PagedKernel*>(k); };
  op.InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* ctx) { return SameAsInput(ctx, 0); };
  op.GetAliasMap = AliasMap;
  op.ReleaseAliasMap = ReleaseAliasMap;
  return op;
}

// ---- PagedRotaryCacheUpdate (Note [PagedRotaryCacheUpdate] in ortkv/paged.h) --------------------------------
//   updated_pool, q_rot = PagedRotaryCacheUpdate(pool, directory, page_table, qkv, position, cos_cache, sin_cache
//                                                [, page_fill])
//       attributes layer, num_layers, kv_num_heads, page_size, num_heads (all required)
// Output 0 MUST alias input 0 (as PagedCacheUpdate's); q_rot is a new tensor.
const std::string kRotaryOp = "PagedRotaryCacheUpdate";

OrtStatus* QOutput(OrtKernelContext* ctx, const ortkv::PagedRotary& r, void** data) {
  const int64_t dims[3] = {r.B, r.T, r.heads * r.head_size};
  OrtValue* out = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetOutput(ctx, 1, dims, 3, &out));
  return g_api->GetTensorMutableData(out, data);
}

OrtStatus* RotaryUpdateCompute(void* op_kernel, OrtKernelContext* ctx) {
  const auto& k = *static_cast<const PagedKernel*>(op_kernel);
  thread_local TensorArg in[8];  // Note [Input slots]
  ClearArgs(in);
  int device_type = ORTKV_DEVICE_CPU, device_id = 0;
  ORTKV_RETURN_IF_ORT_ERROR(ReadInputs(ctx, k, 7, in, &device_type, &device_id));
  bool fill = false;
  ORTKV_RETURN_IF_ORT_ERROR(ReadOptionalInput(ctx, k, 7, &in[7], &fill));
  ortkv::PagedRotary r;
  thread_local TensorArg cols[2];  // the rotated k and the v columns, contiguous (a step's rows)
  ClearArgs(cols);
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::PlanPagedRotary(k.names.node, in[3], in[4], in[5], in[6], k.num_heads,
                                                               k.attrs, true, &r, &cols[0], &cols[1])));
  thread_local std::vector<uint8_t> kbuf, vbuf;
  const size_t bytes = static_cast<size_t>(r.B * r.T * r.kv_heads * r.head_size) * (r.elem_type == ortkv::kFloat32 ? 4 : 2);
  kbuf.resize(bytes);
  vbuf.resize(bytes);
  const int64_t cap = in[2].dims.size() == 2 ? in[2].dims[1] * k.attrs.page_size : 0;
  ortkv::PagedRotaryKeysCpu(r, cap, kbuf.data(), vbuf.data());
  cols[0].data = kbuf.data();
  cols[1].data = vbuf.data();
  ortkv::PagedUpdateView view;
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::PlanPagedCacheUpdate(k.names.node, in[0], in[1], in[2], cols[0], cols[1],
                                                                    in[4], k.attrs, &view, fill ? &in[7] : nullptr,
                                                                    &kRotaryOp, &in[5])));
  ORTKV_RETURN_IF_ORT_ERROR(CheckPoolAliased(ctx, k, in[0]));
  void* q_out = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(QOutput(ctx, r, &q_out));
  ORTKV_RETURN_IF_ORT_ERROR(StoreUpdate(ctx, k, view, device_type, device_id));
  if (r.B * r.T > 0) ortkv::PagedRotaryQueriesCpu(r, q_out);  // the plan proved every position
  return nullptr;
}

OrtStatus* RotaryUpdateCreate(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
  auto k = std::make_unique<PagedKernel>();
  k->op = "PagedRotaryCacheUpdate";
  ORTKV_RETURN_IF_ORT_ERROR(ReadNames(api, info, 7, 8, &k->names, 2));
  ORTKV_RETURN_IF_ORT_ERROR(ReadAttrs(api, info, k.get()));
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfoGetAttribute_int64(info, "num_heads", &k->num_heads));
  *kernel = k.release();
  return nullptr;
}

OrtStatus* InferRotaryUpdate(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  ORTKV_RETURN_IF_ORT_ERROR(SameAsInput(ctx, 0));
  const int64_t h = InferAttr(ctx, "num_heads", -1), hkv = InferAttr(ctx, "kv_num_heads", -1);
  return SetLastDimFrom(ctx, 3, 1, [&](int64_t w) -> int64_t {
    if (h < 1 || hkv < 1 || w % (h + 2 * hkv) != 0) return -1;
    return w / (h + 2 * hkv) * h;
  });
}

OrtCustomOp MakeRotaryUpdate() {
  OrtCustomOp op;
  InitCustomOp(&op);
  op.GetName = [](const OrtCustomOp*) { return "PagedRotaryCacheUpdate"; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 8; };
  // pool uint8, directory int64, page_table int32, qkv / cos / sin float32/float16/bfloat16 (checked by the kernel
  // with a named error), position int64, page_fill int32 (optional, Note [Page fill])
  op.GetInputType = [](const OrtCustomOp*, size_t i) {
    switch (i) {
      case 0: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
      case 1: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
      case 2: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
      case 4: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
      case 7: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
      default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    }
  };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
    return i == 7 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 2; };
  op.GetOutputType = [](const OrtCustomOp*, size_t i) {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  };
  op.CreateKernelV2 = RotaryUpdateCreate;
  op.KernelComputeV2 = RotaryUpdateCompute;
  op.KernelDestroy = [](void* k) { delete static_cast<PagedKernel*>(k); };
  op.InferOutputShapeFn = InferRotaryUpdate;
  op.GetAliasMap = AliasMap;
  op.ReleaseAliasMap = ReleaseAliasMap;
  return op;
}

// ---- PagedCacheAttention -----------------------------------------------------------------------------
OrtStatus* AttnCompute(void* op_kernel, OrtKernelContext* ctx) {
  const auto& k = *static_cast<const PagedKernel*>(op_kernel);
  thread_local TensorArg in[6];  // Note [Input slots]
  ClearArgs(in);
  ORTKV_RETURN_IF_ORT_ERROR(ReadInputs(ctx, k, 5, in, nullptr, nullptr));
  bool fill = false;
  ORTKV_RETURN_IF_ORT_ERROR(ReadOptionalInput(ctx, k, 5, &in[5], &fill));
  OrtValue* out = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetOutput(ctx, 0, in[0].dims.data(), in[0].dims.size(), &out));
  void* out_data = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorMutableData(out, &out_data));
  ortkv::PagedAttentionView view;
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::PlanPagedCacheAttention(k.names.node, in[0], in[1], in[2], in[3], in[4],
                                                                       k.num_heads, k.attrs, k.scale, out_data, &view,
                                                                       fill ? &in[5] : nullptr)));
  if (view.tasks() == 0) return nullptr;
  ortkv::CoreLease lease;  // the pool is read here (Note [Arena lease])
  return RunAttentionTasks<ortkv::PagedAttentionView, ortkv::PagedCacheAttentionCpu, ortkv::PagedCacheAttentionCombine>(
      ctx, view);
}

// The optional string attribute page_format (absent or "": -1, pages of any format): a format name, F16 .. INT2_KC
// in either case (Note [Paged CUDA uniform 16-bit] in kernels/cuda/paged_cuda.cu).
OrtStatus* ReadPageFormat(const OrtApi* api, const OrtKernelInfo* info, const std::string& node, int32_t* out) {
  *out = -1;
  std::string name;
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, node, "page_format", std::string(), &name));
  if (name.empty()) return nullptr;
  std::string upper = name;
  std::transform(upper.begin(), upper.end(), upper.begin(), [](unsigned char ch) { return static_cast<char>(std::toupper(ch)); });
  std::string names;
  for (int32_t f = 0; f < ortkv::codecs::kNumPageFormats; ++f) {
    const char* fn = ortkv::codecs::FormatName(static_cast<ortkv::codecs::PageFormat>(f));
    if (upper == fn) {
      *out = f;
      return nullptr;
    }
    names += (f ? ", " : "") + std::string(fn);
  }
  const std::string m = "[ortkv:E_INPUT] PagedCacheAttention node '" + node + "': attribute page_format = '" + name +
                        "' is not a page format; use one of " + names +
                        " (either case), or leave it out for pages of any format";
  return api->CreateStatus(ORT_INVALID_ARGUMENT, m.c_str());
}

// The optional int attribute static_tables, 0 (absent) or 1 (Note [Paged CUDA static tables] in
// kernels/cuda/paged_cuda.cu): the CPU kernels read the tables once either way.
OrtStatus* ReadStaticTables(const OrtApi* api, const OrtKernelInfo* info, const std::string& node, bool* out) {
  int64_t v = 0;
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, node, "static_tables", int64_t{0}, &v));
  if (v != 0 && v != 1) {
    const std::string m = "[ortkv:E_INPUT] PagedCacheAttention node '" + node + "': attribute static_tables = " +
                          std::to_string(v) + " is not 0 or 1; set 1 only when the directory and page table are " +
                          "graph inputs or initializers (no node of the graph writes them), else leave it out";
    return api->CreateStatus(ORT_INVALID_ARGUMENT, m.c_str());
  }
  *out = v == 1;
  return nullptr;
}

OrtStatus* AttnCreate(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
  auto k = std::make_unique<PagedKernel>();
  ORTKV_RETURN_IF_ORT_ERROR(ReadNames(api, info, 5, 6, &k->names));
  ORTKV_RETURN_IF_ORT_ERROR(ReadAttrs(api, info, k.get()));
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfoGetAttribute_int64(info, "num_heads", &k->num_heads));
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, k->names.node, "scale", 0.0f, &k->scale));
  ORTKV_RETURN_IF_ORT_ERROR(ReadPageFormat(api, info, k->names.node, &k->attrs.page_format));
  ORTKV_RETURN_IF_ORT_ERROR(ReadStaticTables(api, info, k->names.node, &k->attrs.static_tables));
  *kernel = k.release();
  return nullptr;
}

OrtCustomOp MakeAttention() {
  OrtCustomOp op;
  InitCustomOp(&op);
  op.GetName = [](const OrtCustomOp*) { return "PagedCacheAttention"; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 6; };
  op.GetInputType = [](const OrtCustomOp*, size_t i) {
    switch (i) {
      case 1: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
      case 2: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
      case 3: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
      case 4: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
      case 5: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;  // page_fill (optional, Note [Page fill])
      default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // query: float32, float16 or bfloat16
    }
  };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
    return i == 5 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
  op.CreateKernelV2 = AttnCreate;
  op.KernelComputeV2 = AttnCompute;
  op.KernelDestroy = [](void* k) { delete static_cast<PagedKernel*>(k); };
  op.InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* ctx) { return SameAsInput(ctx, 0); };
  return op;
}

const OrtCustomOp kPagedCacheUpdateCpu = MakeUpdate();
const OrtCustomOp kPagedRotaryCacheUpdateCpu = MakeRotaryUpdate();
const OrtCustomOp kPagedCacheAttentionCpu = MakeAttention();

// ---- CUDA (Note [Paged CUDA] in ortkv/paged_cuda.h) ------------------------------------------------------
#if defined(ORTKV_WITH_CUDA)
int32_t PagedLabel(const char* op, const NodeNames& n, size_t pool, size_t dir, size_t table, size_t fill) {
  std::string names = n.inputs[pool] + "\n" + n.inputs[dir] + "\n" + n.inputs[table];
  if (fill < n.inputs.size()) names += "\n" + n.inputs[fill];  // Note [Page fill]
  return ortkv_core_register_label(op, n.node.c_str(), names.c_str());
}

// The protected ranges overlapping the whole pool on its device (the kernel checks each written page
// layer against them; the page ids are on the device).
Status CollectPoolRanges(const PagedKernel& k, const ortkv::PagedPool& p, int device_id, ortkv::PagedRangeCheck* out) {
  out->count = 0;
  if (ortkv_core_protected_count() == 0 || p.pool_bytes == 0) return Status::Ok();
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p.pool), hi = lo + p.pool_bytes;
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
    if (out->count == ortkv::kPagedMaxRanges) {
      std::ostringstream m;
      m << k.op << " node '" << k.names.node << "': more than " << ortkv::kPagedMaxRanges
        << " write-protected or uncommitted ranges overlap the pool '" << k.names.inputs[0] << "' on cuda:" << device_id
        << "; the CUDA kernel checks at most " << ortkv::kPagedMaxRanges << ". Nothing was written. Remedy: commit "
        << "the slabs further, or bind a pool with fewer protected ranges";
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

OrtStatus* LaunchUpdateCuda(OrtKernelContext* ctx, const PagedKernel& k, ortkv::PagedUpdateCudaView& view, int device_id,
                            bool fill);

OrtStatus* UpdateComputeCuda(void* op_kernel, OrtKernelContext* ctx) {
  const auto& k = *static_cast<const PagedKernel*>(op_kernel);
  ORTKV_RETURN_IF_ORT_ERROR(TakeDeviceError(ctx));  // a previous launch's report (Note [CUDA deferred errors])
  thread_local TensorArg in[6];  // Note [Input slots]
  ClearArgs(in);
  int device_type = ORTKV_DEVICE_CUDA, device_id = 0;
  ORTKV_RETURN_IF_ORT_ERROR(ReadInputs(ctx, k, 6, in, &device_type, &device_id));
  thread_local TensorArg fill_args[1];
  ClearArgs(fill_args);
  TensorArg& fill_arg = fill_args[0];
  bool fill = false;
  ORTKV_RETURN_IF_ORT_ERROR(ReadOptionalInput(ctx, k, 6, &fill_arg, &fill));
  ortkv::PagedUpdateCudaView view;
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::PlanPagedCacheUpdateCuda(k.names.node, in[0], in[1], in[2], in[3], in[4],
                                                                        in[5], k.attrs, &view,
                                                                        fill ? &fill_arg : nullptr)));
  ORTKV_RETURN_IF_ORT_ERROR(CheckPoolAliased(ctx, k, in[0]));
  return LaunchUpdateCuda(ctx, k, view, device_id, fill);
}

// Workspace, protected ranges and the launch of a planned update (the pool's alias checked).
OrtStatus* LaunchUpdateCuda(OrtKernelContext* ctx, const PagedKernel& k, ortkv::PagedUpdateCudaView& view, int device_id,
                            bool fill) {
  if (view.rows() == 0) return nullptr;
  view.label = k.label;
  void* stream = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetGPUComputeStream(ctx, &stream));
  view.error_word = ortkv::CudaErrorWord(stream);
  // the flag (first 256 bytes), the row owners of the memset + check + store path (Note [Paged CUDA row owners]),
  // then page_fill's prefix sums (Note [Page fill])
  DeviceScratch flag;
  const size_t owners = ortkv::PagedUpdateOwnerBytes(view);
  ORTKV_RETURN_IF_ORT_ERROR(flag.Alloc(ctx, device_id, 256 + owners + view.fill_prefix_bytes()));
  view.flag = flag.ptr;
  view.owners = owners > 0 ? reinterpret_cast<unsigned int*>(static_cast<char*>(flag.ptr) + 256) : nullptr;
  view.fill_prefix = fill ? reinterpret_cast<int64_t*>(static_cast<char*>(flag.ptr) + 256 + owners) : nullptr;
  ortkv::CoreLease lease;  // ranges collected and the launch as one (Note [Arena lease])
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(CollectPoolRanges(k, view.p, device_id, &view.ranges)));
  return ToOrtStatus(ortkv::PagedCacheUpdateCuda(view, stream));
}

OrtStatus* RotaryUpdateComputeCuda(void* op_kernel, OrtKernelContext* ctx) {
  const auto& k = *static_cast<const PagedKernel*>(op_kernel);
  ORTKV_RETURN_IF_ORT_ERROR(TakeDeviceError(ctx));  // a previous launch's report (Note [CUDA deferred errors])
  thread_local TensorArg in[8];  // Note [Input slots]
  ClearArgs(in);
  int device_type = ORTKV_DEVICE_CUDA, device_id = 0;
  ORTKV_RETURN_IF_ORT_ERROR(ReadInputs(ctx, k, 7, in, &device_type, &device_id));
  bool fill = false;
  ORTKV_RETURN_IF_ORT_ERROR(ReadOptionalInput(ctx, k, 7, &in[7], &fill));
  ortkv::PagedRotary r;
  thread_local TensorArg cols[2];  // qkv's k and v columns, read in place by the kernels
  ClearArgs(cols);
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::PlanPagedRotary(k.names.node, in[3], in[4], in[5], in[6], k.num_heads,
                                                               k.attrs, false, &r, &cols[0], &cols[1])));
  ortkv::PagedUpdateCudaView view;
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::PlanPagedCacheUpdateCuda(k.names.node, in[0], in[1], in[2], cols[0],
                                                                        cols[1], in[4], k.attrs, &view,
                                                                        fill ? &in[7] : nullptr, &kRotaryOp)));
  ORTKV_RETURN_IF_ORT_ERROR(CheckPoolAliased(ctx, k, in[0]));
  void* q_out = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(QOutput(ctx, r, &q_out));
  view.src_stride = r.width();
  view.cos = r.cos;
  view.sin = r.sin;
  view.rotary_rows = r.table_rows;  // checked per row on the device (Note [PagedRotaryCacheUpdate])
  view.q = r.qkv;
  view.q_out = q_out;
  view.heads = r.heads;
  return LaunchUpdateCuda(ctx, k, view, device_id, fill);
}

OrtStatus* AttnComputeCuda(void* op_kernel, OrtKernelContext* ctx) {
  const auto& k = *static_cast<const PagedKernel*>(op_kernel);
  ORTKV_RETURN_IF_ORT_ERROR(TakeDeviceError(ctx));
  thread_local TensorArg in[5];  // Note [Input slots]
  ClearArgs(in);
  int device_type = ORTKV_DEVICE_CUDA, device_id = 0;
  for (size_t i = 0; i < 5; ++i) {
    const OrtValue* v = nullptr;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetInput(ctx, i, &v));
    ORTKV_RETURN_IF_ORT_ERROR(
        ReadTensor(v, k.names.inputs[i], &in[i], i == 1 ? &device_type : nullptr, i == 1 ? &device_id : nullptr));
  }
  thread_local TensorArg fill_args[1];
  ClearArgs(fill_args);
  TensorArg& fill_arg = fill_args[0];
  bool fill = false;
  ORTKV_RETURN_IF_ORT_ERROR(ReadOptionalInput(ctx, k, 5, &fill_arg, &fill));
  OrtValue* out = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetOutput(ctx, 0, in[0].dims.data(), in[0].dims.size(), &out));
  void* out_data = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorMutableData(out, &out_data));
  ortkv::PagedAttentionCudaView view;
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::PlanPagedCacheAttentionCuda(k.names.node, in[0], in[1], in[2], in[3],
                                                                           in[4], k.num_heads, k.attrs, k.scale, out_data,
                                                                           CachedSmCount(device_id), &view,
                                                                           fill ? &fill_arg : nullptr)));
  if (view.units() == 0) return nullptr;
  view.label = k.label;
  void* stream = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetGPUComputeStream(ctx, &stream));
  view.error_word = ortkv::CudaErrorWord(stream);
  if (view.B > 1 && k.report_words)  // Note [Paged CUDA last block reports]: several rows, maybe one split
    ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(k.report_words->For(stream, &view.report_words)));
  // one allocation: the flag (first 256 bytes), the split-K partials, then the per-block flags
  DeviceScratch scratch;
  ORTKV_RETURN_IF_ORT_ERROR(scratch.Alloc(
      ctx, device_id, 256 + view.partial_bytes() + view.block_flag_bytes() + view.fill_prefix_bytes()));
  char* base = static_cast<char*>(scratch.ptr);
  view.flag = base;
  view.partial = view.splits > 1 ? reinterpret_cast<float*>(base + 256) : nullptr;
  view.block_flags = reinterpret_cast<unsigned long long*>(base + 256 + view.partial_bytes());
  if (fill) {  // Note [Page fill]: the prefix sums, then one flag per row
    char* f = base + 256 + view.partial_bytes() + view.block_flag_bytes();
    view.fill_prefix = reinterpret_cast<int64_t*>(f);
    view.row_flags = reinterpret_cast<unsigned long long*>(f + view.B * (view.p.max_pages + 1) * sizeof(int64_t));
  }
  ortkv::CoreLease lease;  // the pool is read here (Note [Arena lease])
  return ToOrtStatus(ortkv::PagedCacheAttentionCuda(view, stream));
}

OrtStatus* UpdateCreateCuda(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
  ORTKV_RETURN_IF_ORT_ERROR(UpdateCreate(op, api, info, kernel));
  auto* k = static_cast<PagedKernel*>(*kernel);
  k->label = PagedLabel("PagedCacheUpdate", k->names, 0, 1, 2, 6);
  return nullptr;
}

OrtStatus* RotaryUpdateCreateCuda(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
  ORTKV_RETURN_IF_ORT_ERROR(RotaryUpdateCreate(op, api, info, kernel));
  auto* k = static_cast<PagedKernel*>(*kernel);
  // pool, directory, page_table, page_fill ("" when absent), qkv, cos_cache: device_errors.cc's FinishPaged reads
  // them so
  const NodeNames& n = k->names;
  const std::string names = n.inputs[0] + "\n" + n.inputs[1] + "\n" + n.inputs[2] + "\n" +
                            (n.inputs.size() > 7 ? n.inputs[7] : std::string()) + "\n" + n.inputs[3] + "\n" +
                            n.inputs[5];
  k->label = ortkv_core_register_label("PagedRotaryCacheUpdate", n.node.c_str(), names.c_str());
  return nullptr;
}

OrtStatus* AttnCreateCuda(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
  ORTKV_RETURN_IF_ORT_ERROR(AttnCreate(op, api, info, kernel));
  auto* k = static_cast<PagedKernel*>(*kernel);
  k->label = PagedLabel("PagedCacheAttention", k->names, 1, 2, 3, 5);
  k->report_words = std::make_unique<ortkv::PagedReportWords>();
  return nullptr;
}

OrtCustomOp MakeUpdateCuda() {
  OrtCustomOp op = MakeUpdate();
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CUDAExecutionProvider"; };
  op.CreateKernelV2 = UpdateCreateCuda;
  op.KernelComputeV2 = UpdateComputeCuda;
  return op;
}

OrtCustomOp MakeRotaryUpdateCuda() {
  OrtCustomOp op = MakeRotaryUpdate();
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CUDAExecutionProvider"; };
  op.CreateKernelV2 = RotaryUpdateCreateCuda;
  op.KernelComputeV2 = RotaryUpdateComputeCuda;
  return op;
}

OrtCustomOp MakeAttentionCuda() {
  OrtCustomOp op = MakeAttention();
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CUDAExecutionProvider"; };
  op.CreateKernelV2 = AttnCreateCuda;
  op.KernelComputeV2 = AttnComputeCuda;
  return op;
}

const OrtCustomOp kPagedCacheUpdateCuda = MakeUpdateCuda();
const OrtCustomOp kPagedRotaryCacheUpdateCuda = MakeRotaryUpdateCuda();
const OrtCustomOp kPagedCacheAttentionCuda = MakeAttentionCuda();
#endif

}  // namespace

void AppendPagedOps(std::vector<const OrtCustomOp*>* ops) {
  ops->push_back(&kPagedCacheUpdateCpu);
  ops->push_back(&kPagedRotaryCacheUpdateCpu);
  ops->push_back(&kPagedCacheAttentionCpu);
#if defined(ORTKV_WITH_CUDA)
  ops->push_back(&kPagedCacheUpdateCuda);
  ops->push_back(&kPagedRotaryCacheUpdateCuda);
  ops->push_back(&kPagedCacheAttentionCuda);
#endif
}

}  // namespace ortkv_ort
