// PagedRotaryCacheUpdate's plan and its CPU rotary (Note [PagedRotaryCacheUpdate] in ortkv/paged.h).
#include <algorithm>
#include <vector>

#include "ortkv/paged.h"
#include "ortkv/rotary_cache_update.h"
#include "paged_common.h"

namespace ortkv {

Status PlanPagedRotary(const std::string& node, const TensorArg& qkv, const TensorArg& position, const TensorArg& cos,
                       const TensorArg& sin, int64_t heads, const PagedAttrs& attrs, bool read_positions,
                       PagedRotary* r, TensorArg* key, TensorArg* value) {
  static const std::string op = "PagedRotaryCacheUpdate";
  Message m;  // Note [Messages on the error path only]
  if (qkv.elem_type != kFloat32 && qkv.elem_type != kFloat16 && qkv.elem_type != kBFloat16) {
    m << "qkv '" << qkv.name << "' must be float32, float16 or bfloat16 (got " << ElemTypeName(qkv.elem_type) << ")";
    return paged::Bad(op, node, m.str());
  }
  const int64_t H = heads, Hkv = attrs.kv_num_heads;
  if (H < 1 || Hkv < 1) {
    m << "attributes num_heads = " << H << " and kv_num_heads = " << Hkv << " must both be >= 1";
    return paged::Bad(op, node, m.str());
  }
  if (qkv.dims.size() != 3) {
    m << "qkv '" << qkv.name << "' must be [batch, tokens, (num_heads + 2 kv_num_heads) * head_size]; got rank "
      << qkv.dims.size();
    return paged::Bad(op, node, m.str());
  }
  const int64_t W = qkv.dims[2];
  if (W <= 0 || W % (H + 2 * Hkv) != 0 || (W / (H + 2 * Hkv)) % 2 != 0) {
    m << "qkv '" << qkv.name << "' width " << W << " must be (num_heads " << H << " + 2 x kv_num_heads " << Hkv
      << ") * head_size = " << H + 2 * Hkv << " * head_size with an even head_size (the rotary turns pairs)";
    return paged::Bad(op, node, m.str());
  }
  const int64_t D = W / (H + 2 * Hkv);
  if (cos.elem_type != qkv.elem_type || sin.elem_type != qkv.elem_type) {
    m << "rotary tables '" << cos.name << "' and '" << sin.name << "' must have qkv's type " << ElemTypeName(qkv.elem_type)
      << " (got " << ElemTypeName(cos.elem_type) << " and " << ElemTypeName(sin.elem_type) << ")";
    return paged::Bad(op, node, m.str());
  }
  if (cos.dims.size() != 2 || cos.dims != sin.dims || cos.dims[1] != D / 2) {
    m << "rotary tables '" << cos.name << "' and '" << sin.name << "' must both be [rows, head_size / 2 = " << D / 2
      << "]; got ranks " << cos.dims.size() << " and " << sin.dims.size();
    if (cos.dims.size() == 2) m << ", '" << cos.name << "' [" << cos.dims[0] << ", " << cos.dims[1] << "]";
    return paged::Bad(op, node, m.str());
  }
  r->qkv = qkv.data;
  r->cos = cos.data;
  r->sin = sin.data;
  r->elem_type = qkv.elem_type;
  r->B = qkv.dims[0];
  r->T = qkv.dims[1];
  r->heads = H;
  r->kv_heads = Hkv;
  r->head_size = D;
  r->table_rows = cos.dims[0];
  r->positions = nullptr;
  r->position_stride = 0;
  if (read_positions && position.elem_type == kInt64 &&
      (position.dims.empty() || (position.dims.size() == 1 && position.dims[0] == r->B))) {
    r->positions = static_cast<const int64_t*>(position.data);
    r->position_stride = position.dims.empty() ? 0 : 1;
  }
  const size_t es = qkv.elem_type == kFloat32 ? 4 : 2;
  for (TensorArg* a : {key, value}) {
    a->elem_type = qkv.elem_type;
    a->dims = {r->B, r->T, Hkv * D};
  }
  key->name = qkv.name + " (rotated k columns)";
  value->name = qkv.name + " (v columns)";
  key->data = static_cast<const uint8_t*>(qkv.data) + static_cast<size_t>(H * D) * es;
  value->data = static_cast<const uint8_t*>(qkv.data) + static_cast<size_t>((H + Hkv) * D) * es;
  return Status::Ok();
}

namespace {

// The head of token u at column `col` of qkv, rotated at position p into `out` (elements of qkv's type).
void RotateHead(const PagedRotary& r, int64_t u, int64_t col, int64_t p, void* out, int64_t out_first) {
  const int64_t D = r.head_size, half = D / 2;
  thread_local std::vector<float> x, c, s, y;
  x.resize(static_cast<size_t>(D));
  y.resize(static_cast<size_t>(D));
  c.resize(static_cast<size_t>(half));
  s.resize(static_cast<size_t>(half));
  paged::LoadRow(r.elem_type, r.qkv, u * r.width() + col, D, x.data());
  paged::LoadRow(r.elem_type, r.cos, p * half, half, c.data());
  paged::LoadRow(r.elem_type, r.sin, p * half, half, s.data());
  RotateInterleaved(x.data(), c.data(), s.data(), half, y.data());
  paged::StoreRow(r.elem_type, out, out_first, D, y.data());  // rounded to the type
}

}  // namespace

void PagedRotaryKeysCpu(const PagedRotary& r, int64_t capacity, void* k_out, void* v_out) {
  const int64_t D = r.head_size, Hkv = r.kv_heads, H = r.heads;
  thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(D));
  for (int64_t b = 0; b < r.B; ++b) {
    const int64_t pos = r.positions != nullptr ? r.positions[b * r.position_stride] : -1;
    const bool ok = pos >= 0 && pos <= capacity - r.T && pos + r.T <= r.table_rows;  // else the plan refuses the row
    for (int64_t t = 0; t < r.T; ++t) {
      const int64_t u = b * r.T + t;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t at = (u * Hkv + h) * D;
        if (ok) {
          RotateHead(r, u, (H + h) * D, pos + t, k_out, at);
          paged::LoadRow(r.elem_type, r.qkv, u * r.width() + (H + Hkv + h) * D, D, row.data());
        } else {
          std::fill(row.begin(), row.end(), 0.0f);
          paged::StoreRow(r.elem_type, k_out, at, D, row.data());
        }
        paged::StoreRow(r.elem_type, v_out, at, D, row.data());
      }
    }
  }
}

void PagedRotaryQueriesCpu(const PagedRotary& r, void* q_out) {
  const int64_t D = r.head_size;
  for (int64_t u = 0; u < r.B * r.T; ++u) {
    const int64_t p = r.positions[(u / r.T) * r.position_stride] + u % r.T;
    for (int64_t h = 0; h < r.heads; ++h) RotateHead(r, u, h * D, p, q_out, (u * r.heads + h) * D);
  }
}

}  // namespace ortkv
