// Validation of RotaryCacheUpdate's and SwiGLU's inputs (Note [RotaryCacheUpdate], Note [SwiGLU] in
// ortkv/rotary_cache_update.h). The cache writes are validated by CacheUpdate's own checks (PlanCacheWrite);
// what is checked here ties qkv, the caches and the rotary tables together. Nothing is written.
#include <sstream>

#include "ortkv/rotary_cache_update.h"

namespace ortkv {
namespace {

constexpr const char* kOp = "RotaryCacheUpdate";

Status Bad(const std::string& node, const std::string& what) {
  return Status(Code::kInvalidArgument, std::string(kOp) + " node '" + node + "': " + what);
}

bool Overlap(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const uintptr_t alo = reinterpret_cast<uintptr_t>(a), blo = reinterpret_cast<uintptr_t>(b);
  return alo < blo + static_cast<uintptr_t>(b_bytes) && blo < alo + static_cast<uintptr_t>(a_bytes);
}

int64_t Elements(const std::vector<int64_t>& d) {
  int64_t n = 1;
  for (int64_t x : d) n *= x;
  return n;
}

}  // namespace

Status PlanRotaryCacheUpdate(const std::string& node, const TensorArg& qkv, const TensorArg& k_cache,
                             const TensorArg& v_cache, const TensorArg& positions, const TensorArg& cos_cache,
                             const TensorArg& sin_cache, int64_t heads, int64_t kv_heads, int64_t seq_axis,
                             bool read_positions, RotaryCacheUpdateView* view) {
  Message m;  // Note [Messages on the error path only]
  if (heads < 1 || kv_heads < 1) {
    m << "num_heads=" << heads << " and kv_num_heads=" << kv_heads << " must both be >= 1";
    return Bad(node, m.str());
  }
  const size_t esize = ElemSize(qkv.elem_type);
  if (esize == 0) {
    m << "input '" << qkv.name << "' is " << ElemTypeName(qkv.elem_type) << "; " << kOp
      << " takes float32, float16 or bfloat16";
    return Bad(node, m.str());
  }
  for (const TensorArg* t : {&k_cache, &v_cache, &cos_cache, &sin_cache}) {
    if (t->elem_type != qkv.elem_type) {
      m << "input '" << t->name << "' is " << ElemTypeName(t->elem_type) << " but '" << qkv.name << "' is "
        << ElemTypeName(qkv.elem_type) << "; qkv, both caches and the rotary tables must have one element type";
      return Bad(node, m.str());
    }
  }
  const int64_t all_heads = heads + 2 * kv_heads;
  if (qkv.dims.size() != 3 || qkv.dims[2] % all_heads != 0 || qkv.dims[2] / all_heads < 2 ||
      (qkv.dims[2] / all_heads) % 2 != 0) {
    m << "input '" << qkv.name << "' has shape " << ShapeText(qkv.dims) << "; it must be [batch, tokens, (num_heads + 2 "
      << "kv_num_heads) * head_size] = [batch, tokens, " << all_heads << " * head_size] with an even head_size (the "
      << "fused QKV projection's output, num_heads=" << heads << ", kv_num_heads=" << kv_heads << ")";
    return Bad(node, m.str());
  }
  const int64_t B = qkv.dims[0], T = qkv.dims[1], D = qkv.dims[2] / all_heads;
  if (B < 1 || T < 1) {
    m << "input '" << qkv.name << "' has shape " << ShapeText(qkv.dims) << "; batch and tokens must be >= 1";
    return Bad(node, m.str());
  }
  int layout;
  if (seq_axis == 0) {
    layout = 0;
  } else if (seq_axis == 1) {
    layout = 1;
  } else if (seq_axis == 2 || seq_axis == -2) {
    layout = 2;
  } else {
    m << "attribute seq_axis=" << seq_axis << "; allowed: 0 (SBNH [capacity, batch, kv_heads, head_size]), 1 (BSNH "
      << "[batch, capacity, kv_heads, head_size]), 2 or -2 (BNSH [batch, kv_heads, capacity, head_size])";
    return Bad(node, m.str());
  }
  static const char* kLayoutDoc[3] = {"SBNH [capacity, batch, kv_heads, head_size] (seq_axis 0)",
                                      "BSNH [batch, capacity, kv_heads, head_size] (seq_axis 1)",
                                      "BNSH [batch, kv_heads, capacity, head_size] (seq_axis -2)"};
  const int seq = layout == 0 ? 0 : layout == 1 ? 1 : 2;
  const int batch_axis = layout == 0 ? 1 : 0;
  const int head_axis = layout == 2 ? 1 : 2;
  for (const TensorArg* c : {&k_cache, &v_cache}) {
    const bool ok = c->dims.size() == 4 && c->dims[batch_axis] == B && c->dims[head_axis] == kv_heads &&
                    c->dims[3] == D && c->dims[seq] >= 1;
    if (!ok) {
      m << "cache '" << c->name << "' has shape " << ShapeText(c->dims) << "; it must be " << kLayoutDoc[layout]
        << " with batch " << B << ", kv_heads " << kv_heads << " and head_size " << D << " (from '" << qkv.name
        << "' " << ShapeText(qkv.dims) << ")";
      return Bad(node, m.str());
    }
  }
  if (v_cache.dims != k_cache.dims) {
    m << "cache '" << v_cache.name << "' has shape " << ShapeText(v_cache.dims) << " but '" << k_cache.name << "' has "
      << ShapeText(k_cache.dims) << "; the key and value caches share one shape";
    return Bad(node, m.str());
  }
  const int64_t capacity = k_cache.dims[seq];
  for (const TensorArg* t : {&cos_cache, &sin_cache}) {
    if (t->dims.size() != 2 || t->dims[1] != D / 2 || t->dims[0] < capacity) {
      m << "rotary table '" << t->name << "' has shape " << ShapeText(t->dims) << "; it must be [rows, head_size / 2] = "
        << "[rows, " << D / 2 << "] with rows >= the caches' capacity " << capacity << " (a row for every position "
        << "a cache can hold). Remedy: build the tables for at least " << capacity << " positions, or allocate "
        << "caches of at most " << (t->dims.size() == 2 ? t->dims[0] : 0) << " positions";
      return Bad(node, m.str());
    }
  }
  const int64_t qkv_bytes = Elements(qkv.dims) * static_cast<int64_t>(esize);
  const int64_t cache_bytes = Elements(k_cache.dims) * static_cast<int64_t>(esize);
  if (Overlap(k_cache.data, cache_bytes, v_cache.data, cache_bytes)) {
    m << "caches '" << k_cache.name << "' and '" << v_cache.name << "' share memory; the key and value caches must "
      << "be separate buffers. Nothing was written. Remedy: bind two buffers";
    return Bad(node, m.str());
  }
  for (const TensorArg* c : {&k_cache, &v_cache}) {
    if (Overlap(qkv.data, qkv_bytes, c->data, cache_bytes)) {
      m << "input '" << qkv.name << "' overlaps the cache '" << c->name << "' (" << qkv_bytes << " and "
        << cache_bytes << " bytes); the new tokens must not share memory with a cache they are written into. "
        << "Nothing was written. Remedy: copy them into their own buffer first";
      return Bad(node, m.str());
    }
  }
  // The two cache writes, as CacheUpdate validates them: values in the cache's layout (only their shape and
  // type are read; `values` points into qkv, whose overlap with the caches was checked above).
  thread_local TensorArg kv_new;  // reused run to run: no allocation per step (Note [Input slots] in ort_util.h)
  kv_new.data = qkv.data;
  kv_new.elem_type = qkv.elem_type;
  kv_new.dims.assign(k_cache.dims.begin(), k_cache.dims.end());
  kv_new.dims[seq] = T;
  kv_new.name.assign(qkv.name);
  const int64_t axis = layout == 2 ? -2 : seq;
  Status s = PlanCacheWrite(kOp, node, k_cache, kv_new, positions, axis, read_positions, &view->k);
  if (!s.ok()) return s;
  s = PlanCacheWrite(kOp, node, v_cache, kv_new, positions, axis, read_positions, &view->v);
  if (!s.ok()) return s;
  view->qkv = qkv.data;
  view->cos = cos_cache.data;
  view->sin = sin_cache.data;
  view->rows = B;
  view->n = T;
  view->heads = heads;
  view->kv_heads = kv_heads;
  view->head_size = D;
  view->table_rows = cos_cache.dims[0];
  view->elem_type = qkv.elem_type;
  view->layout = layout;
  return Status::Ok();
}

Status CheckSwiGLU(const std::string& node, const TensorArg& x, int64_t* rows, int64_t* f) {
  Message m;  // Note [Messages on the error path only]
  if (ElemSize(x.elem_type) == 0) {
    m << "SwiGLU node '" << node << "': input '" << x.name << "' is " << ElemTypeName(x.elem_type)
      << "; SwiGLU takes float32, float16 or bfloat16";
    return Status(Code::kInvalidArgument, m.str());
  }
  if (x.dims.empty() || x.dims.back() % 2 != 0 || x.dims.back() < 2) {
    m << "SwiGLU node '" << node << "': input '" << x.name << "' has shape " << ShapeText(x.dims) << "; its last dim "
      << "must be 2 * F >= 2 (gate then up, the fused [wg | wu] projection's output)";
    return Status(Code::kInvalidArgument, m.str());
  }
  *f = x.dims.back() / 2;
  *rows = Elements(x.dims) / x.dims.back();
  return Status::Ok();
}

}  // namespace ortkv
