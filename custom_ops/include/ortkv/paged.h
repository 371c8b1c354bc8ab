// PagedCacheUpdate and PagedCacheAttention: framework-free description and CPU kernels.
//
// Note [Paged cache physical form]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ORT cannot bind a sequence of differently typed tensors, so the paged cache is three plain tensors,
// all bound in place (the same buffers every run):
//   * pool       uint8 [pool_bytes]: every page's bytes (host or CUDA memory; in ortkv.paged a view of a
//                VMM arena in which each format has its own slab that grows by committing granules).
//   * directory  int64 [num_pages, 2] = (format code, byte offset of the page's slot in pool).
//   * page_table int32 [batch, max_pages_per_seq] of page ids, -1 = none.
// A page id names one logical page of page_size tokens for ALL layers (vLLM's block table, shared by
// every layer); its slot holds num_layers codec pages of its one format back to back, so layer l of
// page p starts at directory[p, 1] + l * LayoutOf(directory[p, 0], shape).page_bytes (Note [Page
// formats] for a codec page's bytes). Sequence b's token t lives in page page_table[b, t / page_size],
// row t % page_size, unless the optional page_fill input says otherwise (Note [Page fill]). The host
// owns directory, page_table and page_fill; the ops only read them.
//
// Note [Page fill]
// ~~~~~~~~~~~~~~~~
// Both paged ops take an optional last input page_fill, int32 [batch, max_pages] (the page table's
// shape). Entry e of row b holds the FIRST page_fill[b, e] rows (0 ... page_size) of page
// page_table[b, e]. A row's logical positions are its entries' rows concatenated in entry order:
// position t lives in the entry e with prefix(e) <= t < prefix(e) + fill(e), prefix(e) = the sum of the
// fills of the entries before e, at row t - prefix(e) of that page. Entries with fill 0 are skipped
// (their page id is never read and may be -1). page_fill absent == every entry full (page_size): the
// mapping of Note [Paged cache physical form], bit for bit.
// Why: a fork or a beam reorder becomes a page-table change that copies nothing. The child keeps the
// parent's entries, the partly filled page they share included with fill = the rows it shares, and its
// next token goes into an entry of its own (a new page, fill growing from 0); the owner at the shared
// page's high-water mark keeps appending to it (python/ortkv/cache/pages.py, Note [Page metadata]).
// Everything else stays in LOGICAL positions: position / start, the T new tokens, causality inside the
// new block (query t sees logical keys [0, start + t]). A position at or past the row's total fill is a
// capacity error naming the row, the position and the total; fill outside [0, page_size] is refused
// naming the tensor, row, entry and value. The page checks (page present, inside the directory, format,
// slot inside the pool), the (page, row)-written-twice check, write protection and the encode refusals
// all apply to the mapped (page, row).
// CPU: the plan turns page_fill into per-row prefix sums (PagedPool::fill_prefix, [B, max_pages + 1],
// host memory owned by the view) and PagedPool::Locate maps a logical position by a binary search over
// them; the kernels take runs of rows inside one entry (Locate's `run`), so a block still spans several
// pages. CUDA: Note [Page fill] on CUDA in ortkv/paged_cuda.h (device prefix sums, the same mapping).
//
// Note [PagedCacheUpdate validation]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Nothing is written unless everything is valid, so the plan checks, before the first byte:
//   * shapes, element types and attributes;
//   * page_fill, when bound: int32 [batch, max_pages], every value in [0, page_size] (Note [Page fill]);
//   * per row b: position_b >= 0 and position_b + T <= the row's capacity, max_pages * page_size or, with
//     page_fill, the sum of its fills (E_CAPACITY);
//   * every page the T tokens touch (through page_fill's mapping when bound): page id present (not -1)
//     and < num_pages; its directory entry's
//     format is a page format the head size allows; its slot [offset, offset + num_layers *
//     page_bytes) lies inside the pool;
//   * no *_KC page receives keys (those pages are written whole by paged_requantize; the page being
//     filled stays F16/BF16);
//   * no (page, row) written twice in one call (two sequences sharing a page both writing it);
//   * every row of a scaled format has a finite scale (no inf / NaN; scale and minimum fit float16):
//     RowScales for every row first, then the encode pass, which then cannot fail;
//   * no written page layer overlaps a write-protected or uncommitted range (checked by the adapter).
// The update never allocates and never touches bytes other than the T rows (payload and per-row
// scales) of each (row b, KV head) in this call's layer.
//
// Note [PagedCacheAttention CPU]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The structure of CacheAttention's CPU kernel (Note [CacheAttention CPU split-K]): one unit is a (row,
// KV head, query token) serving the group's G query heads, keys in blocks with an online softmax,
// split-K when units are too few for the threads. A block gathers up to kAttnBlockKeys rows over the
// pages it spans while they share one format; F16 / BF16 rows are converted in registers where the block
// kernel reads them, rows of the scaled formats are decoded by the page's own format (PageView::DecodeRow's
// arithmetic, 16 channels per vector when head_size is a multiple of 16) into a per-thread buffer of
// kAttnBlockKeys x head_size floats per K and V (Note [PagedCacheAttention in registers] in
// kernels/cpu/paged_attention_task.inc). Nothing the size of the cache is ever materialized; rows past a
// sequence's valid length are never read.
// The query and the output have the logical type (float32, float16 or bfloat16); arithmetic is float32.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "codecs.h"
#include "ortkv/cache_update.h"
#include "ortkv/status.h"

namespace ortkv {

// The attributes shared by both paged ops.
struct PagedAttrs {
  int64_t layer = 0;
  int64_t num_layers = 0;
  int64_t kv_num_heads = 0;
  int64_t page_size = 0;
  // PagedCacheAttention's optional page_format attribute (a PageFormat; -1 when absent: any format): the node
  // promises that every page it reads has this format, and refuses a page of another (Note [Paged CUDA uniform
  // 16-bit] in kernels/cuda/paged_cuda.cu: what the promise buys on CUDA)
  int32_t page_format = -1;
  // PagedCacheAttention's optional static_tables attribute (0 when absent): the node promises that its directory
  // and page table are never written by a node of its graph (graph inputs or initializers), so the CUDA kernels
  // trust what they read of them before waiting for the kernel before (Note [Paged CUDA static tables] in
  // kernels/cuda/paged_cuda.cu). ortkv's checker refuses the promise on a table that a node computes.
  bool static_tables = false;
};

// What both ops resolve: the pool, the directory, the page table, and the layer's page bytes per format.
struct PagedPool {
  uint8_t* pool = nullptr;
  uint64_t pool_bytes = 0;
  const int64_t* directory = nullptr;  // [num_pages, 2]
  int64_t num_pages = 0;
  const int32_t* page_table = nullptr;  // [B, max_pages]
  int64_t max_pages = 0;
  // Note [Page fill]: [B, max_pages] rows per entry; nullptr = every entry full (page_size rows).
  const int32_t* page_fill = nullptr;
  // Host memory, CPU kernels only: per row, max_pages + 1 prefix sums of page_fill (set by the CPU plan
  // when page_fill is bound, owned by its view); nullptr when page_fill is.
  const int64_t* fill_prefix = nullptr;
  int64_t layer = 0, num_layers = 0;
  codecs::PageShape shape;                                    // kv_heads, page_size, head_size
  codecs::PageLayout layouts[codecs::kNumPageFormats];         // per format, for this shape

  // Page `id` (validated) of this layer.
  codecs::PageView Page(int64_t id) const {
    const auto f = static_cast<codecs::PageFormat>(directory[2 * id]);
    codecs::PageView v;
    v.base = pool + directory[2 * id + 1] + static_cast<uint64_t>(layer) * layouts[static_cast<int>(f)].page_bytes;
    v.format = f;
    v.shape = shape;
    v.layout = layouts[static_cast<int>(f)];
    return v;
  }
  int32_t PageId(int64_t b, int64_t t) const { return page_table[b * max_pages + t / shape.page_size]; }

  // Where logical position t of row b lives (Note [Page fill]): the page table entry, the page id, the row
  // in that page, and `run`, the rows of this entry from `row` on (positions t .. t + run - 1 are rows
  // row .. row + run - 1 of the same page). t must be below the row's total (checked by the plans).
  struct Loc {
    int64_t entry;
    int32_t id;
    int32_t row;
    int64_t run;
  };
  Loc Locate(int64_t b, int64_t t) const {
    const int64_t ps = shape.page_size;
    if (fill_prefix == nullptr) {
      const int64_t e = t / ps;
      return Loc{e, page_table[b * max_pages + e], static_cast<int32_t>(t % ps), ps - t % ps};
    }
    const int64_t* pre = fill_prefix + b * (max_pages + 1);
    // pre is non-decreasing; the entry is the last e with pre[e] <= t, which then has pre[e + 1] > t
    int64_t lo = 0, hi = max_pages;  // invariant: pre[lo] <= t < pre[hi]
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (pre[mid] <= t) lo = mid; else hi = mid;
    }
    return Loc{lo, page_table[b * max_pages + lo], static_cast<int32_t>(t - pre[lo]), pre[lo + 1] - t};
  }
  // Logical positions of row b (Note [Page fill]): [EntryBegin(b, e), EntryBegin(b, e + 1)) live in entry e.
  int64_t EntryBegin(int64_t b, int64_t e) const {
    return fill_prefix == nullptr ? e * shape.page_size : fill_prefix[b * (max_pages + 1) + e];
  }
  int64_t Total(int64_t b) const { return EntryBegin(b, max_pages); }
};

// Checks page page_index of row b's page table: present (not -1), inside the directory, a format the
// head size allows, its slot 16-byte aligned and inside the pool. `where` prefixes the message (the op
// and node name). Status kInvalidArgument on failure.
Status CheckPage(const NodeWhere& where, const PagedPool& p, const std::string& pool_name,
                 const std::string& dir_name, const std::string& table_name, int64_t b, int64_t page_index,
                 int64_t needed_tokens);

// Note [Page fill]: page_fill's type and shape (int32 [batch, max_pages], the page table's); the values are
// not read (the CUDA plans check only this: the values are on the device).
Status CheckPageFillShape(const std::string& op, const std::string& node, const TensorArg& fill,
                          const std::string& table_name, int64_t batch, int64_t max_pages);

// Note [Page fill]: validates page_fill (int32 [B, max_pages] like the page table, every value in
// [0, page_size]) and sets p->page_fill and p->fill_prefix (its prefix sums, written into *prefix, which
// must outlive every use of *p). `fill` == nullptr (input absent): p keeps the full mapping.
Status ResolvePageFill(const std::string& op, const std::string& node, const TensorArg* fill,
                       const std::string& table_name, int64_t batch, PagedPool* p, std::vector<int64_t>* prefix);

struct PagedUpdateView {
  PagedPool p;
  const void* key = nullptr;    // [B, T, Hkv * D] of elem_type
  const void* value = nullptr;
  int32_t elem_type = 0;        // kFloat32, kFloat16 or kBFloat16
  const int64_t* positions = nullptr;
  int64_t position_stride = 0;
  int64_t B = 0, T = 0;
  int64_t position(int64_t b) const { return positions[b * position_stride]; }
  int64_t units() const { return B * T; }  // one unit: one token of one row (all KV heads, K and V)
  std::vector<int64_t> fill_prefix;  // Note [Page fill]: p.fill_prefix's storage (do not copy the view)
};

// Validates everything (Note [PagedCacheUpdate validation]) except write protection and fills `view`.
// `page_fill`: the optional input (Note [Page fill]), nullptr when absent.
Status PlanPagedCacheUpdate(const std::string& node, const TensorArg& pool, const TensorArg& directory,
                            const TensorArg& page_table, const TensorArg& key, const TensorArg& value,
                            const TensorArg& position, const PagedAttrs& attrs, PagedUpdateView* view,
                            const TensorArg* page_fill = nullptr,
                            const std::string* op_name = nullptr,  // nullptr: "PagedCacheUpdate"
                            const TensorArg* rotary_table = nullptr);  // Note [PagedRotaryCacheUpdate]: its row bound

// [first, last) bytes of the page layer written for unit u's token (for the write-protection check).
void PagedUpdateUnitSpan(const PagedUpdateView& view, int64_t unit, uintptr_t* first, uintptr_t* last);

// CPU: encodes units [begin, end) (after a successful plan it cannot fail).
void PagedCacheUpdateCpu(const PagedUpdateView& view, int64_t begin, int64_t end);

// Note [PagedRotaryCacheUpdate]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
//   updated_pool, q_rot = PagedRotaryCacheUpdate(pool, directory, page_table, qkv, position, cos_cache, sin_cache
//                                                [, page_fill])
//   attributes layer, num_layers, kv_num_heads, page_size (PagedCacheUpdate's), num_heads
// RotaryCacheUpdate (Note [RotaryCacheUpdate] in ortkv/rotary_cache_update.h) onto a paged cache: the decoder
// layer's Split of the fused QKV projection, its two com.microsoft.RotaryEmbedding and the PagedCacheUpdate as
// ONE node (on CUDA the update's kernels, one launch for a decode step: Note [Paged CUDA resolved update]).
//   * qkv [B, T, (H + 2 Hkv) D]: q columns [0, H D), k the next Hkv D, v the last Hkv D; D even.
//   * Token t of row b is at position p = position[b] + t. q and k are rotated as RotaryCacheUpdate rotates them
//     (interleaved pairs, the whole head, c = cos_cache[p, i], s = sin_cache[p, i]) in float32 in ONE form on
//     the CPU and on CUDA, y[2i] = fma(x[2i], c, -(x[2i+1] s)), y[2i+1] = fma(x[2i], s, x[2i+1] c) (MLAS's
//     AVX2 form, Note [Rotary bit for bit]), and each rotated value is rounded to qkv's type: what a
//     RotaryEmbedding node of that type would hand PagedCacheUpdate.
//   * The pool is then written EXACTLY as PagedCacheUpdate(pool, directory, page_table, k_rot, v, position
//     [, page_fill]) writes it (every check, report and byte; the key and value are named after qkv, "(rotated k
//     columns)" and "(v columns)"); output 0 MUST alias input 0. q_rot [B, T, H D] is a new output, written only when the
//     update is (a refused node writes neither).
//   * cos_cache / sin_cache [rows, D / 2] of qkv's type: a row per position. Every position a row writes needs its
//     table row, checked per row right after its position (position + T <= rows, else E_CAPACITY naming the table,
//     nothing written): in the CPU plan, and on CUDA in the device's row check (reported after the run). The tables
//     need not cover the page table's whole capacity: a many-sequence table (page_fill) is wider than any row's
//     positions reach.
// CPU: float32, float16, bfloat16 (k rotated into a step-sized buffer, then PagedCacheUpdate's plan and encode).
// CUDA: the update kernels read k and v in place from qkv (a row stride) and rotate k as they load it; q_rot is
// written by the store phase.
struct PagedRotary {
  const void* qkv = nullptr;
  const void* cos = nullptr;
  const void* sin = nullptr;
  const int64_t* positions = nullptr;  // CPU (host) positions when their shape is valid, else nullptr
  int64_t position_stride = 0;
  int32_t elem_type = 0;
  int64_t B = 0, T = 0, heads = 0, kv_heads = 0, head_size = 0, table_rows = 0;
  int64_t width() const { return (heads + 2 * kv_heads) * head_size; }
};

// Validates qkv and the rotary tables (not the pool, nor a row's table bound: PagedCacheUpdate's plan), and
// fills `r` and the two column arguments for that plan: [B, T, Hkv D] of qkv's type, named after qkv, whose data
// point at qkv's k / v columns (rows r.width() elements apart: the CUDA kernels read them so; the CPU op points
// them at contiguous copies first). read_positions: the CPU op (host positions).
Status PlanPagedRotary(const std::string& node, const TensorArg& qkv, const TensorArg& position, const TensorArg& cos,
                       const TensorArg& sin, int64_t heads, const PagedAttrs& attrs, bool read_positions,
                       PagedRotary* r, TensorArg* key, TensorArg* value);
// CPU: rotated k and v of every token into k_out / v_out ([B, T, Hkv D] of qkv's type, contiguous); rows whose
// position PagedCacheUpdate's plan refuses are zeros.
void PagedRotaryKeysCpu(const PagedRotary& r, int64_t capacity, void* k_out, void* v_out);
// CPU: q_rot [B, T, H D] (positions valid: after the update's plan).
void PagedRotaryQueriesCpu(const PagedRotary& r, void* q_out);

struct PagedAttentionView {
  PagedPool p;
  const void* q = nullptr;  // [B, T, Hq * D] of elem_type
  void* out = nullptr;      // same
  int32_t elem_type = 0;
  const int64_t* start = nullptr;
  int64_t start_stride = 0;
  int64_t B = 0, T = 0, Hq = 0, Hkv = 0, D = 0;
  float scale = 1.0f;
  int64_t splits = 1;
  int64_t tile = 1;          // query tokens per unit (Note [Paged CPU query tiles]); > 1 only with splits == 1
  float* partial = nullptr;  // splits > 1: partial_floats() floats, owned by the caller

  int64_t tiles() const { return (T + tile - 1) / tile; }  // units of one (row, KV head)
  int64_t units() const { return B * Hkv * tiles(); }
  int64_t tasks() const { return units() * splits; }
  int64_t group() const { return Hq / Hkv; }
  int64_t partial_floats() const { return splits > 1 ? tasks() * group() * (D + 2) : 0; }
  // scores, scaled q, acc, m, l, then the decoded K and V block (tiles: Note [Paged CPU query tiles])
  int64_t scratch_floats() const;
  std::vector<int64_t> fill_prefix;  // Note [Page fill]: p.fill_prefix's storage (do not copy the view)
};

// `page_fill`: the optional input (Note [Page fill]), nullptr when absent.
Status PlanPagedCacheAttention(const std::string& node, const TensorArg& q, const TensorArg& pool,
                               const TensorArg& directory, const TensorArg& page_table, const TensorArg& start,
                               int64_t num_heads, const PagedAttrs& attrs, float scale, void* out,
                               PagedAttentionView* view, const TensorArg* page_fill = nullptr);

// CPU: tasks [begin, end); `scratch` holds view.scratch_floats() floats (per thread, 64-byte aligned).
void PagedCacheAttentionCpu(const PagedAttentionView& view, int64_t begin, int64_t end, float* scratch);

// After every task: merges split-K partials and writes the output (no-op when splits == 1).
void PagedCacheAttentionCombine(const PagedAttentionView& view);

// DecodePage + EncodePage of one slot, every layer (the pool manager's format change). Everything is
// checked (both slots inside the pool and disjoint, formats, shape, every row of every layer
// encodable) before any byte of the destination is written; on failure nothing is written.
// `logical` is the logical element type (kFloat32, kFloat16, kBFloat16): decoded values are rounded
// to it before encoding, as a kernel fed values of that type would see them.
Status PagedRequantize(uint8_t* pool, uint64_t pool_bytes, uint64_t src_offset, int32_t src_format,
                       uint64_t dst_offset, int32_t dst_format, int32_t num_layers, codecs::PageShape shape,
                       int32_t logical);
// PagedRequantize's argument checks (formats, shape, layers, logical type, both slots aligned, inside the
// pool and disjoint), shared by the host and the device versions.
Status CheckPagedRequantize(uint64_t pool_bytes, uint64_t src_offset, int32_t src_format, uint64_t dst_offset,
                            int32_t dst_format, int32_t num_layers, codecs::PageShape shape, int32_t logical);
// The slots against ortkv_core's registered ranges (Note [Write-protection check] in ortkv/protected_writes.h): the
// source, only read, must be committed (E_UNCOMMITTED); the destination, written, committed and writable
// (E_UNCOMMITTED / E_READONLY). `what`: the message's prefix ("paged_requantize: ", "paged_requantize (CUDA): ").
Status CheckRequantizeSlots(int device_type, int32_t device, const uint8_t* pool, uint64_t src_offset,
                            uint64_t src_bytes, uint64_t dst_offset, uint64_t dst_bytes, const std::string& what);
// The same on a pool in CUDA device memory (`pool`: its device address on `device`), by kernels on the device:
// the same bytes as PagedRequantize, the same checks and messages, nothing written on refusal (Note
// [Requantize on CUDA], kernels/cuda/paged_requantize.cu). Synchronizes the device before and after (the pool
// is idle between runs). Builds with the CUDA kernels only.
Status PagedRequantizeCuda(int32_t device, uint8_t* pool, uint64_t pool_bytes, uint64_t src_offset,
                           int32_t src_format, uint64_t dst_offset, int32_t dst_format, int32_t num_layers,
                           codecs::PageShape shape, int32_t logical);

}  // namespace ortkv
