// CPU CacheAttention (Note [CacheAttention] and Note [CacheAttention CPU split-K] in
// ortkv/cache_attention.h): one pass over each unit's keys in L1-sized blocks with an online softmax,
// all G query heads of a KV-head group per key block, split over key chunks when one sequence must
// keep every core reading.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

#include "attention_block.h"
#include "ortkv/cache_attention.h"

namespace ortkv {
namespace {

using namespace attn_cpu;  // NOLINT: the block kernel (attention_block.h)

Status Bad(const std::string& node, const std::string& what) {
  return Status(Code::kInvalidArgument, "CacheAttention node '" + node + "': " + what);
}

// Note [CPU attention ISA dispatch]: the task three times, AVX-512, AVX2 + FMA + F16C, baseline.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace isa_avx512 {
#define ORTKV_ISA 2
constexpr int kLanes = 16;  // Note [CPU attention native width]
#include "cache_attention_task.inc"
#undef ORTKV_ISA
}  // namespace isa_avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
#define ORTKV_ISA 1
constexpr int kLanes = 8;  // Note [CPU attention native width]
#include "cache_attention_task.inc"
#undef ORTKV_ISA
}  // namespace isa_avx2
#pragma GCC pop_options
namespace isa_baseline {
#define ORTKV_ISA 0
constexpr int kLanes = 4;  // Note [CPU attention native width]
#include "cache_attention_task.inc"
#undef ORTKV_ISA
}  // namespace isa_baseline

}  // namespace

namespace {

// The shape facts both kernels need, after the checks that do not read `start`.
struct Shapes {
  int64_t B, T, Hkv, D, C, row_stride, tok_stride, head_stride, start_stride;
};

Status CheckShapes(const std::string& node, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                   const TensorArg& start, int64_t num_heads, int64_t kv_num_heads, int64_t seq_axis, Shapes* sh) {
  Message m;  // Note [Messages on the error path only]
  if (q.dims.size() != 3 || k.dims.size() != 4 || v.dims != k.dims) {
    m << "expected query [B, T, Hq*D] and equal key/value caches of rank 4; got '" << q.name << "' rank "
      << q.dims.size() << ", '" << k.name << "' rank " << k.dims.size() << ", '" << v.name << "' rank " << v.dims.size()
      << (v.dims != k.dims && v.dims.size() == k.dims.size() ? " (key and value shapes differ)" : "");
    return Bad(node, m.str());
  }
  if (num_heads <= 0 || kv_num_heads <= 0 || num_heads % kv_num_heads != 0 || num_heads / kv_num_heads > 64) {
    m << "num_heads " << num_heads << " must be a positive multiple of kv_num_heads " << kv_num_heads
      << " (at most 64 query heads per KV head)";
    return Bad(node, m.str());
  }
  // Note [CacheAttention SBNH]: seq_axis 0 is [capacity, batch, kv_heads, head_size], token-major.
  const bool bsnh = seq_axis == 1, sbnh = seq_axis == 0;
  if (!bsnh && !sbnh && seq_axis != 2 && seq_axis != -2) {
    m << "seq_axis " << seq_axis << " must be 1 (BSNH), 2 / -2 (BNSH) or 0 (SBNH)";
    return Bad(node, m.str());
  }
  const int64_t B = q.dims[0], T = q.dims[1];
  const int64_t kB = sbnh ? k.dims[1] : k.dims[0];
  const int64_t C = bsnh ? k.dims[1] : sbnh ? k.dims[0] : k.dims[2];
  const int64_t Hkv = bsnh || sbnh ? k.dims[2] : k.dims[1];
  const int64_t D = k.dims[3];
  if (kB != B || Hkv != kv_num_heads || q.dims[2] != num_heads * D) {
    m << "'" << q.name << "' is [" << B << ", " << T << ", " << q.dims[2] << "] but the cache '" << k.name
      << "' holds batch " << kB << ", " << Hkv << " KV heads of size " << D << "; expected batch " << B
      << ", kv_num_heads " << kv_num_heads << " and a query width of num_heads * D = " << num_heads * D;
    return Bad(node, m.str());
  }
  if (T > C) {
    m << "'" << q.name << "' holds " << T << " query tokens but the cache '" << k.name << "' has capacity " << C
      << "; a block of new tokens must fit in the cache";
    return Status(Code::kCapacity, "CacheAttention node '" + node + "': " + m.str());
  }
  if (start.elem_type != kInt64 || start.dims.size() > 1 || (start.dims.size() == 1 && start.dims[0] != B)) {
    m << "'" << start.name << "' must be an int64 scalar or a vector of " << B << " start positions";
    return Bad(node, m.str());
  }
  sh->B = B;
  sh->T = T;
  sh->Hkv = Hkv;
  sh->D = D;
  sh->C = C;
  sh->start_stride = start.dims.size() == 1 ? 1 : 0;
  sh->row_stride = sbnh ? Hkv * D : C * Hkv * D;
  sh->tok_stride = bsnh ? Hkv * D : sbnh ? B * Hkv * D : D;
  sh->head_stride = bsnh || sbnh ? D : C * D;
  return Status::Ok();
}

}  // namespace

Status PlanCacheAttention(const std::string& node, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                          const TensorArg& start, int64_t num_heads, int64_t kv_num_heads, float scale,
                          int64_t seq_axis, float* out, CacheAttentionView* view) {
  Message m;  // Note [Messages on the error path only]
  if (q.elem_type != kFloat32 || k.elem_type != kFloat32 || v.elem_type != kFloat32) {
    m << "query, key and value must be float32 on the CPU (got " << ElemTypeName(q.elem_type) << ", "
      << ElemTypeName(k.elem_type) << ", " << ElemTypeName(v.elem_type) << ")";
    return Bad(node, m.str());
  }
  Shapes sh;
  ORTKV_RETURN_IF_ERR(CheckShapes(node, q, k, v, start, num_heads, kv_num_heads, seq_axis, &sh));
  ORTKV_RETURN_IF_ERR(attn_cpu::CheckCpuIsa("CacheAttention", node));
  const int64_t B = sh.B, T = sh.T, C = sh.C, D = sh.D, stride = sh.start_stride;
  const int64_t* s = static_cast<const int64_t*>(start.data);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = s[b * stride];
    if (p < 0 || p > C - T) {
      m << "CacheAttention node '" << node << "': row " << b << ": position " << p << " + n " << T << " = "
        << p + T << " exceeds capacity " << C << " of '" << k.name << "'";
      if (p < 0) return Bad(node, "start " + std::to_string(p) + " for row " + std::to_string(b) + " is negative");
      return Status(Code::kCapacity, m.str());
    }
    max_keys = std::max(max_keys, p + T);
  }
  view->q = static_cast<const float*>(q.data);
  view->k = static_cast<const float*>(k.data);
  view->v = static_cast<const float*>(v.data);
  view->out = out;
  view->start = s;
  view->start_stride = stride;
  view->B = B;
  view->T = T;
  view->Hq = num_heads;
  view->Hkv = sh.Hkv;
  view->D = D;
  view->C = C;
  view->row_stride = sh.row_stride;
  view->tok_stride = sh.tok_stride;
  view->head_stride = sh.head_stride;
  view->scale = scale > 0 ? scale : 1.0f / std::sqrt(static_cast<float>(D));
  // Note [Paged CPU query tiles] (paged_attention_task.inc), the same tiles over a dense cache
  view->tile = attn_cpu::CpuQueryTile(view->B, view->Hkv, view->T, view->group(), D, max_keys);
  view->splits = attn_cpu::CpuSplits(view->units(), max_keys);
  view->partial = nullptr;
  return Status::Ok();
}

Status PlanCacheAttentionCuda(const std::string& node, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                              const TensorArg& start, int64_t num_heads, int64_t kv_num_heads, float scale,
                              int64_t seq_axis, void* out, int sm_count, CacheAttentionCudaView* view) {
  Message m;  // Note [Messages on the error path only]
  const size_t es = ElemSize(q.elem_type);
  if (es == 0 || k.elem_type != q.elem_type || v.elem_type != q.elem_type) {
    m << "query, key and value must share one of float32, float16, bfloat16 (got " << ElemTypeName(q.elem_type)
      << ", " << ElemTypeName(k.elem_type) << ", " << ElemTypeName(v.elem_type) << ")";
    return Bad(node, m.str());
  }
  Shapes sh;
  ORTKV_RETURN_IF_ERR(CheckShapes(node, q, k, v, start, num_heads, kv_num_heads, seq_axis, &sh));
  if (sh.D > kAttnCudaMaxHeadSize) {
    m << "head size " << sh.D << " of '" << k.name << "' is larger than the CUDA kernel's " << kAttnCudaMaxHeadSize
      << "; run this node on the CPU provider (float32) or use heads of at most " << kAttnCudaMaxHeadSize;
    return Bad(node, m.str());
  }
  view->q = q.data;
  view->k = k.data;
  view->v = v.data;
  view->out = out;
  view->start = static_cast<const int64_t*>(start.data);
  view->start_stride = sh.start_stride;
  view->elem_type = q.elem_type;
  view->B = sh.B;
  view->T = sh.T;
  view->Hq = num_heads;
  view->Hkv = sh.Hkv;
  view->D = sh.D;
  view->C = sh.C;
  view->row_stride = sh.row_stride;
  view->tok_stride = sh.tok_stride;
  view->head_stride = sh.head_stride;
  view->scale = scale > 0 ? scale : 1.0f / std::sqrt(static_cast<float>(sh.D));
  const uintptr_t align = reinterpret_cast<uintptr_t>(q.data) | reinterpret_cast<uintptr_t>(k.data) |
                          reinterpret_cast<uintptr_t>(v.data) | static_cast<uintptr_t>(sh.D * es) |
                          static_cast<uintptr_t>(sh.tok_stride * es) | static_cast<uintptr_t>(sh.head_stride * es) |
                          static_cast<uintptr_t>(sh.row_stride * es);
  view->vec = align % 16 == 0;
  // Note [CacheAttention CUDA]: split along the keys until there are ~4 blocks per SM, from the capacity.
  const int64_t head_blocks = (view->group() + kAttnCudaHeads - 1) / kAttnCudaHeads;
  const int64_t blocks = view->units() * head_blocks;
  view->splits = AttnCudaSplits(sh.C, blocks, sm_count, view->v3_shape());  // Note [Cluster split chunks]
  view->partial = nullptr;
  return Status::Ok();
}

void CacheAttentionCpu(const CacheAttentionView& a, int64_t begin, int64_t end, float* scratch) {
  void (*run)(const CacheAttentionView&, int64_t, float*) = isa_baseline::RunTask;
  switch (attn_cpu::CpuIsaOnce().isa) {  // the plan refused a bad ORTKV_CPU_ISA
    case attn_cpu::CpuIsa::kAvx512: run = isa_avx512::RunTask; break;
    case attn_cpu::CpuIsa::kAvx2: run = isa_avx2::RunTask; break;
    case attn_cpu::CpuIsa::kBaseline: break;
  }
  for (int64_t task = begin; task < end; ++task) run(a, task, scratch);
}

void CacheAttentionCombine(const CacheAttentionView& a) {
  const int64_t S = a.splits, G = a.group(), D = a.D, P = G * (D + 2);
  if (S <= 1) return;
  for (int64_t unit = 0; unit < a.units(); ++unit) {
    const int64_t t = unit % a.T, hk = (unit / a.T) % a.Hkv, b = unit / (a.T * a.Hkv);  // tile 1 (splits > 1)
    const float* part = a.partial + unit * S * P;  // tasks unit * S ... unit * S + S - 1
    float* out = a.out + (b * a.T + t) * a.Hq * D + hk * G * D;
    for (int64_t g = 0; g < G; ++g) attn_cpu::MergeSplits(part, S, G, D, g, out + g * D);
  }
}

}  // namespace ortkv
