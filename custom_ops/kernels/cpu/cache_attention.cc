// CPU CacheAttention (Note [CacheAttention] in ortkv/cache_attention.h). One task is one (row, KV
// head, query token) and serves the G = Hq / Hkv query heads that share the KV head: every key and
// value row is read once per task, not once per query head. Loops over the head dimension are plain
// contiguous loops the compiler vectorizes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "ortkv/cache_attention.h"

namespace ortkv {
namespace {

Status Bad(const std::string& node, const std::string& what) {
  return Status(Code::kInvalidArgument, "CacheAttention node '" + node + "': " + what);
}

inline float Dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0;
  for (; i < n; ++i) s += a[i] * b[i];
  return s + ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// exp(x) for x <= 0 (scores minus their maximum), as a loop the compiler vectorizes: 2^n * p(r) with
// n = round(x log2 e), |r| <= 1/2 and a degree-6 polynomial for 2^r (relative error ~2e-7). A scalar
// std::exp per score cost more than the rest of decode attention at a few thousand tokens.
inline void ExpNonPositive(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float t = std::max(x[i], -87.0f) * 1.44269504088896341f;
    const float fn = std::floor(t + 0.5f);
    const float r = t - fn;
    float p = 1.54035303933816e-4f;
    p = p * r + 1.33335581464284e-3f;
    p = p * r + 9.61812910762848e-3f;
    p = p * r + 5.55041086648216e-2f;
    p = p * r + 2.40226506959101e-1f;
    p = p * r + 6.93147180559945e-1f;
    p = p * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(fn) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    x[i] = p * scale;
  }
}

// One task (see CacheAttentionCpu), compiled for AVX2+FMA and for the baseline ISA; the loader picks
// the best the CPU has (GCC target_clones), so one build runs everywhere.
__attribute__((target_clones("arch=haswell", "default"))) void AttendGroup(const CacheAttentionView& a, int64_t task,
                                                                            float* scratch) {
  const int64_t G = a.Hq / a.Hkv, D = a.D;
  const int64_t t = task % a.T;
  const int64_t hk = (task / a.T) % a.Hkv;
  const int64_t b = task / (a.T * a.Hkv);
  const int64_t L = a.start[b * a.start_stride] + t + 1;  // keys [0, start + t]
  const float* kbase = a.k + b * a.row_stride + hk * a.head_stride;
  const float* vbase = a.v + b * a.row_stride + hk * a.head_stride;
  const float* q = a.q + (b * a.T + t) * a.Hq * D + hk * G * D;  // the group's G query heads
  float* out = a.out + (b * a.T + t) * a.Hq * D + hk * G * D;
  // Per query head of the group: its query row and its output accumulator stay in registers while
  // the key and value rows stream by; the group's 2nd and later heads find those rows in L2.
  float inv[64];  // G <= 64 (checked when planning)
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scratch + g * a.C;
    const float* qg = q + g * D;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < L; ++j) {
      sc[j] = a.scale * Dot(qg, kbase + j * a.tok_stride, D);
      mx = std::max(mx, sc[j]);
    }
    for (int64_t j = 0; j < L; ++j) sc[j] -= mx;
    ExpNonPositive(sc, L);
    float sum = 0;
    for (int64_t j = 0; j < L; ++j) sum += sc[j];
    inv[g] = 1.0f / sum;
  }
  if (D == 64) {  // the common head size: a fixed-size accumulator the compiler keeps in registers
    for (int64_t g = 0; g < G; ++g) {
      const float* sc = scratch + g * a.C;
      float acc[64] = {};
      for (int64_t j = 0; j < L; ++j) {
        const float p = sc[j];
        const float* vj = vbase + j * a.tok_stride;
        for (int d = 0; d < 64; ++d) acc[d] += p * vj[d];
      }
      for (int d = 0; d < 64; ++d) out[g * D + d] = acc[d] * inv[g];
    }
    return;
  }
  std::fill(out, out + G * D, 0.0f);
  for (int64_t j = 0; j < L; ++j) {
    const float* vj = vbase + j * a.tok_stride;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scratch[g * a.C + j] * inv[g];
      float* og = out + g * D;
      for (int64_t d = 0; d < D; ++d) og[d] += p * vj[d];
    }
  }
}

}  // namespace

Status PlanCacheAttention(const std::string& node, const TensorArg& q, const TensorArg& k, const TensorArg& v,
                          const TensorArg& start, int64_t num_heads, int64_t kv_num_heads, float scale,
                          int64_t seq_axis, float* out, CacheAttentionView* view) {
  std::ostringstream m;
  if (q.elem_type != kFloat32 || k.elem_type != kFloat32 || v.elem_type != kFloat32) {
    m << "query, key and value must be float32 (got " << ElemTypeName(q.elem_type) << ", "
      << ElemTypeName(k.elem_type) << ", " << ElemTypeName(v.elem_type) << ")";
    return Bad(node, m.str());
  }
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
  const bool bsnh = seq_axis == 1;
  if (!bsnh && seq_axis != 2 && seq_axis != -2) {
    m << "seq_axis " << seq_axis << " must be 1 (BSNH) or 2 / -2 (BNSH)";
    return Bad(node, m.str());
  }
  const int64_t B = q.dims[0], T = q.dims[1];
  const int64_t C = bsnh ? k.dims[1] : k.dims[2];
  const int64_t Hkv = bsnh ? k.dims[2] : k.dims[1];
  const int64_t D = k.dims[3];
  if (k.dims[0] != B || Hkv != kv_num_heads || q.dims[2] != num_heads * D) {
    m << "'" << q.name << "' is [" << B << ", " << T << ", " << q.dims[2] << "] but the cache '" << k.name
      << "' holds batch " << k.dims[0] << ", " << Hkv << " KV heads of size " << D << "; expected batch " << B
      << ", kv_num_heads " << kv_num_heads << " and a query width of num_heads * D = " << num_heads * D;
    return Bad(node, m.str());
  }
  if (start.elem_type != kInt64 || start.dims.size() > 1 || (start.dims.size() == 1 && start.dims[0] != B)) {
    m << "'" << start.name << "' must be an int64 scalar or a vector of " << B << " start positions";
    return Bad(node, m.str());
  }
  const int64_t stride = start.dims.size() == 1 ? 1 : 0;
  const int64_t* s = static_cast<const int64_t*>(start.data);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t p = s[b * stride];
    if (p < 0 || p > C - T) {
      m << "CacheAttention node '" << node << "': row " << b << ": position " << p << " + n " << T << " = "
        << p + T << " exceeds capacity " << C << " of '" << k.name << "'";
      if (p < 0) return Bad(node, "start " + std::to_string(p) + " for row " + std::to_string(b) + " is negative");
      return Status(Code::kCapacity, m.str());
    }
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
  view->Hkv = Hkv;
  view->D = D;
  view->C = C;
  view->row_stride = C * Hkv * D;
  view->tok_stride = bsnh ? Hkv * D : D;
  view->head_stride = bsnh ? D : C * D;
  view->scale = scale > 0 ? scale : 1.0f / std::sqrt(static_cast<float>(D));
  return Status::Ok();
}

void CacheAttentionCpu(const CacheAttentionView& a, int64_t begin, int64_t end, float* scratch) {
  for (int64_t task = begin; task < end; ++task) AttendGroup(a, task, scratch);
}

}  // namespace ortkv
