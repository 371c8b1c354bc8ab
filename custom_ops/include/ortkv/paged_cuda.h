// PagedCacheUpdate and PagedCacheAttention on CUDA (CUDA builds): plans and launches.
//
// Note [Paged CUDA]
// ~~~~~~~~~~~~~~~~~
// Same inputs, attributes and physical form as the CPU ops (Note [Paged cache physical form] in
// ortkv/paged.h), every input in DEVICE memory: pool, directory, page table, key/value/query and the
// positions / starts. The host plans only what needs no data (shapes, types, attributes, the alias
// pointer); everything the CPU plan checks on the values (positions, page ids, directory entries, *_KC
// key writes, a (page, row) written twice, rows a scaled format cannot encode, write-protected and
// uncommitted ranges) is checked on the device, so a decode step can be captured as a CUDA graph.
//
// PagedCacheUpdate is three stream-ordered steps: a memset of an 8-byte device flag (ORT's allocator,
// freed to the same stream), a check kernel (one thread per (token, K/V, head) row: every check above,
// the first failure in the CPU plan's order kept with atomicMin on the flag), and a store kernel (one
// warp per row). The store kernel reads the flag first: if any check failed, NO block stores a byte and
// block 0's thread 0 reports the first failure into the CacheUpdate error word (Note [CUDA deferred
// errors]). Otherwise each warp encodes its row with the codec arithmetic of codecs.h (min / max /
// absmax reduced across the warp with the CPU's tie order, so even the sign of a zero minimum matches):
// the bytes equal the CPU op's bytes exactly. An update of at most 256 tokens and 2,048 row jobs without page_fill
// (every decode step, a short prefill) is ONE launch instead: every block resolves each token's page once into
// shared memory and checks the whole update there, then stores its share of the jobs (Note [Paged CUDA resolved
// update] in kernels/cuda/paged_cuda.cu; ORTKV_CUDA_PAGED_UPDATE=two keeps the three steps, =one runs that kernel
// in one block).
//
// PagedCacheAttention is Note [CacheAttention CUDA]'s kernel over pages: a block serves one (row, KV
// head, query token), up to kAttnCudaHeads query heads and one key chunk (split-K from the page
// table's capacity, ~4 blocks per SM). Each key row is read by D / 8 threads, 8 channels each, decoded
// in registers by the key's page's own format (a 16-, 8-, 4- or 2-byte load plus its scales; *_KC keys
// with their per-channel scales); nothing is staged. Before reading, a block checks `start` and every
// page its chunk spans (in parallel, one page per thread); a block with a bad page reads nothing of it
// (its output / partial is empty) and records (row, page) with atomicMin in a flag the epilogue kernel
// (the split-K combine, or a one-block report kernel when splits == 1) turns into one report in the
// CacheAttention word. Start is clamped to [0, capacity - T] as in the dense kernel.
//
// Note [Page fill] on CUDA: a bound page_fill ([B, max_pages] int32 in device memory) is turned into per-row
// int64 prefix sums by a one-block-per-row kernel launched first (FillPrefixKernel: fills outside [0,
// page_size] are counted as 0 and reported as problem kPageBadFill of that entry, so the prefix stays
// monotone); PagedPool::fill_prefix then points at that device scratch and every kernel maps a logical
// position through it (a binary search, or a forward cursor for the keys a thread walks in order), the
// row's capacity being its total fill (ORTKV_DERR_CAPACITY with first = 1). The attention with page_fill
// runs the first kernel (v1, per key; Note [Paged CUDA v2] assumes page_size-uniform positions), so
// all-full fills and an absent page_fill agree within float rounding on CUDA, not bit for bit.
//
// Device report fields for the paged codes (ortkv_device_error): ORTKV_DERR_PAGE: row, position
// (position / start), n (tokens), hit_addr = page index in the row's table, first = page id, last =
// problem | format << 8 | offset << 16 (problem: kPageNone...kPageFormatHint below; kPageFormatHint's byte also holds
// the page_format attribute's format << 4).
// ORTKV_DERR_CAPACITY: first = 1 the row's total fill (page_fill), 2 PagedRotaryCacheUpdate's rotary table
// (capacity = its rows), else the page table's capacity.
// ORTKV_DERR_SHARED_ROW: row (the later row), position (its token), hit_addr = the earlier row, first =
// page id, last = row inside the page. ORTKV_DERR_ENCODE: row, position (the token), hit_addr = head,
// first = page id, last = RowResult | kv << 8 | format << 16. ORTKV_DERR_READONLY / _UNCOMMITTED as for
// CacheUpdate (position = the token).
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "ortkv/paged.h"

namespace ortkv {

enum PagedProblem : int32_t {
  kPageOk = 0,
  kPageNone = 1,            // the table entry is negative (no page)
  kPageOutside = 2,         // page id >= directory rows
  kPageBadFormat = 3,       // directory format not a page format
  kPageHeadSize = 4,        // the format cannot pack this head size
  kPageBadSlot = 5,         // offset not 16-aligned or the slot not inside the pool
  kPageKeysPerChannel = 6,  // PagedCacheUpdate: keys into a *_KC page
  kPageBadFill = 7,         // page_fill of the entry outside [0, page_size] (Note [Page fill])
  kPageFormatHint = 8,      // PagedCacheAttention: a page of another format than the node's page_format
};

constexpr int kPagedMaxRanges = 32;
struct PagedRangeCheck {
  int count = 0;
  uint64_t lo[kPagedMaxRanges] = {}, hi[kPagedMaxRanges] = {};
  int32_t kind[kPagedMaxRanges] = {};  // ORTKV_RANGE_*
};

struct PagedUpdateCudaView {
  PagedPool p;                     // device pointers
  const void* key = nullptr;       // [B, T, Hkv * D]
  const void* value = nullptr;
  int32_t elem_type = 0;
  const int64_t* positions = nullptr;  // DEVICE memory
  int64_t position_stride = 0;
  int64_t B = 0, T = 0;
  PagedRangeCheck ranges;
  int32_t label = -1;
  void* error_word = nullptr;      // device pointer of the word pair (may be null)
  void* flag = nullptr;            // 8 bytes of device scratch
  int64_t* fill_prefix = nullptr;  // page_fill bound: device scratch, int64 [B, max_pages + 1] (fill_prefix_bytes())
  // the memset + check + store path: device scratch right after the flag's 256 bytes, uint32 [num_pages * page_size],
  // the first token writing each page row (Note [Paged CUDA row owners]); PagedUpdateOwnerBytes() bytes
  unsigned int* owners = nullptr;
  // Note [PagedRotaryCacheUpdate]: key / value are qkv's k / v columns, keys rotated as they are loaded
  int64_t src_stride = 0;          // elements from one token's key row to the next's (0: kv_heads * head_size)
  const void* cos = nullptr;       // [rows, head_size / 2] of elem_type; nullptr: no rotary
  const void* sin = nullptr;
  int64_t rotary_rows = 0;         // the tables' rows: a row's position + T must not pass them (its row check)
  const void* q = nullptr;         // qkv (its q columns), rows src_stride apart
  void* q_out = nullptr;           // [B, T, heads * head_size], written by the store phase
  int64_t heads = 0;
  size_t fill_prefix_bytes() const {
    return p.page_fill ? static_cast<size_t>(B * (p.max_pages + 1)) * sizeof(int64_t) : 0;
  }
  ORTKV_HD int64_t rows() const { return B * T * 2 * p.shape.kv_heads; }  // host and device (the kernels' jobs)
  ORTKV_HD int64_t q_jobs() const { return q_out != nullptr ? B * T * heads : 0; }
};

struct PagedAttentionCudaView {
  PagedPool p;
  const void* q = nullptr;
  void* out = nullptr;
  int32_t elem_type = 0;
  const int64_t* start = nullptr;  // DEVICE memory
  int64_t start_stride = 0;
  int64_t B = 0, T = 0, Hq = 0, Hkv = 0, D = 0;
  float scale = 1.0f;
  int64_t splits = 1;              // planned; the v2 launch may trim it to one wave (Note [Paged CUDA v2])
  int sm_count = 0;
  bool vec = false;                // D % 8 == 0 and the query / output 16-byte aligned
  float* partial = nullptr;        // splits > 1: partial_bytes()
  void* flag = nullptr;            // 8 bytes of device scratch (the first kernel: cleared by a memset)
  unsigned long long* block_flags = nullptr;  // block_flag_bytes(): one first-failure key per block (v2, no memset)
  int64_t* fill_prefix = nullptr;  // page_fill bound: device scratch, int64 [B, max_pages + 1] (fill_prefix_bytes())
  unsigned long long* row_flags = nullptr;    // page_fill bound: [B] first bad fill per row (the prefix kernel)
  size_t fill_prefix_bytes() const {
    return p.page_fill ? static_cast<size_t>(B * (p.max_pages + 1)) * sizeof(int64_t) + static_cast<size_t>(B) * 8 : 0;
  }
  // the node's page_format attribute (-1: any): every page read has this format (Note [Paged CUDA uniform
  // 16-bit] in kernels/cuda/paged_cuda.cu)
  int32_t page_format = -1;
  // the node's static_tables attribute: the directory and page table are not written by the kernel before, so
  // what the kernels read of them before griddepcontrol.wait is final (Note [Paged CUDA static tables])
  bool static_tables = false;
  int32_t label = -1;
  void* error_word = nullptr;
  // Note [Paged CUDA last block reports] (kernels/cuda/paged_cuda.cu): the node's two device words on this stream
  // (PagedReportWords; arrivals 0 and the smallest failure key kNoError between launches), or nullptr: a node of
  // one split over several rows then reports through the combine's scan block (a second launch)
  unsigned long long* report_words = nullptr;
  int64_t units() const { return B * Hkv * T; }
  int64_t group() const { return Hq / Hkv; }
  size_t block_flag_bytes() const {
    const int64_t G = group(), gm = G <= 4 ? G : 8;
    return static_cast<size_t>(units() * ((G + gm - 1) / gm) * splits) * sizeof(unsigned long long);
  }
  size_t partial_bytes() const {
    return splits > 1 ? static_cast<size_t>(units() * group() * splits * (D + 2)) * sizeof(float) : 0;
  }
};

// Host plans: shapes, types and attributes only (the values are on the device).
// `page_fill`: the optional input (Note [Page fill]; its values are on the device), nullptr when absent.
Status PlanPagedCacheUpdateCuda(const std::string& node, const TensorArg& pool, const TensorArg& directory,
                                const TensorArg& page_table, const TensorArg& key, const TensorArg& value,
                                const TensorArg& position, const PagedAttrs& attrs, PagedUpdateCudaView* view,
                                const TensorArg* page_fill = nullptr,
                                const std::string* op_name = nullptr);  // nullptr: "PagedCacheUpdate"
Status PlanPagedCacheAttentionCuda(const std::string& node, const TensorArg& q, const TensorArg& pool,
                                   const TensorArg& directory, const TensorArg& page_table, const TensorArg& start,
                                   int64_t num_heads, const PagedAttrs& attrs, float scale, void* out, int sm_count,
                                   PagedAttentionCudaView* view, const TensorArg* page_fill = nullptr);

#if defined(ORTKV_WITH_CUDA)
// The bytes of view.owners this update needs (0: it takes the resolved kernel, Note [Paged CUDA resolved update]),
// a multiple of 256.
size_t PagedUpdateOwnerBytes(const PagedUpdateCudaView& view);
// memset(flag, owners) + check + store on `stream`. view.flag must be set when rows() > 0, view.owners when
// PagedUpdateOwnerBytes() > 0 (at view.flag + 256).
Status PagedCacheUpdateCuda(const PagedUpdateCudaView& view, void* stream);
// memset(flag) + attention + combine / report on `stream`.
Status PagedCacheAttentionCuda(const PagedAttentionCudaView& view, void* stream);

// Note [Paged CUDA last block reports]: a PagedCacheAttention node's report words, one pair per (device, stream),
// made at the node's first launch on that stream (cudaMalloc, then two memsets on the stream) and freed with the
// node. A pair cannot be made inside a CUDA graph capture: For then gives nullptr (ORT runs a session uncaptured
// before it captures, so a captured node has its pair).
class PagedReportWords {
 public:
  PagedReportWords() = default;
  PagedReportWords(const PagedReportWords&) = delete;
  PagedReportWords& operator=(const PagedReportWords&) = delete;
  ~PagedReportWords();
  Status For(void* stream, unsigned long long** words);

 private:
  struct Pair {
    int device;
    void* stream;
    unsigned long long* words;
  };
  std::mutex mu_;
  std::vector<Pair> pairs_;
};
#endif

}  // namespace ortkv
