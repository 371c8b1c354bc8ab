// MatMulQ4(X, codes, scales, mins) -> Y, domain "ortkv", opset 1, CPU EP: Y[..., N] = X[..., K] @ W with W a
// Q4_1 matrix kept exactly (Note [MatMulQ4 layout], Note [MatMulQ4 arithmetic], Note [MatMulQ4 dispatch] in
// ortkv/matmul_q4.h). Attributes: K, N (required), isa ("auto" by default; "avx512vnni", "avx2", "scalar"
// force one path), act_terms (1 by default, or 2: Note [MatMulQ4 activation terms]). X float32 [..., K]; codes uint8 [ceil(N / 16), K / 32, 256]; scales, mins float16
// [ceil(N / 16), K / 32, 16]; Y float32 [..., N].
#include <memory>
#include <string>
#include <vector>

#include "ops.h"
#include "ort_util.h"
#include "ortkv/matmul_q4.h"

namespace ortkv_ort {
namespace {

struct MatMulQ4Kernel {
  NodeNames names;
  int64_t K = 0, N = 0, act_terms = 1;
  ortkv::Q4Isa isa = ortkv::Q4Isa::kScalar;
};

// Tiles per ParallelFor task: enough work per task that the hand-off costs little, enough tasks that
// both halves of a 2-core machine (and more cores) get an even share.
constexpr int64_t kTilesPerTask = 2;

struct Job {
  const ortkv::MatMulQ4View* view;
  int64_t tiles_per_task;
};

void TileTask(void* user, size_t i) {
  const auto& j = *static_cast<const Job*>(user);
  const int64_t t0 = static_cast<int64_t>(i) * j.tiles_per_task;
  ortkv::MatMulQ4Tiles(*j.view, t0, std::min(t0 + j.tiles_per_task, j.view->tiles()));
}

constexpr int64_t kQuantRowsPerTask = 16;

void QuantTask(void* user, size_t i) {
  const auto& v = *static_cast<const Job*>(user)->view;
  const int64_t m0 = static_cast<int64_t>(i) * kQuantRowsPerTask;
  ortkv::MatMulQ4QuantizeRows(v, m0, std::min(m0 + kQuantRowsPerTask, v.M));
}

OrtStatus* Compute(void* op_kernel, OrtKernelContext* ctx) {
  const auto& k = *static_cast<const MatMulQ4Kernel*>(op_kernel);
  thread_local ortkv::TensorArg args[4];  // Note [Input slots]
  ClearArgs(args);
  for (size_t i = 0; i < 4; ++i) {
    const OrtValue* in = nullptr;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetInput(ctx, i, &in));
    ORTKV_RETURN_IF_ORT_ERROR(ReadTensor(in, k.names.inputs[i], &args[i], nullptr, nullptr));
  }
  ortkv::MatMulQ4View view;
  ORTKV_RETURN_IF_ORT_ERROR(
      ToOrtStatus(ortkv::PlanMatMulQ4(k.names.node, args[0], args[1], args[2], args[3], k.K, k.N, &view)));
  view.isa = k.isa;
  view.act_terms = k.act_terms;
  std::vector<int64_t> out_dims = args[0].dims;
  out_dims.back() = k.N;
  OrtValue* out = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_GetOutput(ctx, 0, out_dims.data(), out_dims.size(), &out));
  void* out_data = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorMutableData(out, &out_data));
  view.y = static_cast<float*>(out_data);
  if (view.M == 0) return nullptr;
  // the int8 activations, their scales and block sums: M * (K + 8 K / 32) bytes, reused across calls
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xes;
  const size_t blocks = static_cast<size_t>(view.M * view.blocks());
  const size_t terms = static_cast<size_t>(view.act_terms);
  if (xq.size() < terms * static_cast<size_t>(view.M * view.K)) xq.resize(terms * static_cast<size_t>(view.M * view.K));
  if (xes.size() < (terms + 1) * blocks) xes.resize((terms + 1) * blocks);
  view.xq = xq.data();
  view.xe = xes.data();
  view.xs = xes.data() + terms * blocks;
  Job job{&view, kTilesPerTask};
  const int64_t quant_tasks = (view.M + kQuantRowsPerTask - 1) / kQuantRowsPerTask;
  if (quant_tasks == 1) {
    QuantTask(&job, 0);
  } else {
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_ParallelFor(ctx, QuantTask, static_cast<size_t>(quant_tasks), 0, &job));
  }
  const int64_t tasks = (view.tiles() + kTilesPerTask - 1) / kTilesPerTask;
  if (tasks == 1) {
    TileTask(&job, 0);
  } else {
    ORTKV_RETURN_IF_ORT_ERROR(g_api->KernelContext_ParallelFor(ctx, TileTask, static_cast<size_t>(tasks), 0, &job));
  }
  return nullptr;
}

OrtStatus* Create(const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
  auto k = std::make_unique<MatMulQ4Kernel>();
  ORTKV_RETURN_IF_ORT_ERROR(ReadNodeNames(api, info, 4, 1, &k->names));
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, k->names.node, "K", int64_t{0}, &k->K));
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, k->names.node, "N", int64_t{0}, &k->N));
  // K and N are checked with the inputs on every run (PlanMatMulQ4): the message can then name X and its shape
  const std::string where = "[ortkv:E_INPUT] MatMulQ4 node '" + k->names.node + "': ";
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, k->names.node, "act_terms", int64_t{1}, &k->act_terms));
  if (k->act_terms != 1 && k->act_terms != 2) {
    const std::string m = where + "attribute act_terms=" + std::to_string(k->act_terms) +
                          " must be 1 (one int8 term per activation block) or 2 (int8 + its rounding residual)";
    return api->CreateStatus(ORT_INVALID_ARGUMENT, m.c_str());
  }
  std::string isa;
  ORTKV_RETURN_IF_ORT_ERROR(OptionalAttribute(api, info, k->names.node, "isa", std::string("auto"), &isa));
  ORTKV_RETURN_IF_ORT_ERROR(ToOrtStatus(ortkv::ParseQ4Isa(k->names.node, isa, &k->isa)));
  *kernel = k.release();
  return nullptr;
}

OrtCustomOp MakeOp() {
  OrtCustomOp op;
  InitCustomOp(&op);
  op.GetName = [](const OrtCustomOp*) { return "MatMulQ4"; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 4; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  // Every type is declared open and checked by the kernel with a named error (Note [CacheAttention CPU types]
  // in cache_attention_op.cc: a declared FLOAT would let ORT wrap a float16 node in silent Casts).
  op.GetInputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
  op.CreateKernelV2 = Create;
  op.KernelComputeV2 = Compute;
  op.KernelDestroy = [](void* k) { delete static_cast<MatMulQ4Kernel*>(k); };
  return op;
}

const OrtCustomOp kMatMulQ4Cpu = MakeOp();

}  // namespace

void AppendMatMulQ4Ops(std::vector<const OrtCustomOp*>* ops) { ops->push_back(&kMatMulQ4Cpu); }

}  // namespace ortkv_ort
