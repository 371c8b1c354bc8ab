// Linear(X, W) -> Y, domain "ortkv", opset 1, CPU and CUDA EPs: Y[..., N] = X[..., K] @ W^T with W [N, K]
// (Note [Linear] in ortkv/linear.h). CPU: float32, float16 (computed in float32). CUDA: float16, bfloat16; a
// decode step's few rows run our GEMV (Note [Linear GEMV]; which calls: Note [Linear path choice]), the rest
// cuBLAS (Note [Linear cuBLAS]). Attribute rows_per_warp (CUDA GEMV only; 1, 2 or 4, default 2): output rows per
// warp, for measuring the GEMV's variants on a device. Attribute activation ("none" by default, or "swiglu": CPU
// float32 only, Y [..., N / 2] = silu(X wg^T) * (X wu^T) with W = [wg; wu], Note [Linear SwiGLU epilogue]).
// Optional inputs skip [..., K] and gamma [K] with attribute epsilon (CPU float32 only, Note [Linear norm prologue]):
// the product is taken of norm(X + skip) * gamma instead of X, and the optional output 1 is X + skip.
#include <algorithm>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "ops.h"
#include "ort_util.h"
#include "ortkv/linear.h"

namespace ortkv_ort {
namespace {

using ortkv::Code;
using ortkv::Status;
using ortkv::TensorArg;

struct LinearKernel {
  NodeNames names;
  bool cuda = false;
  bool swiglu = false;  // attribute activation="swiglu" (CPU float32: Note [Linear SwiGLU epilogue])
  float epsilon = 1e-5f;  // Note [Linear norm prologue]
  int64_t rows_per_warp = 2;
#if defined(ORTKV_WITH_CUDA)
  ortkv::LinearCublas cublas;
#endif
};

// CPU tasks: blocks of rows x columns with ~256K multiply-adds each.
constexpr int64_t kCpuRowsPerTask = 64;
constexpr int64_t kCpuMacsPerTask = 256 << 10;

struct CpuJob {
  const ortkv::LinearView* view;
  int64_t rows, cols, col_tasks;
  int64_t out_cols;  // Y's columns: N, or N / 2 with the SwiGLU epilogue
  bool swiglu;
};

void CpuTask(void* user, size_t i) {
  const auto& j = *static_cast<const CpuJob*>(user);
  const int64_t mi = static_cast<int64_t>(i) / j.col_tasks, ni = static_cast<int64_t>(i) % j.col_tasks;
  const int64_t m0 = mi * j.rows, n0 = ni * j.cols;
  const int64_t m1 = std::min(m0 + j.rows, j.view->M), n1 = std::min(n0 + j.cols, j.out_cols);
  if (j.swiglu) return ortkv::LinearSwiGLUCpu(*j.view, m0, m1, n0, n1);
  ortkv::LinearCpu(*j.view, m0, m1, n0, n1);
}

// Note [Linear norm prologue]: what is wrong with the node's skip / gamma inputs, or "" when they hold (a message is
// built only for a failure: an ostringstream per call costs ~1 us, Note [Page checks without strings]).
std::string NormPrologueProblem(const LinearKernel& k, const TensorArg* a, const bool* present) {
  if (!present[2] || !present[3]) {
    std::ostringstream m;
    m << "Linear node '" << k.names.node << "': the norm prologue takes skip (input 2) and gamma (input 3) "
      << "together; only " << (present[2] ? "skip" : "gamma") << " is given. Remedy: give both, or neither";
    return m.str();
  }
  if (k.cuda || a[0].elem_type != ortkv::kFloat32 || a[2].elem_type != ortkv::kFloat32 ||
      a[3].elem_type != ortkv::kFloat32) {
    std::ostringstream m;
    m << "Linear node '" << k.names.node << "': the norm prologue (skip, gamma) is implemented for float32 on "
      << "the CPU only (X '" << a[0].name << "' is " << ortkv::ElemTypeName(a[0].elem_type) << ", skip '"
      << a[2].name << "' " << ortkv::ElemTypeName(a[2].elem_type) << ", gamma '" << a[3].name << "' "
      << ortkv::ElemTypeName(a[3].elem_type) << (k.cuda ? ", on CUDAExecutionProvider" : "")
      << "). Remedy: SkipSimplifiedLayerNormalization, then Linear";
    return m.str();
  }
  if (a[2].dims != a[0].dims || a[3].dims.size() != 1 || a[0].dims.empty() || a[3].dims[0] != a[0].dims.back()) {
    std::ostringstream m;
    m << "Linear node '" << k.names.node << "': skip '" << a[2].name << "' " << ortkv::ShapeText(a[2].dims)
      << " must have X '" << a[0].name << "''s shape " << ortkv::ShapeText(a[0].dims) << " and gamma '" << a[3].name
      << "' " << ortkv::ShapeText(a[3].dims) << " must be [K] = [" << (a[0].dims.empty() ? 0 : a[0].dims.back())
      << "]";
    return m.str();
  }
  return std::string();
}

OrtStatus* Compute(void* op_kernel, OrtKernelContext* ctx) {
  auto& k = *static_cast<LinearKernel*>(op_kernel);
  thread_local TensorArg args[4];  // Note [Input slots]
  ClearArgs(args);
  size_t n_in = 0;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetInputCount(ctx, &n_in));
  bool present[4] = {true, true, false, false};
  for (size_t i = 0; i < 4 && i < n_in; ++i) {
    const OrtValue* in = nullptr;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetInput(ctx, i, &in));
    if (in == nullptr) continue;  // an omitted optional input
    static const std::string kUnnamed = "(unnamed)";
    const std::string& name = i < k.names.inputs.size() ? k.names.inputs[i] : kUnnamed;
    ORTKV_RETURN_IF_ORT_ERROR(ReadTensor(in, name, &args[i], nullptr, nullptr));
    present[i] = true;
  }
  const bool norm = present[2] || present[3];  // Note [Linear norm prologue]
  if (norm) {
    const std::string problem = NormPrologueProblem(k, args, present);
    if (!problem.empty()) return ToOrtStatus(Status(Code::kInvalidArgument, problem));
  }
  const TensorArg& x = args[0];
  const bool type_ok = k.cuda ? (x.elem_type == ortkv::kFloat16 || x.elem_type == ortkv::kBFloat16)
                              : (x.elem_type == ortkv::kFloat32 || x.elem_type == ortkv::kFloat16);
  if (!type_ok) {
    std::ostringstream m;
    m << "Linear node '" << k.names.node << "': X '" << x.name << "' is " << ortkv::ElemTypeName(x.elem_type)
      << (k.cuda ? "; the CUDA kernel takes float16 or bfloat16 (float32 on CUDA: use MatMul)"
                 : "; the CPU kernel takes float32 or float16 (bfloat16 runs on CUDAExecutionProvider)");
    return ToOrtStatus(Status(Code::kInvalidArgument, m.str()));
  }
  ortkv::LinearView view;
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::PlanLinear(k.names.node, x, args[1], &view)));
  if (k.swiglu && (view.N % 2 != 0 || x.elem_type != ortkv::kFloat32)) {  // Note [Linear SwiGLU epilogue]
    std::ostringstream m;
    m << "Linear node '" << k.names.node << "': activation 'swiglu' ";
    if (view.N % 2 != 0) {
      m << "needs W '" << args[1].name << "' " << ortkv::ShapeText(args[1].dims) << " to have an even N (gate rows, "
        << "then as many up rows); N = " << view.N << ". Remedy: stack [wg; wu] of equal heights";
    } else {
      m << "is implemented for float32 only, X '" << x.name << "' is " << ortkv::ElemTypeName(x.elem_type)
        << ". Remedy: Linear without activation, then ortkv.SwiGLU";
    }
    return ToOrtStatus(Status(Code::kInvalidArgument, m.str()));
  }
  const int64_t out_cols = k.swiglu ? view.N / 2 : view.N;
  thread_local std::vector<int64_t> dims;  // Note [Input slots]: no allocation per run
  dims.assign(x.dims.begin(), x.dims.end());
  dims.back() = out_cols;
  OrtValue* out = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetOutput(ctx, 0, dims.data(), dims.size(), &out));
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorMutableData(out, &view.y));
  thread_local std::vector<float> normed;  // Note [Linear norm prologue]: the X the product reads
  if (norm) {  // CPU float32 only (NormPrologueProblem); the sum output exists whatever M and N are
    size_t n_out = 0;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetOutputCount(ctx, &n_out));
    float* sum = nullptr;
    if (n_out > 1) {
      OrtValue* s_out = nullptr;
      ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetOutput(ctx, 1, x.dims.data(), x.dims.size(), &s_out));
      if (s_out != nullptr) ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorMutableData(s_out, reinterpret_cast<void**>(&sum)));
    }
    normed.resize(static_cast<size_t>(view.M * view.K));
    ortkv::SkipRmsNormCpu(static_cast<const float*>(x.data), static_cast<const float*>(args[2].data),
                          static_cast<const float*>(args[3].data), k.epsilon, view.M, view.K, normed.data(), sum);
    view.x = normed.data();
  }
  if (view.M == 0 || out_cols == 0) return nullptr;
  if (k.cuda) {
#if defined(ORTKV_WITH_CUDA)
    void* stream = nullptr;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetGPUComputeStream(ctx, &stream));
    if (ortkv::LinearUsesGemv(view.M, view.K, view.N)) {  // Note [Linear path choice] in ortkv/linear.h
      for (const auto* t : {&args[0], &args[1]}) {
        if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0) {
          return ToOrtStatus(Status(Code::kInvalidArgument,
                                    "Linear node '" + k.names.node + "': '" + t->name + "' at " + Hex(t->data) +
                                        " is not 16-byte aligned; the GEMV reads it in 16-byte vectors. Remedy: "
                                        "pass a tensor that starts on a 16-byte boundary (ORT's own are)"));
        }
      }
      return ToOrtStatus(ortkv::LinearGemvCuda(view, static_cast<int>(k.rows_per_warp), stream));
    }
    return ToOrtStatus(k.cublas.Run(k.names.node, view, stream));
#else
    return ToOrtStatus(Status(Code::kRuntime, "Linear: this build of ortkv has no CUDA kernels"));
#endif
  }
  if (view.elem_type == ortkv::kFloat32) {
    ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::CheckLinearCpuIsa(k.names.node)));
  }
  // tasks of output columns: with the SwiGLU epilogue each column reads two rows of W (gate and up)
  const int64_t w_rows_per_col = k.swiglu ? 2 : 1;
  int64_t rows = std::min(view.M, kCpuRowsPerTask);
  int64_t cols = std::max<int64_t>(8, kCpuMacsPerTask / std::max<int64_t>(1, rows * view.K * w_rows_per_col));
  if (view.elem_type == ortkv::kFloat32 && view.M <= ortkv::kLinearCpuGemvMaxM) {
    // decode (Note [Linear CPU GEMV], Note [Linear GEMV tasks]): contiguous ranges of whole row groups, each >= 64 KB of W
    const int64_t groups = (out_cols + ortkv::kLinearCpuGemvRows - 1) / ortkv::kLinearCpuGemvRows;
    const int64_t by_bytes = view.N * view.K * 4 / ortkv::kLinearCpuGemvMinTaskBytes;
    const int64_t tasks = std::max<int64_t>(1, std::min({ortkv::kLinearCpuGemvTasks, groups, by_bytes}));
    rows = view.M;
    cols = (groups + tasks - 1) / tasks * ortkv::kLinearCpuGemvRows;
  }
  CpuJob job{&view, rows, cols, (out_cols + cols - 1) / cols, out_cols, k.swiglu};
  const int64_t tasks = (view.M + rows - 1) / rows * job.col_tasks;
  if (tasks == 1) {
    CpuTask(&job, 0);
    return nullptr;
  }
  return g_api->KernelContext_ParallelFor(ctx, CpuTask, static_cast<size_t>(tasks), 0, &job);
}

// Whether a node being shape-inferred has activation="swiglu" (read as text; absent or unreadable: no).
bool ShapeInferSwiGLU(OrtShapeInferContext* ctx) {
  const OrtOpAttr* attr = nullptr;
  OrtStatus* s = g_api->ShapeInferContext_GetAttribute(ctx, "activation", &attr);
  if (s != nullptr) {
    g_api->ReleaseStatus(s);
    return false;
  }
  if (attr == nullptr) return false;
  char buf[16] = {};
  size_t size = 0;
  s = g_api->ReadOpAttr(attr, ORT_OP_ATTR_STRING, buf, sizeof(buf) - 1, &size);
  if (s != nullptr) {
    g_api->ReleaseStatus(s);
    return false;
  }
  return std::string(buf, strnlen(buf, sizeof(buf))) == "swiglu";
}

// Y's type and shape: X's type, X's dims with the last replaced by W's first (-1 when unknown), or half of it
// with activation="swiglu".
OrtStatus* InferLinear(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  OrtTensorTypeAndShapeInfo* xi = nullptr;  // owned by the context
  OrtTensorTypeAndShapeInfo* wi = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->ShapeInferContext_GetInputTypeShape(ctx, 0, &xi));
  ORTKV_RETURN_IF_ORT_ERROR(g_api->ShapeInferContext_GetInputTypeShape(ctx, 1, &wi));
  size_t rank = 0, wrank = 0;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetDimensionsCount(xi, &rank));
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetDimensionsCount(wi, &wrank));
  {  // output 1 (Note [Linear norm prologue]): X + skip, X's type and shape; absent on most nodes
    OrtStatus* s1 = g_api->ShapeInferContext_SetOutputTypeShape(ctx, 1, xi);
    if (s1 != nullptr) g_api->ReleaseStatus(s1);
  }
  if (rank == 0) return g_api->ShapeInferContext_SetOutputTypeShape(ctx, 0, xi);  // unknown: as X
  std::vector<int64_t> dims(rank);
  std::vector<const char*> names(rank, nullptr);
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetDimensions(xi, dims.data(), rank));
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetSymbolicDimensions(xi, names.data(), rank));
  int64_t n = -1;
  if (wrank == 2) {
    int64_t wd[2] = {-1, -1};
    ORTKV_RETURN_IF_ORT_ERROR(g_api->GetDimensions(wi, wd, 2));
    n = wd[0];
  }
  if (n > 0 && ShapeInferSwiGLU(ctx)) n = n % 2 == 0 ? n / 2 : -1;  // odd N: refused by Compute
  dims[rank - 1] = n;
  names[rank - 1] = "";
  for (auto& s : names)
    if (s == nullptr) s = "";
  ONNXTensorElementDataType type;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorElementType(xi, &type));
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->CreateTensorTypeAndShapeInfo(&info));
  OrtStatus* s = g_api->SetTensorElementType(info, type);
  if (s == nullptr) s = g_api->SetDimensions(info, dims.data(), rank);
  if (s == nullptr) s = g_api->SetSymbolicDimensions(info, names.data(), rank);
  if (s == nullptr) s = g_api->ShapeInferContext_SetOutputTypeShape(ctx, 0, info);
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  return s;
}

OrtStatus* Create(const OrtApi* api, const OrtKernelInfo* info, void** kernel, bool cuda) {
  auto k = std::make_unique<LinearKernel>();
  k->cuda = cuda;
  size_t n_in = 0, n_out = 0;
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfo_GetInputCount(info, &n_in));
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfo_GetOutputCount(info, &n_out));
  ORTKV_RETURN_IF_ORT_ERROR(ReadNodeNames(api, info, std::min<size_t>(std::max<size_t>(n_in, 2), 4),
                                          std::min<size_t>(std::max<size_t>(n_out, 1), 2), &k->names));
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, k->names.node, "epsilon", 1e-5f, &k->epsilon));
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, k->names.node, "rows_per_warp", int64_t{2}, &k->rows_per_warp));
  std::string activation;
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, k->names.node, "activation", std::string("none"), &activation));
  if (activation != "none" && activation != "swiglu") {
    const std::string m = "[ortkv:E_INPUT] Linear node '" + k->names.node + "': attribute activation='" + activation +
                          "' must be 'none' or 'swiglu' (Note [Linear SwiGLU epilogue])";
    return api->CreateStatus(ORT_INVALID_ARGUMENT, m.c_str());
  }
  k->swiglu = activation == "swiglu";
  if (k->swiglu && cuda) {
    const std::string m = "[ortkv:E_INPUT] Linear node '" + k->names.node + "': activation 'swiglu' has no CUDA "
                          "kernel (a CPU float32 epilogue); on CUDA use Linear without activation, then ortkv.SwiGLU";
    return api->CreateStatus(ORT_INVALID_ARGUMENT, m.c_str());
  }
  if (k->rows_per_warp != 1 && k->rows_per_warp != 2 && k->rows_per_warp != 4) {
    const std::string m = "[ortkv:E_INPUT] Linear node '" + k->names.node + "': attribute rows_per_warp=" +
                          std::to_string(k->rows_per_warp) + " must be 1, 2 or 4 (output rows per warp of the CUDA GEMV)";
    return api->CreateStatus(ORT_INVALID_ARGUMENT, m.c_str());
  }
  *kernel = k.release();
  return nullptr;
}

OrtCustomOp MakeLinear(bool cuda) {
  OrtCustomOp op;
  InitCustomOp(&op);
  op.GetName = [](const OrtCustomOp*) { return "Linear"; };
  op.GetExecutionProviderType = cuda ? [](const OrtCustomOp*) -> const char* { return "CUDAExecutionProvider"; }
                                     : [](const OrtCustomOp*) -> const char* { return nullptr; };
  // Types declared open and checked by the kernel with a named error (Note [CacheAttention CPU types] in
  // cache_attention_op.cc: a declared type would let ORT wrap the node in silent Casts).
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 4; };  // X, W[, skip, gamma]
  op.GetInputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
    return i >= 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 2; };  // Y[, X + skip]
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t i) {
    return i >= 1 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
  op.CreateKernelV2 = cuda ? [](const OrtCustomOp*, const OrtApi* a, const OrtKernelInfo* i, void** k) {
    return Create(a, i, k, true);
  }
                           : [](const OrtCustomOp*, const OrtApi* a, const OrtKernelInfo* i, void** k) {
                               return Create(a, i, k, false);
                             };
  op.KernelComputeV2 = Compute;
  op.KernelDestroy = [](void* k) { delete static_cast<LinearKernel*>(k); };
  op.InferOutputShapeFn = InferLinear;
  return op;
}

const OrtCustomOp kLinearCpu = MakeLinear(false);
#if defined(ORTKV_WITH_CUDA)
const OrtCustomOp kLinearCuda = MakeLinear(true);
#endif

}  // namespace

void AppendLinearOps(std::vector<const OrtCustomOp*>* ops) {
  ops->push_back(&kLinearCpu);
#if defined(ORTKV_WITH_CUDA)
  ops->push_back(&kLinearCuda);
#endif
}

}  // namespace ortkv_ort
