// PagedCacheUpdate's plan and CPU kernel, the shared pool checks of both paged ops, and PagedRequantize
// (Note [Paged cache physical form], Note [PagedCacheUpdate validation] in ortkv/paged.h).
#include <algorithm>
#include <cstring>
#include <sstream>
#include <vector>

#include "ortkv/paged.h"
#include "paged_common.h"

namespace ortkv {

using codecs::PageFormat;
using codecs::PageView;
using codecs::RowResult;

namespace paged {

Status Bad(const std::string& op, const std::string& node, const std::string& what) {
  Message m;
  m << NodeWhere{op.c_str(), node} << ": " << what;
  return Status(Code::kInvalidArgument, m.str());
}

float ToFloat(int32_t elem, const void* base, int64_t i) {
  if (elem == kFloat32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  return elem == kFloat16 ? codecs::F16BitsToF32(h) : codecs::BF16BitsToF32(h);
}

void LoadRow(int32_t elem, const void* base, int64_t first, int64_t n, float* out) {
  if (elem == kFloat32) {
    memcpy(out, static_cast<const float*>(base) + first, n * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(base) + first;
  if (elem == kFloat16) {
    for (int64_t i = 0; i < n; ++i) out[i] = codecs::F16BitsToF32(h[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = codecs::BF16BitsToF32(h[i]);
  }
}

void StoreRow(int32_t elem, void* base, int64_t first, int64_t n, const float* in) {
  if (elem == kFloat32) {
    memcpy(static_cast<float*>(base) + first, in, n * sizeof(float));
    return;
  }
  uint16_t* h = static_cast<uint16_t*>(base) + first;
  if (elem == kFloat16) {
    for (int64_t i = 0; i < n; ++i) h[i] = codecs::F32ToF16Bits(in[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) h[i] = codecs::F32ToBF16Bits(in[i]);
  }
}

static bool IsLogical(int32_t t) { return t == kFloat32 || t == kFloat16 || t == kBFloat16; }

Status ResolvePool(const std::string& op, const std::string& node, const TensorArg& pool, const TensorArg& directory,
                   const TensorArg& table, const PagedAttrs& a, int64_t batch, int64_t head_size, PagedPool* p) {
  Message m;  // Note [Messages on the error path only]
  if (a.num_layers < 1 || a.layer < 0 || a.layer >= a.num_layers) {
    m << "attribute layer=" << a.layer << " must be in [0, num_layers=" << a.num_layers
      << ") (num_layers >= 1: the layers of every page slot)";
    return Bad(op, node, m.str());
  }
  if (a.kv_num_heads < 1 || a.page_size < 1 || a.kv_num_heads > INT32_MAX || a.page_size > INT32_MAX ||
      head_size < 1 || head_size > INT32_MAX) {
    m << "attributes kv_num_heads=" << a.kv_num_heads << " and page_size=" << a.page_size
      << " and the head size " << head_size << " must be positive";
    return Bad(op, node, m.str());
  }
  if (pool.elem_type != 2 /* uint8 */ || pool.dims.size() != 1) {
    m << "pool '" << pool.name << "' must be a uint8 tensor [pool_bytes] (rank " << pool.dims.size() << ", "
      << ElemTypeName(pool.elem_type) << " given): bind the page pool's bytes";
    return Bad(op, node, m.str());
  }
  if (directory.elem_type != kInt64 || directory.dims.size() != 2 || directory.dims[1] != 2) {
    m << "directory '" << directory.name << "' must be int64 [num_pages, 2] = (format, byte offset); got "
      << ElemTypeName(directory.elem_type) << " of rank " << directory.dims.size();
    if (directory.dims.size() == 2) m << " with " << directory.dims[1] << " columns";
    return Bad(op, node, m.str());
  }
  if (table.elem_type != 6 /* int32 */ || table.dims.size() != 2 || table.dims[0] != batch) {
    m << "page table '" << table.name << "' must be int32 [batch=" << batch << ", max_pages]; got "
      << ElemTypeName(table.elem_type) << " of rank " << table.dims.size();
    if (table.dims.size() == 2) m << " [" << table.dims[0] << ", " << table.dims[1] << "]";
    return Bad(op, node, m.str());
  }
  p->pool = static_cast<uint8_t*>(const_cast<void*>(pool.data));
  p->pool_bytes = static_cast<uint64_t>(pool.dims[0]);
  p->directory = static_cast<const int64_t*>(directory.data);
  p->num_pages = directory.dims[0];
  p->page_table = static_cast<const int32_t*>(table.data);
  p->max_pages = table.dims[1];
  p->layer = a.layer;
  p->num_layers = a.num_layers;
  p->shape = codecs::PageShape{static_cast<int32_t>(a.kv_num_heads), static_cast<int32_t>(a.page_size),
                               static_cast<int32_t>(head_size)};
  for (int f = 0; f < codecs::kNumPageFormats; ++f) p->layouts[f] = codecs::LayoutOf(static_cast<PageFormat>(f), p->shape);
  return Status::Ok();
}

}  // namespace paged

// Note [Page checks without strings]: the plans check every page a row reads, on every run (a decode step of
// a 4K-token row at pages of 16: 256 pages per layer). Building the error message's prefix up front (an
// ostringstream and a dozen insertions per page) cost ~1.2 us a page, 0.45 ms of a 1.3 ms PagedCacheAttention
// at 8K keys (perf, CPU): a valid page now costs only its checks; the message is built when one fails.
static bool PageValid(const PagedPool& p, int64_t b, int64_t page_index) {
  const int64_t id = p.page_table[b * p.max_pages + page_index];
  if (id < 0 || id >= p.num_pages) return false;
  const int64_t fmt = p.directory[2 * id], off = p.directory[2 * id + 1];
  if (fmt < 0 || fmt >= codecs::kNumPageFormats) return false;
  const codecs::PageFormat f = static_cast<codecs::PageFormat>(fmt);
  if (p.shape.kv_heads <= 0 || p.shape.page_size <= 0 || p.shape.head_size <= 0 ||
      p.shape.head_size % codecs::HeadSizeMultiple(f) != 0)
    return false;  // what codecs::ValidateShape refuses
  const uint64_t slot = static_cast<uint64_t>(p.num_layers) * p.layouts[fmt].page_bytes;
  return off >= 0 && off % codecs::kSectionAlign == 0 && static_cast<uint64_t>(off) <= p.pool_bytes &&
         slot <= p.pool_bytes - static_cast<uint64_t>(off);
}

Status CheckPage(const NodeWhere& where, const PagedPool& p, const std::string& pool_name, const std::string& dir_name,
                 const std::string& table_name, int64_t b, int64_t page_index, int64_t needed_tokens) {
  if (PageValid(p, b, page_index)) return Status::Ok();  // Note [Page checks without strings]
  Message m;  // Note [Messages on the error path only]
  m << where << ": row " << b << " needs page " << page_index << " of its page table '" << table_name << "' (tokens ["
    << p.EntryBegin(b, page_index) << ", " << p.EntryBegin(b, page_index + 1) << "), the row uses "
    << needed_tokens << " tokens) but ";
  const int64_t id = p.page_table[b * p.max_pages + page_index];
  if (id < 0) {
    m << "the entry is " << id << " (no page). Remedy: allocate the page and write its id into the page table "
      << "before the run. Nothing was written.";
    return Status(Code::kInvalidArgument, m.str());
  }
  if (id >= p.num_pages) {
    m << "page id " << id << " is outside the directory '" << dir_name << "' of " << p.num_pages
      << " pages. Remedy: grow the directory or fix the page table. Nothing was written.";
    return Status(Code::kInvalidArgument, m.str());
  }
  const int64_t fmt = p.directory[2 * id], off = p.directory[2 * id + 1];
  if (fmt < 0 || fmt >= codecs::kNumPageFormats) {
    m << "directory '" << dir_name << "' gives page " << id << " format " << fmt
      << ", not a page format (0 F16, 1 BF16, 2 INT8, 3 FP8_E4M3, 4 INT4, 5 INT2, 6 INT4_KC, 7 INT2_KC). Remedy: "
      << "fix the directory entry. Nothing was written.";
    return Status(Code::kInvalidArgument, m.str());
  }
  const Status shape = codecs::ValidateShape(static_cast<int32_t>(fmt), p.shape);
  if (!shape.ok()) {
    m << "page " << id << ": " << shape.message() << ". Nothing was written.";
    return Status(Code::kInvalidArgument, m.str());
  }
  const uint64_t slot = static_cast<uint64_t>(p.num_layers) * p.layouts[fmt].page_bytes;
  if (off < 0 || off % codecs::kSectionAlign != 0 || static_cast<uint64_t>(off) > p.pool_bytes ||
      slot > p.pool_bytes - static_cast<uint64_t>(off)) {
    m << "directory '" << dir_name << "' places page " << id << " (" << codecs::FormatName(static_cast<PageFormat>(fmt))
      << ", " << p.num_layers << " layers x " << p.layouts[fmt].page_bytes << " = " << slot << " bytes) at offset "
      << off << ", which is not a multiple of " << codecs::kSectionAlign << " inside the pool '" << pool_name << "' of "
      << p.pool_bytes << " bytes. Remedy: fix the directory entry or bind the whole pool. Nothing was written.";
    return Status(Code::kInvalidArgument, m.str());
  }
  return Status::Ok();
}

Status CheckPageFillShape(const std::string& op, const std::string& node, const TensorArg& fill,
                          const std::string& table_name, int64_t batch, int64_t max_pages) {
  if (fill.elem_type == 6 /* int32 */ && fill.dims.size() == 2 && fill.dims[0] == batch && fill.dims[1] == max_pages)
    return Status::Ok();
  Message m;  // Note [Messages on the error path only]
  m << "page_fill '" << fill.name << "' must be int32 [batch=" << batch << ", max_pages=" << max_pages << "], the shape of the "
    << "page table '" << table_name << "'; got " << ElemTypeName(fill.elem_type) << " of rank " << fill.dims.size();
  if (fill.dims.size() == 2) m << " [" << fill.dims[0] << ", " << fill.dims[1] << "]";
  m << ". Remedy: bind one fill per page-table entry (Note [Page fill]). Nothing was written.";
  return paged::Bad(op, node, m.str());
}

Status ResolvePageFill(const std::string& op, const std::string& node, const TensorArg* fill,
                       const std::string& table_name, int64_t batch, PagedPool* p, std::vector<int64_t>* prefix) {
  p->page_fill = nullptr;
  p->fill_prefix = nullptr;
  if (fill == nullptr) return Status::Ok();
  const int64_t B = batch;
  ORTKV_RETURN_IF_ERR(CheckPageFillShape(op, node, *fill, table_name, B, p->max_pages));
  Message m;  // Note [Messages on the error path only]
  const int32_t* f = static_cast<const int32_t*>(fill->data);
  const int64_t ps = p->shape.page_size, mp = p->max_pages;
  prefix->assign(static_cast<size_t>(B * (mp + 1)), 0);
  for (int64_t b = 0; b < B; ++b) {
    int64_t* pre = prefix->data() + b * (mp + 1);
    for (int64_t e = 0; e < mp; ++e) {
      const int32_t v = f[b * mp + e];
      if (v < 0 || v > ps) {
        m << "page_fill '" << fill->name << "' row " << b << " entry " << e << " is " << v
          << ", outside [0, page_size=" << ps << "] (the rows of the entry's page that the row holds). Remedy: "
          << "fix the fill. Nothing was written.";
        return paged::Bad(op, node, m.str());
      }
      pre[e + 1] = pre[e] + v;
    }
  }
  p->page_fill = f;
  p->fill_prefix = prefix->data();
  return Status::Ok();
}

Status PlanPagedCacheUpdate(const std::string& node, const TensorArg& pool, const TensorArg& directory,
                            const TensorArg& page_table, const TensorArg& key, const TensorArg& value,
                            const TensorArg& position, const PagedAttrs& attrs, PagedUpdateView* view,
                            const TensorArg* page_fill, const std::string* op_name,
                            const TensorArg* rotary_table) {
  static const std::string kOp = "PagedCacheUpdate";  // once: no allocation per run
  const std::string& op = op_name != nullptr ? *op_name : kOp;
  Message m;  // Note [Messages on the error path only]
  if (!paged::IsLogical(key.elem_type) || key.elem_type != value.elem_type) {
    m << "key '" << key.name << "' and value '" << value.name << "' must both be float32, float16 or bfloat16 (got "
      << ElemTypeName(key.elem_type) << " and " << ElemTypeName(value.elem_type) << ")";
    return paged::Bad(op, node, m.str());
  }
  if (key.dims.size() != 3 || key.dims != value.dims) {
    m << "key '" << key.name << "' and value '" << value.name << "' must be equal [batch, tokens, kv_heads * head_size]; "
      << "got ranks " << key.dims.size() << " and " << value.dims.size();
    return paged::Bad(op, node, m.str());
  }
  const int64_t B = key.dims[0], T = key.dims[1], W = key.dims[2];
  if (attrs.kv_num_heads < 1 || W % attrs.kv_num_heads != 0 || W == 0) {
    m << "key '" << key.name << "' width " << W << " must be kv_num_heads (" << attrs.kv_num_heads << ") * head_size";
    return paged::Bad(op, node, m.str());
  }
  PagedPool& p = view->p;
  ORTKV_RETURN_IF_ERR(paged::ResolvePool(op, node, pool, directory, page_table, attrs, B, W / attrs.kv_num_heads, &p));
  ORTKV_RETURN_IF_ERR(ResolvePageFill(op, node, page_fill, page_table.name, B, &p, &view->fill_prefix));
  if (position.elem_type != kInt64 || position.dims.size() > 1 || (position.dims.size() == 1 && position.dims[0] != B)) {
    m << "position '" << position.name << "' must be an int64 scalar or a vector of " << B << " positions";
    return paged::Bad(op, node, m.str());
  }
  view->key = key.data;
  view->value = value.data;
  view->elem_type = key.elem_type;
  view->positions = static_cast<const int64_t*>(position.data);
  view->position_stride = position.dims.size() == 1 ? 1 : 0;
  view->B = B;
  view->T = T;
  const int64_t ps = attrs.page_size;
  const NodeWhere where{op.c_str(), node};
  // page id * page_size + row, to refuse a row written twice; the plan's buffers are the thread's, reused by every
  // run (no allocation per run once they hold a step's rows)
  thread_local std::vector<int64_t> written, sorted;
  written.clear();
  for (int64_t b = 0; b < B && T > 0; ++b) {
    const int64_t pos = view->position(b);
    if (pos < 0) {
      m << "position " << pos << " for row " << b << " of '" << position.name << "' is negative";
      return paged::Bad(op, node, m.str());
    }
    const int64_t cap = p.Total(b);
    if (pos > cap - T) {
      if (page_fill == nullptr) {
        m << where << ": row " << b << ": position " << pos << " + tokens " << T << " = " << pos + T
          << " exceeds the page table's capacity of " << p.max_pages << " pages x " << ps << " tokens = " << cap
          << " ('" << page_table.name << "'). Remedy: widen the page table. Nothing was written.";
      } else {  // Note [Page fill]
        m << where << ": row " << b << ": position " << pos << " + tokens " << T << " = " << pos + T
          << " exceeds the row's total fill of " << cap << " tokens ('" << page_fill->name << "' over '"
          << page_table.name << "'). Remedy: give the row entries (pages and fills) for every position it writes. "
          << "Nothing was written.";
      }
      return Status(Code::kCapacity, m.str());
    }
    if (rotary_table != nullptr && pos + T > rotary_table->dims[0]) {  // Note [PagedRotaryCacheUpdate]
      m << where << ": row " << b << ": position " << pos << " + tokens " << T << " = " << pos + T
        << " exceeds the rotary table '" << rotary_table->name << "' of " << rotary_table->dims[0]
        << " rows (a row per position). Remedy: build the rotary tables with >= " << pos + T
        << " rows. Nothing was written.";
      return Status(Code::kCapacity, m.str());
    }
    const int64_t first = p.Locate(b, pos).entry, last = p.Locate(b, pos + T - 1).entry;
    for (int64_t pi = first; pi <= last; ++pi) {
      if (p.EntryBegin(b, pi) == p.EntryBegin(b, pi + 1)) continue;  // fill 0: skipped, id not read
      ORTKV_RETURN_IF_ERR(CheckPage(where, p, pool.name, directory.name, page_table.name, b, pi, pos + T));
      const int32_t id = p.page_table[b * p.max_pages + pi];
      const auto f = static_cast<PageFormat>(p.directory[2 * id]);
      if (codecs::KeysPerChannel(f)) {
        m << where << ": row " << b << " writes tokens into page " << id << " (page " << pi << " of '"
          << page_table.name << "'), a " << codecs::FormatName(f) << " page: its keys are scaled per channel over the "
          << "whole page, so key rows cannot be written alone. Remedy: fill the page as F16/BF16 and requantize it "
          << "when full (paged_requantize). Nothing was written.";
        return Status(Code::kInvalidArgument, m.str());
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      const PagedPool::Loc l = p.Locate(b, pos + t);
      written.push_back(static_cast<int64_t>(l.id) * ps + l.row);
    }
  }
  sorted.assign(written.begin(), written.end());
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup != sorted.end()) {
    int64_t first = -1, second = -1;
    for (size_t i = 0; i < written.size(); ++i)
      if (written[i] == *dup) (first < 0 ? first : second) = static_cast<int64_t>(i);
    m << where << ": rows " << first / T << " and " << second / T << " both write row " << *dup % ps << " of page "
      << *dup / ps << " (a page shared by two sequences). Remedy: give each writing sequence its own copy of the "
      << "page (copy on write). Nothing was written.";
    return Status(Code::kInvalidArgument, m.str());
  }
  // every row of a scaled format must encode (Note [PagedCacheUpdate validation])
  const int64_t D = p.shape.head_size, Hkv = p.shape.kv_heads;
  thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(D));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t tok = view->position(b) + t;
      const int32_t id = p.Locate(b, tok).id;
      const auto f = static_cast<PageFormat>(p.directory[2 * id]);
      if (codecs::ScalesPerRow(f) == 0) continue;
      for (int kv = 0; kv < 2; ++kv)
        for (int64_t h = 0; h < Hkv; ++h) {
          paged::LoadRow(view->elem_type, kv ? view->value : view->key, ((b * T + t) * Hkv + h) * D, D, row.data());
          uint16_t sc[2];
          const RowResult r = codecs::RowScales(codecs::RowFormat(f), row.data(), static_cast<int32_t>(D), sc);
          if (r != RowResult::kOk) {
            std::ostringstream w;
            w << where << ": '" << (kv ? value.name : key.name) << "' [row " << b << ", token " << t << ", head " << h
              << "] into page " << id << " (position " << tok << ")";
            const Status e = codecs::RowError(r, f, w.str());
            return Status(e.code(), e.message() + "; nothing was written");
          }
        }
    }
  return Status::Ok();
}

void PagedUpdateUnitSpan(const PagedUpdateView& v, int64_t unit, uintptr_t* first, uintptr_t* last) {
  const int64_t b = unit / v.T, t = unit % v.T;
  const PageView pg = v.p.Page(v.p.Locate(b, v.position(b) + t).id);
  *first = reinterpret_cast<uintptr_t>(pg.base);
  *last = *first + pg.layout.page_bytes;
}

void PagedCacheUpdateCpu(const PagedUpdateView& v, int64_t begin, int64_t end) {
  const int64_t D = v.p.shape.head_size, Hkv = v.p.shape.kv_heads;
  thread_local std::vector<float> row;  // the thread's, reused: no allocation per run
  row.resize(static_cast<size_t>(D));
  for (int64_t u = begin; u < end; ++u) {
    const int64_t b = u / v.T, t = u % v.T, tok = v.position(b) + t;
    const PagedPool::Loc l = v.p.Locate(b, tok);  // Note [Page fill]
    const PageView pg = v.p.Page(l.id);
    for (int kv = 0; kv < 2; ++kv)
      for (int64_t h = 0; h < Hkv; ++h) {
        paged::LoadRow(v.elem_type, kv ? v.value : v.key, ((b * v.T + t) * Hkv + h) * D, D, row.data());
        pg.EncodeRow(kv, static_cast<int32_t>(h), l.row, row.data());  // checked by the plan
      }
  }
}

}  // namespace ortkv
