// CUDA PagedCacheUpdate and PagedCacheAttention: Note [Paged CUDA] in ortkv/paged_cuda.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>

#include "cpu/paged_common.h"
#include "ortkv/cache_attention.h"
#include "ortkv/core.h"
#include "ortkv/paged_cuda.h"
#include "device_common.cuh"
#include "tile_mma.cuh"

namespace ortkv {

using codecs::PageFormat;

// The shape the v3 kernels run (Note [Paged CUDA v3]): aligned 16-bit queries, head size 64 or 128, pages of whole
// 16-key tiles, no page_fill. Its launch also needs the kernel choice and the per-block flags; the plan clusters the
// splits of such a node over one batch row (Note [Cluster split chunks] in cache_attention.h).
static bool PagedV3Shape(const PagedAttentionCudaView& v) {
  return v.vec && (v.D == 64 || v.D == 128) && v.p.shape.page_size % tile16::kTile == 0 &&
         (v.elem_type == kFloat16 || v.elem_type == kBFloat16) && v.p.page_fill == nullptr;
}

// ---- host plans -----------------------------------------------------------------------------------
// Note [Page fill] on CUDA: the input's type and shape (its values are on the device: FillPrefixKernel).
Status FillShape(const std::string& op, const std::string& node, const TensorArg* fill, const std::string& table_name,
                 int64_t B, PagedPool* p) {
  p->page_fill = nullptr;
  p->fill_prefix = nullptr;
  if (fill == nullptr) return Status::Ok();
  ORTKV_RETURN_IF_ERR(CheckPageFillShape(op, node, *fill, table_name, B, p->max_pages));
  p->page_fill = static_cast<const int32_t*>(fill->data);
  return Status::Ok();
}

Status PlanPagedCacheUpdateCuda(const std::string& node, const TensorArg& pool, const TensorArg& directory,
                                const TensorArg& page_table, const TensorArg& key, const TensorArg& value,
                                const TensorArg& position, const PagedAttrs& attrs, PagedUpdateCudaView* view,
                                const TensorArg* page_fill, const std::string* op_name) {
  static const std::string kOp = "PagedCacheUpdate";  // once: no allocation per run
  const std::string& op = op_name != nullptr ? *op_name : kOp;
  std::ostringstream m;
  const auto logical = [](int32_t t) { return t == kFloat32 || t == kFloat16 || t == kBFloat16; };
  if (!logical(key.elem_type) || key.elem_type != value.elem_type) {
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
  ORTKV_RETURN_IF_ERR(
      paged::ResolvePool(op, node, pool, directory, page_table, attrs, B, W / attrs.kv_num_heads, &view->p));
  if (position.elem_type != kInt64 || position.dims.size() > 1 || (position.dims.size() == 1 && position.dims[0] != B)) {
    m << "position '" << position.name << "' must be an int64 scalar or a vector of " << B << " positions";
    return paged::Bad(op, node, m.str());
  }
  if (view->p.max_pages < 1 && B * T > 0) {
    m << "page table '" << page_table.name << "' has no columns: " << T << " tokens per row cannot be placed";
    return Status(Code::kCapacity, op + " node '" + node + "': " + m.str());
  }
  ORTKV_RETURN_IF_ERR(FillShape(op, node, page_fill, page_table.name, B, &view->p));
  view->key = key.data;
  view->value = value.data;
  view->elem_type = key.elem_type;
  view->positions = static_cast<const int64_t*>(position.data);
  view->position_stride = position.dims.size() == 1 ? 1 : 0;
  view->B = B;
  view->T = T;
  return Status::Ok();
}

Status PlanPagedCacheAttentionCuda(const std::string& node, const TensorArg& q, const TensorArg& pool,
                                   const TensorArg& directory, const TensorArg& page_table, const TensorArg& start,
                                   int64_t num_heads, const PagedAttrs& attrs, float scale, void* out, int sm_count,
                                   PagedAttentionCudaView* view, const TensorArg* page_fill) {
  static const std::string op = "PagedCacheAttention";  // once: no allocation per run
  std::ostringstream m;
  if (q.elem_type != kFloat32 && q.elem_type != kFloat16 && q.elem_type != kBFloat16) {
    m << "query '" << q.name << "' must be float32, float16 or bfloat16 (got " << ElemTypeName(q.elem_type) << ")";
    return paged::Bad(op, node, m.str());
  }
  if (q.dims.size() != 3) {
    m << "query '" << q.name << "' must be [batch, tokens, num_heads * head_size]; got rank " << q.dims.size();
    return paged::Bad(op, node, m.str());
  }
  const int64_t kv = attrs.kv_num_heads;
  if (num_heads <= 0 || kv <= 0 || num_heads % kv != 0 || num_heads / kv > 64) {
    m << "num_heads " << num_heads << " must be a positive multiple of kv_num_heads " << kv
      << " (at most 64 query heads per KV head)";
    return paged::Bad(op, node, m.str());
  }
  const int64_t B = q.dims[0], T = q.dims[1], W = q.dims[2];
  if (W <= 0 || W % num_heads != 0) {
    m << "query '" << q.name << "' width " << W << " must be num_heads (" << num_heads << ") * head_size";
    return paged::Bad(op, node, m.str());
  }
  const int64_t D = W / num_heads;
  if (D > kAttnCudaMaxHeadSize) {
    m << "head size " << D << " exceeds the CUDA kernel's " << kAttnCudaMaxHeadSize
      << "; run this node on the CPU provider";
    return paged::Bad(op, node, m.str());
  }
  ORTKV_RETURN_IF_ERR(paged::ResolvePool(op, node, pool, directory, page_table, attrs, B, D, &view->p));
  if (start.elem_type != kInt64 || start.dims.size() > 1 || (start.dims.size() == 1 && start.dims[0] != B)) {
    m << "start '" << start.name << "' must be an int64 scalar or a vector of " << B << " start positions";
    return paged::Bad(op, node, m.str());
  }
  ORTKV_RETURN_IF_ERR(FillShape(op, node, page_fill, page_table.name, B, &view->p));
  const int64_t cap = view->p.max_pages * attrs.page_size;
  if (T > cap && B > 0) {
    m << op << " node '" << node << "': " << T << " query tokens exceed the page table's capacity of "
      << view->p.max_pages << " pages x " << attrs.page_size << " tokens = " << cap << " ('" << page_table.name
      << "'). Remedy: widen the page table";
    return Status(Code::kCapacity, m.str());
  }
  view->q = q.data;
  view->out = out;
  view->elem_type = q.elem_type;
  view->start = static_cast<const int64_t*>(start.data);
  view->start_stride = start.dims.size() == 1 ? 1 : 0;
  view->B = B;
  view->T = T;
  view->Hq = num_heads;
  view->Hkv = kv;
  view->D = D;
  view->scale = scale > 0 ? scale : 1.0f / std::sqrt(static_cast<float>(D));
  view->sm_count = sm_count;
  view->page_format = attrs.page_format;  // checked per page on the device (Note [Paged CUDA uniform 16-bit])
  view->static_tables = attrs.static_tables;  // Note [Paged CUDA static tables]
  const uintptr_t align = reinterpret_cast<uintptr_t>(q.data) | reinterpret_cast<uintptr_t>(out);
  view->vec = D % 8 == 0 && align % 16 == 0;
  // Note [CacheAttention CUDA]: ~4 blocks per SM, splits from the CAPACITY (start is on the device)
  const int64_t head_blocks = (view->group() + kAttnCudaHeads - 1) / kAttnCudaHeads;
  const int64_t blocks = view->units() * head_blocks;
  view->splits = AttnCudaSplits(cap, blocks, sm_count, B == 1 && PagedV3Shape(*view));  // Note [Cluster split chunks]
  return Status::Ok();
}

namespace {

constexpr unsigned long long kNoError = ~0ull;
// flag keys: class << 60 | detail; the smallest key is the first failure in the CPU plan's order
constexpr unsigned long long kClassRow = 0, kClassShared = 1, kClassEncode = 2, kClassRange = 3;
__device__ __forceinline__ unsigned long long Key(unsigned long long cls, unsigned long long detail) {
  return (cls << 60) | (detail & ((1ull << 60) - 1));
}

// ---- pages on the device ----------------------------------------------------------------------------
// PageProblem with page id's directory row (f, off) already read (read only where 0 <= id < num_pages).
__device__ __forceinline__ int PageProblemAt(const PagedPool& p, int64_t id, int64_t f, int64_t off, bool write) {
  if (id < 0) return kPageNone;
  if (id >= p.num_pages) return kPageOutside;
  if (f < 0 || f >= codecs::kNumPageFormats) return kPageBadFormat;
  const PageFormat fmt = static_cast<PageFormat>(f);
  if (p.shape.head_size % codecs::HeadSizeMultiple(fmt) != 0) return kPageHeadSize;
  const uint64_t slot = static_cast<uint64_t>(p.num_layers) * p.layouts[f].page_bytes;
  if (off < 0 || off % 16 != 0 || static_cast<uint64_t>(off) > p.pool_bytes ||
      slot > p.pool_bytes - static_cast<uint64_t>(off))
    return kPageBadSlot;
  if (write && codecs::KeysPerChannel(fmt)) return kPageKeysPerChannel;
  return kPageOk;
}
// Page id's directory row (f, off), read only where 0 <= id < num_pages; (-1, 0) elsewhere (PageProblemAt's form).
struct DirRow {
  int64_t f, off;
};
__device__ __forceinline__ DirRow DirectoryRow(const PagedPool& p, int64_t id) {
  const bool in = id >= 0 && id < p.num_pages;
  return {in ? p.directory[2 * id] : -1, in ? p.directory[2 * id + 1] : 0};
}
__device__ __forceinline__ int PageProblem(const PagedPool& p, int64_t id, bool write) {
  const DirRow r = DirectoryRow(p, id);
  return PageProblemAt(p, id, r.f, r.off, write);
}

__device__ __forceinline__ int64_t TableAt(const PagedPool& p, int64_t b, int64_t pi) {
  return p.page_table[b * p.max_pages + pi];
}

// Note [Page fill] on CUDA: the rows entry e of row b holds (page_size without page_fill), the row's
// capacity (its total fill), and the entry and row of logical position t < RowTotal (a binary search
// over the device prefix sums, as PagedPool::Locate on the host).
__device__ __forceinline__ int64_t EntryFill(const PagedPool& p, int64_t b, int64_t e) {
  return p.page_fill == nullptr ? p.shape.page_size : p.page_fill[b * p.max_pages + e];
}
__device__ __forceinline__ int64_t RowTotal(const PagedPool& p, int64_t b) {
  return p.fill_prefix == nullptr ? p.max_pages * p.shape.page_size : p.fill_prefix[b * (p.max_pages + 1) + p.max_pages];
}
__device__ __forceinline__ int64_t EntryOf(const PagedPool& p, int64_t b, int64_t t, int64_t* row) {
  if (p.fill_prefix == nullptr) {
    *row = t % p.shape.page_size;
    return t / p.shape.page_size;
  }
  const int64_t* pre = p.fill_prefix + b * (p.max_pages + 1);
  int64_t lo = 0, hi = p.max_pages;  // pre[lo] <= t < pre[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (pre[mid] <= t) lo = mid; else hi = mid;
  }
  *row = t - pre[lo];
  return lo;
}
// A fill outside [0, page_size] (counted as 0 by FillPrefixKernel), else the entry's page problem.
__device__ __forceinline__ int EntryProblem(const PagedPool& p, int64_t b, int64_t e, bool write) {
  const int64_t f = EntryFill(p, b, e);
  if (f < 0 || f > p.shape.page_size) return kPageBadFill;
  return PageProblem(p, TableAt(p, b, e), write);
}

// The layer's page bytes of a validated page id.
__device__ __forceinline__ uint8_t* LayerBaseAt(const PagedPool& p, int64_t f, int64_t off) {
  return p.pool + off + static_cast<uint64_t>(p.layer) * p.layouts[f].page_bytes;
}
__device__ __forceinline__ uint8_t* LayerBase(const PagedPool& p, int64_t id, int* fmt) {
  const int f = static_cast<int>(p.directory[2 * id]);
  *fmt = f;
  return LayerBaseAt(p, f, p.directory[2 * id + 1]);
}

__device__ __forceinline__ float LoadLogical(int32_t elem, const void* base, int64_t i) {
  if (elem == kFloat32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  return elem == kFloat16 ? codecs::F16BitsToF32(h) : codecs::BF16BitsToF32(h);
}

__device__ void WriteReport(ortkv_device_error* err, int32_t label, int code, int64_t row, int64_t position, int64_t n,
                            int64_t capacity, uint64_t hit, uint64_t first, uint64_t last) {
  if (err == nullptr) return;
  err->label = label;
  err->row = static_cast<int32_t>(row);
  err->position = position;
  err->n = n;
  err->capacity = capacity;
  err->hit_addr = hit;
  err->first = first;
  err->last = last;
  __threadfence_system();
  *reinterpret_cast<volatile int32_t*>(&err->code) = code;
}

__device__ __forceinline__ uint64_t PageDetail(const PagedPool& p, int64_t id, int problem);

// The ORTKV_DERR_PAGE detail of entry e of row b: a bad fill carries its value in the offset field.
__device__ __forceinline__ uint64_t EntryDetail(const PagedPool& p, int64_t b, int64_t e, bool write) {
  const int problem = EntryProblem(p, b, e, write);
  if (problem == kPageBadFill)
    return static_cast<uint64_t>(problem) |
           (static_cast<uint64_t>(static_cast<uint32_t>(p.page_fill[b * p.max_pages + e])) << 16);
  return PageDetail(p, TableAt(p, b, e), problem);
}

__device__ __forceinline__ uint64_t PageDetail(const PagedPool& p, int64_t id, int problem) {
  uint64_t f = 0, off = 0;
  if (id >= 0 && id < p.num_pages) {
    f = static_cast<uint64_t>(p.directory[2 * id]) & 0xFFu;
    off = static_cast<uint64_t>(p.directory[2 * id + 1]) & ((1ull << 48) - 1);
  }
  return static_cast<uint64_t>(problem) | (f << 8) | (off << 16);
}

// Note [Page fill] on CUDA: one block per row: the exclusive prefix sums of the row's fills into
// prefix[b, 0 .. max_pages] (a fill outside [0, page_size] counts as 0, so the sums stay monotone, and
// its entry is the row's failure key: atomicMin into `flag` when given, and row_flags[b] = the key or
// kNoError when given).
constexpr int kFillThreads = 128;
__global__ void __launch_bounds__(kFillThreads) FillPrefixKernel(const PagedPool p, int64_t* prefix,
                                                                   unsigned long long* flag,
                                                                   unsigned long long* row_flags) {
  __shared__ int64_t s_sum[kFillThreads];
  __shared__ unsigned long long s_bad;
  const int64_t b = blockIdx.x, M = p.max_pages, ps = p.shape.page_size;
  const int32_t* fill = p.page_fill + b * M;
  int64_t* pre = prefix + b * (M + 1);
  const int tid = threadIdx.x;
  const int64_t seg = (M + kFillThreads - 1) / kFillThreads;
  const int64_t e0 = tid * seg < M ? tid * seg : M, e1 = e0 + seg < M ? e0 + seg : M;
  if (tid == 0) s_bad = kNoError;
  __syncthreads();
  int64_t sum = 0;
  for (int64_t e = e0; e < e1; ++e) {
    const int32_t v = fill[e];
    if (v < 0 || v > ps) {
      atomicMin(&s_bad, Key(kClassRow, (static_cast<unsigned long long>(b) << 28) | static_cast<unsigned long long>(e + 1)));
    } else {
      sum += v;
    }
  }
  s_sum[tid] = sum;
  __syncthreads();
  if (tid == 0) {
    int64_t run = 0;
    for (int i = 0; i < kFillThreads; ++i) {
      const int64_t x = s_sum[i];
      s_sum[i] = run;
      run += x;
    }
    pre[0] = 0;
  }
  __syncthreads();
  int64_t run = s_sum[tid];
  for (int64_t e = e0; e < e1; ++e) {
    const int32_t v = fill[e];
    run += (v < 0 || v > ps) ? 0 : v;
    pre[e + 1] = run;
  }
  if (tid == 0) {
    if (flag != nullptr && s_bad != kNoError) atomicMin(flag, s_bad);
    if (row_flags != nullptr) row_flags[b] = s_bad;
  }
}

// ---- PagedCacheUpdate --------------------------------------------------------------------------------
struct UpdateArgs {
  PagedUpdateCudaView v;
};

__device__ __forceinline__ int64_t Pos(const PagedUpdateCudaView& v, int64_t b) {
  return v.positions[b * v.position_stride];
}
// The row's position: not negative, its T tokens within the row's capacity and (PagedRotaryCacheUpdate) within the
// rotary tables' rows (Note [PagedRotaryCacheUpdate]); a failure is the row's sub-key 0, ReportUpdate says which.
__device__ __forceinline__ bool PosOk(const PagedUpdateCudaView& v, int64_t b, int64_t pos) {
  return pos >= 0 && pos <= RowTotal(v.p, b) - v.T && (v.cos == nullptr || pos + v.T <= v.rotary_rows);
}

// The (valid) page id of unit u's token, or -1 when its row or page is bad (reported by the row check).
// (Note [Page fill]: *prow is the token's row in that page.)
__device__ __forceinline__ int64_t UnitPage(const PagedUpdateCudaView& v, int64_t u, int64_t* tok, int64_t* prow) {
  const int64_t b = u / v.T, t = u % v.T, pos = Pos(v, b);
  if (!PosOk(v, b, pos)) return -1;
  *tok = pos + t;
  const int64_t e = EntryOf(v.p, b, *tok, prow);
  if (EntryProblem(v.p, b, e, true) != kPageOk) return -1;
  return TableAt(v.p, b, e);
}

// One source row of the update: the key or value of (token u, head h); a key of PagedRotaryCacheUpdate is rotated
// as it is loaded, in the form of Note [PagedRotaryCacheUpdate], and rounded to the source's type.
struct RowSrc {
  const void* p;     // the row's element 0
  int32_t et;
  const void* cos;   // nullptr: no rotary
  const void* sin;
  int64_t crow;      // the position's first element in the tables
  __device__ __forceinline__ float operator()(int64_t c) const {
    if (cos == nullptr) return LoadLogical(et, p, c);
    const int64_t i = c >> 1;
    const float x0 = LoadLogical(et, p, 2 * i), x1 = LoadLogical(et, p, 2 * i + 1);
    const float cs = LoadLogical(et, cos, crow + i), sn = LoadLogical(et, sin, crow + i);
    const float y = (c & 1) ? __fmaf_rn(x0, sn, __fmul_rn(x1, cs)) : __fmaf_rn(x0, cs, -__fmul_rn(x1, sn));
    if (et == kFloat16) return __half2float(__float2half_rn(y));
    if (et == kBFloat16) return __bfloat162float(__float2bfloat16_rn(y));
    return y;
  }
};
__device__ __forceinline__ int64_t SrcStride(const PagedUpdateCudaView& v) {
  return v.src_stride != 0 ? v.src_stride : v.p.shape.kv_heads * v.p.shape.head_size;
}
// Head h of token u from `base` (qkv's q, k or v columns, or the key / value), rotated at position tok when `rot`.
__device__ __forceinline__ RowSrc RowAt(const PagedUpdateCudaView& v, const void* base, int64_t u, int64_t h, bool rot,
                                        int64_t tok) {
  const int64_t first = u * SrcStride(v) + h * v.p.shape.head_size;
  const size_t es = v.elem_type == kFloat32 ? 4 : 2;
  return RowSrc{static_cast<const uint8_t*>(base) + first * es, v.elem_type, rot ? v.cos : nullptr, v.sin,
                tok * (v.p.shape.head_size / 2)};
}
// kv 0: the key (rotated when the node has tables), 1: the value; tok: the token's position.
__device__ __forceinline__ RowSrc SourceRow(const PagedUpdateCudaView& v, int64_t kv, int64_t u, int64_t h, int64_t tok) {
  return RowAt(v, kv ? v.value : v.key, u, h, kv == 0 && v.cos != nullptr, tok);
}

// RowScales (codecs.h) of a row of finite values whose least, greatest and largest magnitude are lo, hi and amax in
// format f (a scaled row format): kOk with the scales in sc (scale, and the minimum for the asymmetric formats), or
// kScaleOverflow.
// codecs::F16Ceil / F16Floor (float16 round-to-nearest, then a step toward v) are the directed roundings that the
// conversion instructions do in one: the same bits for every float (+-0 and the overflow to +-inf or +-65504 alike).
__device__ __forceinline__ uint16_t F16CeilDev(float v) { return __half_as_ushort(__float2half_ru(v)); }
__device__ __forceinline__ uint16_t F16FloorDev(float v) { return __half_as_ushort(__float2half_rd(v)); }
__device__ __forceinline__ codecs::RowResult ScalesOf(PageFormat f, float lo, float hi, float amax, uint16_t* sc) {
  if (codecs::ScalesPerRow(f) == 1) {
    sc[0] = F16CeilDev(__fdiv_rn(amax, codecs::QMax(f)));
    return codecs::F16IsFinite(sc[0]) ? codecs::RowResult::kOk : codecs::RowResult::kScaleOverflow;
  }
  sc[1] = F16FloorDev(lo);
  if (!codecs::F16IsFinite(sc[1])) return codecs::RowResult::kScaleOverflow;
  const float range = __fsub_rn(hi, __half2float(__ushort_as_half(sc[1])));
  if (!(range - range == 0.0f)) return codecs::RowResult::kScaleOverflow;
  sc[0] = F16CeilDev(__fdiv_rn(range, codecs::QMax(f)));
  return codecs::F16IsFinite(sc[0]) ? codecs::RowResult::kOk : codecs::RowResult::kScaleOverflow;
}
// Whether RowScales encodes such a row: kOk or kScaleOverflow.
__device__ __forceinline__ codecs::RowResult ScalesFit(PageFormat f, float lo, float hi, float amax) {
  uint16_t sc[2];
  return ScalesOf(f, lo, hi, amax, sc);
}

// RowScales (codecs.h) over a row of the source, loaded element by element (one thread).
__device__ __forceinline__ codecs::RowResult SourceRowScales(PageFormat f, const RowSrc& src, int32_t n) {
  float lo = 0.0f, hi = 0.0f, amax = 0.0f;
  for (int32_t c = 0; c < n; ++c) {
    const float x = src(c);
    if (!(x - x == 0.0f)) return codecs::RowResult::kNonFinite;
    if (c == 0) lo = hi = x;
    lo = x < lo ? x : lo;
    hi = x > hi ? x : hi;
    const float a = x < 0.0f ? -x : x;
    amax = a > amax ? a : amax;
  }
  return ScalesFit(f, lo, hi, amax);
}

// The same result from a whole warp, lanes over the row's elements (all lanes call it; lane 0's result counts): one
// round of loads where the thread's loop above waits for each element's (~1 us a row of 64 on the H200, and the
// resolved update's check ran a row a thread: 35 us a layer with INT8 / INT4 pages against 6 us with F16).
__device__ __forceinline__ codecs::RowResult SourceRowScalesWarp(PageFormat f, const RowSrc& src, int32_t n, int lane) {
  float lo = INFINITY, hi = -INFINITY, amax = 0.0f;
  bool bad = false;
  for (int32_t c = lane; c < n; c += 32) {
    const float x = src(c);
    bad |= !(x - x == 0.0f);
    lo = fminf(lo, x);
    hi = fmaxf(hi, x);
    amax = fmaxf(amax, fabsf(x));
  }
  if (__any_sync(0xffffffffu, bad)) return codecs::RowResult::kNonFinite;
  for (int off = 16; off > 0; off >>= 1) {  // finite values: min / max are exact in any order
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, off));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, off));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  }
  return ScalesFit(f, lo, hi, amax);
}

__device__ __forceinline__ int RangeHit(const PagedRangeCheck& r, uint64_t first, uint64_t last) {
  for (int i = 0; i < r.count; ++i)
    if (first < r.hi[i] && r.lo[i] < last) return i + 1;
  return 0;
}

// Row b's checks: its position, then every page its T tokens touch (the first failure kept in *flag, global or
// shared memory, with atomicMin).
__device__ __forceinline__ void CheckUpdateRow(const PagedUpdateCudaView& v, int64_t b, unsigned long long* flag) {
  const int64_t pos = Pos(v, b);
  if (!PosOk(v, b, pos)) {
    atomicMin(flag, Key(kClassRow, static_cast<unsigned long long>(b) << 28));
    return;
  }
  int64_t r0 = 0, r1 = 0;
  const int64_t e_first = EntryOf(v.p, b, pos, &r0), e_last = EntryOf(v.p, b, pos + v.T - 1, &r1);
  for (int64_t pi = e_first; pi <= e_last; ++pi) {
    if (EntryFill(v.p, b, pi) == 0) continue;  // skipped by the mapping (Note [Page fill])
    if (EntryProblem(v.p, b, pi, true) != kPageOk) {
      atomicMin(flag, Key(kClassRow, (static_cast<unsigned long long>(b) << 28) | static_cast<unsigned long long>(pi + 1)));
      return;
    }
  }
}

// Warp reductions with the CPU's tie order (the first channel wins a tie: -0.0 vs 0.0 as RowScales).
__device__ __forceinline__ void ReduceMin(float* v, int* idx) {
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, *v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, *idx, off);
    if (ov < *v || (ov == *v && oi < *idx)) {
      *v = ov;
      *idx = oi;
    }
  }
}
__device__ __forceinline__ void ReduceMax(float* v, int* idx) {
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, *v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, *idx, off);
    if (ov > *v || (ov == *v && oi < *idx)) {
      *v = ov;
      *idx = oi;
    }
  }
}

// A row's least and greatest element with RowScales' tie order (the first wins: -0.0 vs 0.0) and its largest
// magnitude, over a warp: each lane adds its elements (channel c) in increasing order, Reduce combines the lanes
// (every lane then holds the row's).
struct WarpRowStats {
  float lo = INFINITY, hi = -INFINITY, amax = 0.0f;
  int ilo = 0x7fffffff, ihi = 0x7fffffff;
  __device__ __forceinline__ void Add(float x, int c) {
    if (x < lo || ilo == 0x7fffffff) {
      lo = x;
      ilo = c;
    }
    if (x > hi || ihi == 0x7fffffff) {
      hi = x;
      ihi = c;
    }
    amax = fmaxf(amax, fabsf(x));
  }
  __device__ __forceinline__ void Reduce() {
    ReduceMin(&lo, &ilo);
    ReduceMax(&hi, &ihi);
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  }
};

constexpr int kPreloadPerLane = 4;  // head size <= 128 (Note [Resolved update preload])

// RowScales (codecs.h) of a row of D values held by a warp, lane l's pre[k] = element l + 32 k (all lanes call it;
// the result is every lane's): min and max with RowScales' tie order (the first element wins, -0.0 vs 0.0), so that
// the scales written are the CPU's; on kOk sc holds them (ScalesOf).
__device__ __forceinline__ codecs::RowResult PreloadedRowScales(PageFormat f, const float* pre, int64_t D, int lane,
                                                                uint16_t* sc) {
  WarpRowStats r;
  bool bad = false;
#pragma unroll
  for (int k = 0; k < kPreloadPerLane; ++k) {
    const int c = lane + 32 * k;
    if (c >= D) continue;
    bad |= !(pre[k] - pre[k] == 0.0f);
    r.Add(pre[k], c);
  }
  if (__any_sync(0xffffffffu, bad)) return codecs::RowResult::kNonFinite;
  r.Reduce();
  return ScalesOf(f, r.lo, r.hi, r.amax, sc);
}

// Row job i's checks once its token u has a valid page `id` (row prow, layer bytes `base`, directory format fmt,
// position tok): a (page, row) written twice (repeats(): a unit w < u writes the same page row), a write-protected
// or uncommitted page, a row its page's format cannot encode; by a whole warp (Note [Resolved update check]), every
// lane with the same job: lane 0 the repeat and range checks, every lane the encode check.
// (pre: when not null, the row's values held by the warp's lanes, Note [Resolved update preload]; the row's scales,
// when it has some and they fit, are then left in sc, which must be given with pre.)
template <typename Repeats>
__device__ __forceinline__ void CheckJobWarp(const PagedUpdateCudaView& v, int64_t i, int64_t u, const uint8_t* base,
                                             int fmt, int64_t tok, int lane, unsigned long long* flag,
                                             const Repeats& repeats, const float* pre = nullptr,
                                             uint16_t* sc = nullptr) {
  const int64_t Hkv = v.p.shape.kv_heads;
  const int64_t h = i % Hkv, kv = (i / Hkv) % 2;
  if (lane == 0 && kv == 0 && h == 0) {
    if (repeats()) atomicMin(flag, Key(kClassShared, static_cast<unsigned long long>(u)));
    if (v.ranges.count > 0) {
      const uint64_t first = reinterpret_cast<uint64_t>(base);
      if (RangeHit(v.ranges, first, first + v.p.layouts[fmt].page_bytes))
        atomicMin(flag, Key(kClassRange, static_cast<unsigned long long>(u)));
    }
  }
  const PageFormat f = static_cast<PageFormat>(fmt);
  if (codecs::ScalesPerRow(f) == 0) return;  // warp-uniform
  const codecs::RowResult r =
      pre != nullptr ? PreloadedRowScales(codecs::RowFormat(f), pre, v.p.shape.head_size, lane, sc)
                     : SourceRowScalesWarp(codecs::RowFormat(f), SourceRow(v, kv, u, h, tok),
                                           static_cast<int32_t>(v.p.shape.head_size), lane);
  if (lane == 0 && r != codecs::RowResult::kOk) atomicMin(flag, Key(kClassEncode, static_cast<unsigned long long>(i)));
}

// Note [Paged CUDA row owners]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A page row written by two tokens of one update (two rows sharing a page, or a table listing a page twice) is
// refused, naming the first later token that repeats an earlier one (the CPU plan's order). The check kernel used
// to compare each token with every earlier one, walking the earlier token's chain each time: O(tokens^2) chains,
// 44 ms a layer for a prefill of 8 rows x 4,000 tokens on the H200 (1.3 s for SmolLM2's 30 layers). The memset +
// check + store path now takes an owner per page row in device scratch (uint32 [num_pages * page_size], set to
// 0xFF.. by the flag's memset): a claim kernel, one thread per token, atomicMin's its token index into its page
// row's owner, and the check kernel's token u repeats an earlier one iff its row's owner is not u. The report reads
// the first writer from it too. The resolved kernel (Note [Paged CUDA resolved update], <= 256 tokens) compares its
// shared-memory slots instead.
__global__ void PagedUpdateClaimKernel(const UpdateArgs args) {
  const PagedUpdateCudaView& v = args.v;
  const int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (u >= v.B * v.T) return;
  int64_t tok = 0, prow = 0;
  const int64_t id = UnitPage(v, u, &tok, &prow);
  if (id >= 0) atomicMin(&v.owners[id * v.p.shape.page_size + prow], static_cast<unsigned int>(u));
}

// Row job i = ((b * T + t) * 2 + kv) * Hkv + h: every check of Note [PagedCacheUpdate validation], the first
// failure kept in *flag with atomicMin; the chain position -> table entry -> directory row walked per job, the
// page row's owner read (Note [Paged CUDA row owners]).
__device__ void CheckUpdateJob(const PagedUpdateCudaView& v, int64_t i, int lane, unsigned long long* flag) {
  const int64_t Hkv = v.p.shape.kv_heads;
  const int64_t h = i % Hkv, kv = (i / Hkv) % 2, u = i / (2 * Hkv);
  if (lane == 0 && u % v.T == 0 && kv == 0 && h == 0) CheckUpdateRow(v, u / v.T, flag);
  int64_t tok = 0, prow = 0;
  const int64_t id = UnitPage(v, u, &tok, &prow);
  if (id < 0) return;  // warp-uniform
  int fmt = 0;
  const uint8_t* base = LayerBase(v.p, id, &fmt);
  CheckJobWarp(v, i, u, base, fmt, tok, lane, flag,
               [&]() { return v.owners[id * v.p.shape.page_size + prow] != static_cast<unsigned int>(u); });
}

// One warp per row job (Note [Resolved update check]).
__global__ void PagedUpdateCheckKernel(const UpdateArgs args) {
  const PagedUpdateCudaView& v = args.v;
  const int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5;
  if (i < v.rows()) CheckUpdateJob(v, i, threadIdx.x & 31, static_cast<unsigned long long*>(v.flag));
}

// Block 0's thread 0 of the store kernel, when the flag holds a failure: the report.
__device__ void ReportUpdate(const PagedUpdateCudaView& v, unsigned long long key) {
  ortkv_device_error* err = static_cast<ortkv_device_error*>(v.error_word);  // [0]: the update word
  const int64_t Hkv = v.p.shape.kv_heads;
  const unsigned long long cls = key >> 60, detail = key & ((1ull << 60) - 1);
  const bool fill = v.p.page_fill != nullptr;
  if (cls == kClassRow) {
    const int64_t b = static_cast<int64_t>(detail >> 28), sub = static_cast<int64_t>(detail & ((1ull << 28) - 1));
    const int64_t pos = Pos(v, b), cap = RowTotal(v.p, b);
    if (sub == 0) {
      const bool rotary = pos >= 0 && pos <= cap - v.T;  // the position fits the row: the rotary tables' bound failed
      WriteReport(err, v.label, pos < 0 ? ORTKV_DERR_NEGATIVE : ORTKV_DERR_CAPACITY, b, pos, v.T,
                  rotary ? v.rotary_rows : cap, 0, rotary ? 2 : fill ? 1 : 0, 0);
      return;
    }
    const int64_t pi = sub - 1, id = TableAt(v.p, b, pi);
    WriteReport(err, v.label, ORTKV_DERR_PAGE, b, pos, v.T, cap, static_cast<uint64_t>(pi), static_cast<uint64_t>(id),
                EntryDetail(v.p, b, pi, true));
    return;
  }
  const int64_t cap = RowTotal(v.p, 0);  // the remaining reports do not print it
  if (cls == kClassShared) {
    const int64_t u = static_cast<int64_t>(detail);
    int64_t tok = 0, prow = 0;
    const int64_t id = UnitPage(v, u, &tok, &prow);
    int64_t first_row = 0;
    if (v.owners != nullptr) {  // the page row's first writer (Note [Paged CUDA row owners])
      first_row = static_cast<int64_t>(v.owners[id * v.p.shape.page_size + prow]) / v.T;
    } else {
      for (int64_t w = 0; w < u; ++w) {
        int64_t tw = 0, rw = 0;
        if (UnitPage(v, w, &tw, &rw) == id && rw == prow) {
          first_row = w / v.T;
          break;
        }
      }
    }
    WriteReport(err, v.label, ORTKV_DERR_SHARED_ROW, u / v.T, tok, v.T, cap, static_cast<uint64_t>(first_row),
                static_cast<uint64_t>(id), static_cast<uint64_t>(prow));
    return;
  }
  if (cls == kClassEncode) {
    const int64_t i = static_cast<int64_t>(detail);
    const int64_t h = i % Hkv, kv = (i / Hkv) % 2, u = i / (2 * Hkv);
    int64_t tok = 0, prow = 0;
    const int64_t id = UnitPage(v, u, &tok, &prow);
    const PageFormat f = static_cast<PageFormat>(v.p.directory[2 * id]);
    const codecs::RowResult r = SourceRowScales(codecs::RowFormat(f), SourceRow(v, kv, u, h, tok),
                                                static_cast<int32_t>(v.p.shape.head_size));
    WriteReport(err, v.label, ORTKV_DERR_ENCODE, u / v.T, tok, v.T, cap, static_cast<uint64_t>(h),
                static_cast<uint64_t>(id),
                static_cast<uint64_t>(r) | (static_cast<uint64_t>(kv) << 8) | (static_cast<uint64_t>(f) << 16));
    return;
  }
  const int64_t u = static_cast<int64_t>(detail);
  int64_t tok = 0, prow = 0;
  const int64_t id = UnitPage(v, u, &tok, &prow);
  int f = 0;
  const uint64_t first = reinterpret_cast<uint64_t>(LayerBase(v.p, id, &f));
  const uint64_t last = first + v.p.layouts[f].page_bytes;
  const int hit = RangeHit(v.ranges, first, last);
  const int code = hit && v.ranges.kind[hit - 1] == ORTKV_RANGE_UNCOMMITTED ? ORTKV_DERR_UNCOMMITTED : ORTKV_DERR_READONLY;
  WriteReport(err, v.label, code, u / v.T, tok, v.T, cap, hit ? v.ranges.lo[hit - 1] : 0, first, last);
}

constexpr int kStoreWarps = 4;

// The code of x in scaled row format f (a RowFormat) with scale s and minimum mn, codecs::EncodeRow's arithmetic:
// the INT8 or E4M3 byte, or the INT4 / INT2 level (not yet shifted to its place in the byte).
__device__ __forceinline__ uint32_t ScaledCode(PageFormat f, float x, float s, float mn) {
  if (f == PageFormat::kFp8E4M3) return s > 0.0f ? codecs::F32ToE4M3(__fdiv_rn(x, s)) : 0u;
  if (f == PageFormat::kInt8) {
    float q = s > 0.0f ? rintf(__fdiv_rn(x, s)) : 0.0f;
    q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
    return static_cast<uint8_t>(static_cast<int8_t>(q));
  }
  const float qmax = codecs::QMax(f);
  float q = s > 0.0f ? rintf(__fdiv_rn(__fsub_rn(x, mn), s)) : 0.0f;
  q = q > qmax ? qmax : (q < 0.0f ? 0.0f : q);
  return static_cast<uint32_t>(q);
}

// One warp, row job i (the check's index), every check passed: codecs::EncodeRow's arithmetic, lanes over the
// payload bytes.
// (base: the page's layer bytes, fi its directory format, prow / tok the token's page row and position).
__device__ __forceinline__ void StoreUpdateJobAt(const PagedUpdateCudaView& v, int64_t i, int lane, uint8_t* base, int fi,
                                 int64_t prow, int64_t tok) {
  const int64_t Hkv = v.p.shape.kv_heads, ps = v.p.shape.page_size;
  const int32_t D = v.p.shape.head_size;
  const int64_t h = i % Hkv, kv = (i / Hkv) % 2, u = i / (2 * Hkv);
  const PageFormat f = codecs::RowFormat(static_cast<PageFormat>(fi));
  const codecs::PageLayout& lay = v.p.layouts[fi];
  const uint64_t row = static_cast<uint64_t>(h) * ps + static_cast<uint64_t>(prow);
  uint8_t* payload = base + (kv ? lay.v_payload : lay.k_payload) + row * lay.row_bytes;
  uint16_t* scales = reinterpret_cast<uint16_t*>(base + (kv ? lay.v_scales : lay.k_scales) + row * lay.scale_row_bytes);
  const RowSrc src = SourceRow(v, kv, u, h, tok);
  // scales (the check proved them finite); none for the 16-bit formats (warp-uniform)
  const int ns = codecs::ScalesPerRow(f);
  uint16_t sc[2] = {0, 0};
  if (ns > 0) {
    WarpRowStats r;
    for (int c = lane; c < D; c += 32) r.Add(src(c), c);
    r.Reduce();
    ScalesOf(f, r.lo, r.hi, r.amax, sc);  // kOk: the check passed
  }
  const float s = codecs::F16BitsToF32(sc[0]), mn = codecs::F16BitsToF32(sc[1]);
  switch (f) {
    case PageFormat::kF16:
    case PageFormat::kBF16: {
      uint16_t* out = reinterpret_cast<uint16_t*>(payload);
      for (int c = lane; c < D; c += 32) {
        const float x = src(c);
        out[c] = f == PageFormat::kF16 ? codecs::F32ToF16Bits(x) : codecs::F32ToBF16Bits(x);
      }
      break;
    }
    case PageFormat::kInt8:
    case PageFormat::kFp8E4M3:
      for (int c = lane; c < D; c += 32) payload[c] = static_cast<uint8_t>(ScaledCode(f, src(c), s, mn));
      break;
    default: {  // INT4, INT2 (and the V rows of the *_KC formats, RowFormat above)
      const int bits = codecs::PayloadBits(f), per_byte = 8 / bits;
      for (int bb = lane; bb < D / per_byte; bb += 32) {
        uint32_t byte = 0;
        for (int j = 0; j < per_byte; ++j) byte |= ScaledCode(f, src(bb * per_byte + j), s, mn) << (bits * j);
        payload[bb] = static_cast<uint8_t>(byte);
      }
      break;
    }
  }
  if (lane == 0 && ns > 0) scales[0] = sc[0];  // sc indexed by constants: it stays in registers
  if (lane == 1 && ns > 1) scales[1] = sc[1];
}
// The store job of the check kernel's path: the chain walked again.
__device__ void StoreUpdateJob(const PagedUpdateCudaView& v, int64_t i, int lane) {
  const int64_t u = i / (2 * v.p.shape.kv_heads);
  int64_t tok = 0, prow = 0;
  const int64_t id = UnitPage(v, u, &tok, &prow);  // valid: the check passed
  int fi = 0;
  uint8_t* base = LayerBase(v.p, id, &fi);
  StoreUpdateJobAt(v, i, lane, base, fi, prow, tok);
}

// Note [PagedRotaryCacheUpdate]: one warp, q job j = (b * T + t) * heads + h, every check passed: row (b, t)'s
// query head h rotated into q_out.
// (tok: the token's position).
__device__ __forceinline__ void StoreQueryJob(const PagedUpdateCudaView& v, int64_t j, int lane, int64_t tok) {
  const int64_t h = j % v.heads, u = j / v.heads;
  const int64_t D = v.p.shape.head_size;
  const RowSrc src = RowAt(v, v.q, u, h, true, tok);
  const int64_t at = j * D;
  for (int64_t c = lane; c < D; c += 32) {
    const float y = src(c);  // already rounded to the type
    if (v.elem_type == kFloat32) {
      static_cast<float*>(v.q_out)[at + c] = y;
    } else {
      static_cast<uint16_t*>(v.q_out)[at + c] =
          v.elem_type == kFloat16 ? codecs::F32ToF16Bits(y) : codecs::F32ToBF16Bits(y);
    }
  }
}

// Job i of the store phase: a row job, then (PagedRotaryCacheUpdate) the q jobs.
__device__ __forceinline__ void StoreJob(const PagedUpdateCudaView& v, int64_t rows, int64_t i, int lane) {
  if (i < rows) {
    StoreUpdateJob(v, i, lane);
  } else if (i - rows < v.q_jobs()) {
    const int64_t u = (i - rows) / v.heads;
    StoreQueryJob(v, i - rows, lane, Pos(v, u / v.T) + u % v.T);
  }
}

// One warp per store job; reads the check kernel's flag first.
__global__ void __launch_bounds__(kStoreWarps * 32) PagedUpdateStoreKernel(const UpdateArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);  // Note [Paged CUDA resolved update]
#endif
  const PagedUpdateCudaView& v = args.v;
  const unsigned long long key = *static_cast<const volatile unsigned long long*>(v.flag);
  if (key != kNoError) {
    if (blockIdx.x == 0 && threadIdx.x == 0) ReportUpdate(v, key);
    return;
  }
  const int64_t i = blockIdx.x * static_cast<int64_t>(kStoreWarps) + (threadIdx.x >> 5);
  StoreJob(v, v.rows(), i, threadIdx.x & 31);  // whole warps leave together
}

// Note [Paged CUDA resolved update]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A decode step writes a few rows (B x 1 token x 2 x kv_heads: 6 for SmolLM2 at batch 1, 48 at 8, plus
// PagedRotaryCacheUpdate's B x heads q jobs), and the memset + check + store of Note [Paged CUDA] cost three graph
// nodes for them, each a chain of dependent loads (position, table entry, directory row) that the store walked
// again. Without page_fill (whose prefix kernel needs the flag in global memory), up to kResolvedMaxUnits tokens
// and kResolvedMaxRows row jobs, the update is ONE launch of blocks of kResolvedThreads, and EVERY block checks the
// whole update, so no block waits for another:
//   1. a thread per token resolves its page once (position -> table entry -> directory row) into shared memory
//      (page id, layer bytes, format, row in the page, position; id -1 for a bad row or page) and, for a row's
//      first token, runs the row's checks of Note [PagedCacheUpdate validation] into a shared-memory key;
//   2. __syncthreads; a warp per row job runs the rest of the checks from those slots (a page row written twice
//      compared in shared memory, the protected ranges, the encode check of scaled formats: Note [Resolved update
//      check]), atomicMin into the key in the CPU plan's order, as the check kernel;
//   3. __syncthreads; the key is the same in every block: a failure and block 0's thread 0 reports it, no block
//      stores a byte; otherwise warp w of block k takes store jobs k * 16 + w, + 16 * gridDim.x, ..., their page
//      bytes, row and position from the slots (the 16-bit formats skip the scale reductions).
// The grid has a block per 16 store jobs (at most kResolvedMaxBlocks): one job a warp at SmolLM2's batch 8, where
// the first form of this kernel (one block, the chain walked by the check and again by the store) ran 8 jobs a
// warp in series and lost to the two kernels (2.380 vs 2.005 ms a decode step). The replicated checks are a few
// dozen rows per block at decode; past the limits (a long prefill) the two kernels take the update.
// The kernel (and the store kernel) lets its programmatic dependents start at its start: the attention after it
// resolves its pages and copies rows before `start` while the update runs, and waits for it before this step's
// rows (Note [CUDA attention early start] in cache_attention.cu).
// On sm_90+ (ORTKV_CUDA_EARLY not "0") the kernel is itself launched as a programmatic dependent of the kernel
// before it (a decode layer's QKV projection, whose GEMV lets its dependents start at its start: Note [Linear
// GEMV]). Step 1 runs before griddepcontrol.wait, while the projection still runs: positions, table entries and
// directory rows are not what a projection writes. After the wait every thread reads its token's position, table
// entry and directory row again, in parallel (their addresses are known), and if any word changed (a position or a
// page table computed on the device by the kernel before) the block clears its key and resolves again; steps 2-3
// (which read qkv) follow the wait.
// H200 (SmolLM2 float16, CUDA graph, bench_paged_generate_cuda.py --rounds 7, ms per decode step and x the dense
// step; benchmarks/results/paged_generate_cuda_h200.md, eighth session): 2048 x 1 1.257 (1.31x), 2048 x 8 1.423
// (1.27x), 8192 x 1 1.103 (1.18x), 8192 x 8 1.478 (1.31x), where the one-block form took 1.41-1.49x at batch 1 and
// the two kernels 1.66-1.67x at batch 8; launched plainly 1.144 / 1.455 / 1.129 / 1.499 (batch 8 0.01-0.03 ms
// slower, batch 1 within that lease's noise); the two kernels 1.453 / 1.722 / 1.283 / 1.821.
// ORTKV_CUDA_PAGED_UPDATE=two takes the memset + check + store path at any size, =one this kernel in ONE block
// (its warps looping over the jobs) within its limits, =plain this kernel launched plainly (A/B runs, tests); read
// at every launch (a captured CUDA graph keeps the launches of its capture).
constexpr int kResolvedThreads = 512, kResolvedWarps = kResolvedThreads / 32;
constexpr int64_t kResolvedMaxUnits = 256, kResolvedMaxRows = 2048, kResolvedMaxBlocks = 128;
struct UnitSlots {  // per token u < B * T
  uint8_t* base[kResolvedMaxUnits];  // its page's layer bytes
  int64_t id[kResolvedMaxUnits];     // the page id; -1: the row or the page is bad (the row check reports it)
  int64_t tok[kResolvedMaxUnits];    // its position
  int32_t prow[kResolvedMaxUnits];   // its row in the page
  int32_t fmt[kResolvedMaxUnits];    // the page's directory format
};
// How an update runs: the grid of the resolved kernel (0: the memset + check + store kernels), and whether it is
// launched plainly; ORTKV_CUDA_PAGED_UPDATE read once.
struct UpdatePath {
  int64_t blocks = 0;
  bool plain = false;
};
UpdatePath PathOf(const PagedUpdateCudaView& v) {
  const char* e = std::getenv("ORTKV_CUDA_PAGED_UPDATE");
  const std::string env = e != nullptr ? e : "";
  UpdatePath path;
  path.plain = env == "plain";
  if (env == "two" || v.p.page_fill != nullptr || v.B * v.T > kResolvedMaxUnits || v.rows() > kResolvedMaxRows)
    return path;
  path.blocks = env == "one" ? 1
                             : std::min<int64_t>((v.rows() + v.q_jobs() + kResolvedWarps - 1) / kResolvedWarps,
                                                 kResolvedMaxBlocks);
  return path;
}
// The bytes of the row owners of the memset + check + store path (Note [Paged CUDA row owners]).
size_t OwnerBytesOf(const PagedUpdateCudaView& v) {
  const size_t n = static_cast<size_t>(v.p.num_pages * v.p.shape.page_size) * sizeof(unsigned int);
  return (n + 255) / 256 * 256;
}
// What a token's resolution read (EARLY: compared with the same words after griddepcontrol.wait).
struct UnitRead {
  int64_t pos = -1, e = -1, id = -1, f = -1, off = 0;  // e = -1: the position failed, nothing more read
};
__device__ __forceinline__ void ResolveUnit(const PagedUpdateCudaView& v, int64_t u, UnitSlots& s, unsigned long long* key,
                            UnitRead* read) {
  const int64_t b = u / v.T, t = u % v.T, pos = Pos(v, b);
  int64_t id = -1;
  read->pos = pos;
  if (PosOk(v, b, pos)) {
    int64_t prow = 0;
    const int64_t tok = pos + t, e = EntryOf(v.p, b, tok, &prow);  // no page_fill here: a division
    id = TableAt(v.p, b, e);
    const DirRow r = DirectoryRow(v.p, id);
    *read = UnitRead{pos, e, id, r.f, r.off};
    if (PageProblemAt(v.p, id, r.f, r.off, true) == kPageOk) {
      s.base[u] = LayerBaseAt(v.p, r.f, r.off);
      s.tok[u] = tok;
      s.prow[u] = static_cast<int32_t>(prow);
      s.fmt[u] = static_cast<int32_t>(r.f);
    } else {
      id = -1;
    }
  }
  s.id[u] = id;
  if (t == 0) CheckUpdateRow(v, b, key);  // its loads hit what the lines above brought in
}
// EARLY, after the wait: the words ResolveUnit read, read again (in parallel: their addresses are known); true when
// the kernel before changed one (a position, table entry or directory row computed on the device).
__device__ __forceinline__ bool UnitChanged(const PagedUpdateCudaView& v, int64_t u, const UnitRead& r) {
  const int64_t b = u / v.T;
  const int64_t pos = Pos(v, b);
  if (r.e < 0) return pos != r.pos;
  const int64_t id = TableAt(v.p, b, r.e);
  const DirRow d = DirectoryRow(v.p, r.id);
  return (pos != r.pos) | (id != r.id) | (d.f != r.f) | (d.off != r.off);  // all three loads in flight together
}
static_assert(kResolvedMaxUnits <= kResolvedThreads, "one token per thread");
// Note [Resolved update check]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The encode check of a row of a scaled format (INT8, FP8, INT4, INT2 and the _KC values: RowScales would give
// finite scales) reads the whole source row, rotated. One thread a row job, as the check kernel does it, walked the
// row element by element, each element's loads (qkv, and the rotary tables' cos and sin) waited for before the next:
// CUPTI on the H200 (plain launches, SmolLM2 at 4,000 tokens, batch 1) put the kernel at 35 us a layer with INT4 or
// INT8 pages against 5.8 with F16 ones, whose rows need no check, and the decode step at 2.1x the dense one's
// (F16 pages 1.08x). A warp a row job now loads the row's elements together, lanes over the channels, and reduces
// the least, greatest and largest magnitude with shuffles (SourceRowScalesWarp: the same result, min and max being
// exact in any order once every value is finite). The check kernel of the memset + check + store path (a prefill
// past the resolved kernel's limits, and every update with page_fill: the many-sequence decoder) takes a warp a row
// job the same way. H100 (the only machine that came; CUPTI as above, plain launches): the kernel 10.1 us a layer
// with INT4 pages (F16 5.8 there), the INT4 decode step 1.34x the dense one's at batch 1 (F16 pages 1.04x; one round
// of bench_paged_generate_cuda.py); `pytest -m cuda` of the paged, page-fill and many-sequence files: 425 passed.
// Note [Resolved update preload]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// CUPTI on the H200 (benchmarks/results/paged_generate_cuda_h200.md, eleventh session) put the paged decode step's
// gap to the dense one in this kernel: 7.0 us a layer launched plainly against the dense RotaryCacheUpdate's 2.4
// (batch 1), its store phase loading qkv and the rotary tables only after the pages were resolved and checked. Each
// warp now loads the source values of its first store job (a key or value row, or a query head; 16-bit sources,
// head size <= 128) while the pages resolve: its token's position is read at the start (before
// griddepcontrol.wait, EARLY, speculatively), qkv and the rotary rows after the wait, before the block's barriers;
// the threads that resolve the tokens are the block's last ones (warp 15 at a decode step of one row, which has 15
// jobs), so that no warp does both. A job whose token's position turned out different (the kernel before wrote
// it) loads again as before; the bytes written are the same either way.
// H200 (a package with and without it, one lease): the kernel 7.0 -> 6.0 us a layer (CUPTI, plain launches), the
// paged decode step at batch 1 1.085 -> 1.041 ms (1.22 -> 1.15x the dense step), batch 8 unchanged (1.20x: there every
// warp, the resolving ones too, has a job) (bench_paged_generate_cuda.py --batch 1 8 --max-length 2048).
// Rows of scaled pages (INT8, FP8, INT4, INT2, the _KC values) first loaded the row again for the encode check and
// a third time for the store; the warp that preloaded a row job also checks it (job jw is checked by warp jw % 16 of
// every block, the warp that stores it in block jw / 16), so it now checks and stores from its registers:
// PreloadedRowScales (the least and greatest value with RowScales' tie order, -0.0 vs 0.0, so the scales are the
// CPU's) and StorePreloadedScaled (a lane an element, INT4 / INT2 codes gathered into bytes by shuffles). H100
// (CUPTI as above, two packages in one lease): the kernel with INT4 pages 10.0 -> 8.7 us a layer, INT8 9.1 -> 7.8
// (F16 6.0); the decode step's change (~4 %) is within the runs' spread. Then the scales by the conversion
// instructions (ScalesOf: codecs::F16Ceil / F16Floor in software were ~30 dependent instructions each, three of them
// in a row's chain): INT4 8.5 -> 7.4 us, INT8 7.6 -> 6.7 (another H100 lease, alternated twice).

// The source values lane `lane` stores for job j (a row job below `rows`, else a q job) at position tok.
__device__ __forceinline__ void PreloadJob(const PagedUpdateCudaView& v, int64_t j, int64_t rows, int64_t u,
                                           int64_t tok, int lane, float* pre) {
  const int64_t Hkv = v.p.shape.kv_heads, D = v.p.shape.head_size;
  const RowSrc src =
      j < rows ? SourceRow(v, (j / Hkv) % 2, u, j % Hkv, tok) : RowAt(v, v.q, u, (j - rows) % v.heads, true, tok);
#pragma unroll
  for (int k = 0; k < kPreloadPerLane; ++k) {
    const int64_t c = lane + 32 * k;
    pre[k] = c < D ? src(c) : 0.0f;
  }
}
// The preloaded values of lane `lane` into a 16-bit row of D elements (float16 when f16, else bfloat16).
__device__ __forceinline__ void StorePreloaded16(uint16_t* out, const float* pre, bool f16, int lane, int64_t D) {
#pragma unroll
  for (int k = 0; k < kPreloadPerLane; ++k) {
    const int64_t c = lane + 32 * k;
    if (c < D) out[c] = f16 ? codecs::F32ToF16Bits(pre[k]) : codecs::F32ToBF16Bits(pre[k]);
  }
}

// The preloaded values of lane `lane` into a row of scaled format f (a RowFormat) whose scales sc the check computed
// (PreloadedRowScales): StoreUpdateJobAt's arithmetic, a lane per element; INT4 / INT2 codes gathered into their byte
// by shuffles within groups of 8 / bits lanes (32 is a multiple of every group, so a byte's elements share k).
__device__ __forceinline__ void StorePreloadedScaled(PageFormat f, const float* pre, const uint16_t* sc, int lane,
                                                     int64_t D, uint8_t* payload, uint16_t* scales) {
  const float s = codecs::F16BitsToF32(sc[0]), mn = codecs::F16BitsToF32(sc[1]);
  const int bits = codecs::PayloadBits(f), per_byte = 8 / bits;
#pragma unroll
  for (int k = 0; k < kPreloadPerLane; ++k) {
    const int64_t c = lane + 32 * k;
    if (32 * k >= D) break;  // warp-uniform
    uint32_t byte = ScaledCode(f, pre[k], s, mn) << (bits * (lane % per_byte));  // per_byte 1: the byte itself
    for (int off = 1; off < per_byte; off <<= 1) byte |= __shfl_xor_sync(0xffffffffu, byte, off);
    if (lane % per_byte == 0 && c / per_byte < D / per_byte) payload[c / per_byte] = static_cast<uint8_t>(byte);
  }
  if (lane == 0) scales[0] = sc[0];  // sc indexed by constants: it stays in registers
  if (lane == 1 && codecs::ScalesPerRow(f) > 1) scales[1] = sc[1];
}

// EARLY: launched as a programmatic dependent of the kernel before it (Note [Paged CUDA resolved update]).
template <bool EARLY>
__global__ void __launch_bounds__(kResolvedThreads, 1) PagedUpdateResolvedKernel(const UpdateArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);  // the attention may start (it waits for this grid)
#endif
  const PagedUpdateCudaView& v = args.v;
  __shared__ UnitSlots s;
  __shared__ unsigned long long s_key;
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid == 0) s_key = kNoError;
  __syncthreads();
  const int64_t units = v.B * v.T, rows = v.rows(), Hkv = v.p.shape.kv_heads;
  const int64_t jobs = rows + v.q_jobs();
  const int64_t ur = kResolvedThreads - 1 - tid;  // the token this thread resolves (when < units): the last threads
  // Note [Resolved update preload]: this warp's first job, its token and the position it was loaded at
  const int64_t jw = blockIdx.x * static_cast<int64_t>(kResolvedWarps) + (tid >> 5);
  const bool preload = jw < jobs && v.p.shape.head_size <= 32 * kPreloadPerLane &&
                       (v.elem_type == kFloat16 || v.elem_type == kBFloat16);
  const int64_t pu = !preload ? 0 : jw < rows ? jw / (2 * Hkv) : (jw - rows) / v.heads;
  int64_t ptok = -1;  // -1: nothing preloaded (a position the row check refuses is never used to read the tables)
  if (preload) {
    const int64_t b = pu / v.T, pos = Pos(v, b);
    if (PosOk(v, b, pos)) ptok = pos + pu % v.T;
  }
  float pre[kPreloadPerLane] = {};
  uint16_t psc[2] = {0, 0};  // the scales of the preloaded row (scaled formats), from its check
  UnitRead read;
  if (ur < units) ResolveUnit(v, ur, s, &s_key, &read);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (EARLY) asm volatile("griddepcontrol.wait;" ::: "memory");  // the kernel before is done, its writes visible
#endif
  if (ptok >= 0) PreloadJob(v, jw, rows, pu, ptok, lane, pre);  // qkv is the kernel before's: after the wait
  if constexpr (EARLY) {
    if (__syncthreads_or(ur < units && UnitChanged(v, ur, read))) {  // resolve again from what it wrote
      if (tid == 0) s_key = kNoError;
      __syncthreads();
      if (ur < units) ResolveUnit(v, ur, s, &s_key, &read);
    }
  }
  __syncthreads();
  for (int64_t i = tid >> 5; i < rows; i += kResolvedWarps) {  // a warp a row job (Note [Resolved update check])
    const int64_t u = i / (2 * Hkv), id = s.id[u];
    if (id < 0) continue;  // warp-uniform
    const int32_t prow = s.prow[u];
    const bool own = ptok >= 0 && i == jw && s.tok[u] == ptok;  // this warp's preloaded row (warp-uniform)
    CheckJobWarp(
        v, i, u, s.base[u], s.fmt[u], s.tok[u], lane, &s_key,
        [&]() {
          for (int64_t w = 0; w < u; ++w)
            if (s.id[w] == id && s.prow[w] == prow) return true;
          return false;
        },
        own ? pre : nullptr, psc);
  }
  __syncthreads();
  const unsigned long long key = s_key;
  if (key != kNoError) {
    if (blockIdx.x == 0 && tid == 0) ReportUpdate(v, key);
    return;
  }
  const int64_t D = v.p.shape.head_size;
  for (int64_t j = jw; j < jobs; j += static_cast<int64_t>(gridDim.x) * kResolvedWarps) {  // whole warps
    const bool use_pre = ptok >= 0 && j == jw && s.tok[pu] == ptok;  // warp-uniform
    if (j < rows) {
      const int64_t u = j / (2 * Hkv);
      const PageFormat f = codecs::RowFormat(static_cast<PageFormat>(s.fmt[u]));
      if (use_pre) {  // as StoreUpdateJobAt
        const codecs::PageLayout& lay = v.p.layouts[s.fmt[u]];
        const int64_t h = j % Hkv, kv = (j / Hkv) % 2;
        const uint64_t row = static_cast<uint64_t>(h) * v.p.shape.page_size + static_cast<uint64_t>(s.prow[u]);
        uint8_t* payload = s.base[u] + (kv ? lay.v_payload : lay.k_payload) + row * lay.row_bytes;
        if (f == PageFormat::kF16 || f == PageFormat::kBF16) {
          StorePreloaded16(reinterpret_cast<uint16_t*>(payload), pre, f == PageFormat::kF16, lane, D);
        } else {  // the scales are those the check computed from the same values
          StorePreloadedScaled(f, pre, psc, lane, D, payload,
                               reinterpret_cast<uint16_t*>(s.base[u] + (kv ? lay.v_scales : lay.k_scales) +
                                                           row * lay.scale_row_bytes));
        }
      } else {
        StoreUpdateJobAt(v, j, lane, s.base[u], s.fmt[u], s.prow[u], s.tok[u]);
      }
    } else if (use_pre) {  // as StoreQueryJob (16-bit queries)
      StorePreloaded16(static_cast<uint16_t*>(v.q_out) + (j - rows) * D, pre, v.elem_type == kFloat16, lane, D);
    } else {
      const int64_t q = j - rows;
      StoreQueryJob(v, q, lane, s.tok[q / v.heads]);
    }
  }
}

// ---- PagedCacheAttention -----------------------------------------------------------------------------
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kEPT = 8;
constexpr int kUnroll = 4;

__device__ __forceinline__ float H(uint32_t bits16) { return __half2float(__ushort_as_half(static_cast<unsigned short>(bits16))); }
__device__ __forceinline__ float Bf(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// Channels [d0, d0 + 8) of row `tok` of (kv, head) of a page layer at `base` in format fmt, in registers.
// VEC: D % 8 == 0 (every load below is then aligned); else element by element (zeros past D).
template <bool VEC>
__device__ __forceinline__ void Decode8(const uint8_t* base, int fmt, const codecs::PageLayout& lay, int kv, int head,
                                        int tok, int ps, int d0, int D, float* f) {
  const uint64_t row = static_cast<uint64_t>(head) * ps + tok;
  const uint8_t* payload = base + (kv ? lay.v_payload : lay.k_payload) + row * lay.row_bytes;
  const bool kc = kv == 0 && (fmt == static_cast<int>(PageFormat::kInt4KC) || fmt == static_cast<int>(PageFormat::kInt2KC));
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(
      kc ? base + lay.k_scales + static_cast<uint64_t>(head) * D * lay.scale_row_bytes
         : base + (kv ? lay.v_scales : lay.k_scales) + row * lay.scale_row_bytes);
  if constexpr (VEC) {
    switch (static_cast<PageFormat>(fmt)) {
      case PageFormat::kF16:
      case PageFormat::kBF16: {
        const uint4 w = __ldg(reinterpret_cast<const uint4*>(payload + 2 * d0));
        const uint32_t x[4] = {w.x, w.y, w.z, w.w};
        const bool half = fmt == static_cast<int>(PageFormat::kF16);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          f[2 * i] = half ? H(x[i] & 0xFFFFu) : Bf(x[i] & 0xFFFFu);
          f[2 * i + 1] = half ? H(x[i] >> 16) : Bf(x[i] >> 16);
        }
        return;
      }
      case PageFormat::kInt8:
      case PageFormat::kFp8E4M3: {
        const uint2 w = __ldg(reinterpret_cast<const uint2*>(payload + d0));
        const float s = H(__ldg(sc));
        const bool i8 = fmt == static_cast<int>(PageFormat::kInt8);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const uint32_t byte = ((i < 4 ? w.x : w.y) >> (8 * (i & 3))) & 0xFFu;
          f[i] = (i8 ? static_cast<float>(static_cast<int8_t>(byte)) : codecs::E4M3ToF32(static_cast<uint8_t>(byte))) * s;
        }
        return;
      }
      default: {  // INT4, INT2, *_KC
        const int bits = codecs::PayloadBits(static_cast<PageFormat>(fmt));
        const uint32_t w = bits == 4 ? __ldg(reinterpret_cast<const uint32_t*>(payload + d0 / 2))
                                     : static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(payload + d0 / 4)));
        const uint32_t mask = (1u << bits) - 1u;
        if (kc) {
          const uint4 a = __ldg(reinterpret_cast<const uint4*>(sc + 2 * d0));
          const uint4 c = __ldg(reinterpret_cast<const uint4*>(sc + 2 * d0 + 8));
          const uint32_t p[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};  // (s_c, m_c) per word
#pragma unroll
          for (int i = 0; i < 8; ++i)
            f[i] = static_cast<float>((w >> (bits * i)) & mask) * H(p[i] & 0xFFFFu) + H(p[i] >> 16);
        } else {
          const uint32_t p = __ldg(reinterpret_cast<const uint32_t*>(sc));
          const float s = H(p & 0xFFFFu), m = H(p >> 16);
#pragma unroll
          for (int i = 0; i < 8; ++i) f[i] = static_cast<float>((w >> (bits * i)) & mask) * s + m;
        }
        return;
      }
    }
  } else {
#pragma unroll
  for (int i = 0; i < kEPT; ++i) {
    const int c = d0 + i;
    if (c >= D) {
      f[i] = 0.0f;
      continue;
    }
    switch (static_cast<PageFormat>(fmt)) {
      case PageFormat::kF16: f[i] = H(reinterpret_cast<const uint16_t*>(payload)[c]); break;
      case PageFormat::kBF16: f[i] = Bf(reinterpret_cast<const uint16_t*>(payload)[c]); break;
      case PageFormat::kInt8: f[i] = static_cast<float>(static_cast<int8_t>(payload[c])) * H(sc[0]); break;
      case PageFormat::kFp8E4M3: f[i] = codecs::E4M3ToF32(payload[c]) * H(sc[0]); break;
      default: {
        const int bits = codecs::PayloadBits(static_cast<PageFormat>(fmt));
        const uint32_t q = (payload[(c * bits) / 8] >> ((c * bits) % 8)) & ((1u << bits) - 1u);
        f[i] = kc ? static_cast<float>(q) * H(sc[2 * c]) + H(sc[2 * c + 1]) : static_cast<float>(q) * H(sc[0]) + H(sc[1]);
      }
    }
  }
  }
}

template <typename T, bool VEC>
__device__ __forceinline__ void LoadQ(const T* row, int d0, int D, float* f) {
  if (VEC && d0 < D) {
    const T* p = row + d0;
#pragma unroll
    for (int i = 0; i < kEPT; ++i) f[i] = ToF(p[i]);
    return;
  }
#pragma unroll
  for (int i = 0; i < kEPT; ++i) f[i] = d0 + i < D ? ToF(row[d0 + i]) : 0.0f;
}

struct AttnArgs {
  PagedAttentionCudaView v;
  int64_t head_blocks;
  int tpk;
};

__device__ __forceinline__ int64_t ClampedStart(const PagedAttentionCudaView& v, int64_t b, bool* bad) {
  int64_t st = v.start[b * v.start_stride];
  const int64_t hi = RowTotal(v.p, b) - v.T;
  *bad = st < 0 || st > hi;
  return st < 0 ? 0 : (st > hi ? hi : st);
}

template <typename T, bool VEC, int GM>
__global__ void __launch_bounds__(kThreads) PagedAttentionKernel(const AttnArgs args) {
  const PagedAttentionCudaView& a = args.v;
  __shared__ float s_m[kWarps][GM];
  __shared__ float s_l[kWarps][GM];
  __shared__ float s_acc[kWarps][GM][kAttnCudaMaxHeadSize];

  const int64_t S = a.splits;
  int64_t blk = blockIdx.x;
  const int64_t split = blk % S;
  blk /= S;
  const int64_t hb = blk % args.head_blocks;
  const int64_t unit = blk / args.head_blocks;
  const int64_t t = unit % a.T;
  const int64_t hk = (unit / a.T) % a.Hkv;
  const int64_t b = unit / (a.T * a.Hkv);
  const int64_t G = a.Hq / a.Hkv;
  const int64_t g0 = hb * GM;
  const int gn = static_cast<int>(G - g0 < GM ? G - g0 : GM);
  const int D = static_cast<int>(a.D);
  const int ps = a.p.shape.page_size;
  unsigned long long* flag = static_cast<unsigned long long*>(a.flag);

  bool bad_start = false;
  const int64_t st = ClampedStart(a, b, &bad_start);
  if (bad_start && threadIdx.x == 0) atomicMin(flag, Key(kClassRow, static_cast<unsigned long long>(b) << 28));
  const int64_t L = st + t + 1;
  int64_t j0, j1;
  SplitKeys<1>(L, S, split, &j0, &j1);

  // every page of [j0, j1) is checked before any is read (Note [Paged CUDA])
  int bad = 0;
  if (j1 > j0) {
    int64_t r0 = 0, r1 = 0;
    const int64_t e_first = EntryOf(a.p, b, j0, &r0), e_last = EntryOf(a.p, b, j1 - 1, &r1);
    for (int64_t pi = e_first + threadIdx.x; pi <= e_last; pi += kThreads) {
      if (EntryFill(a.p, b, pi) == 0) continue;  // skipped by the mapping (Note [Page fill])
      if (EntryProblem(a.p, b, pi, false) != kPageOk ||
          (a.page_format >= 0 && a.p.directory[2 * TableAt(a.p, b, pi)] != a.page_format)) {
        atomicMin(flag, Key(kClassRow, (static_cast<unsigned long long>(b) << 28) | static_cast<unsigned long long>(pi + 1)));
        bad = 1;
      }
    }
  }
  const bool skip = __syncthreads_or(bad) != 0;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tpk = args.tpk;
  const int sub = lane & (tpk - 1);
  const int kg = tid / tpk;
  const int nkg = kThreads / tpk;
  const int d0 = sub * kEPT;

  const T* qp = static_cast<const T*>(a.q) + ((b * a.T + t) * a.Hq + hk * G + g0) * a.D;
  float qf[GM][kEPT];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    if (g < gn) {
      LoadQ<T, VEC>(qp + g * a.D, d0, D, qf[g]);
#pragma unroll
      for (int i = 0; i < kEPT; ++i) qf[g][i] *= a.scale;
    } else {
#pragma unroll
      for (int i = 0; i < kEPT; ++i) qf[g][i] = 0.0f;
    }
  }
  float m[GM], l[GM], acc[GM][kEPT];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < kEPT; ++i) acc[g][i] = 0.0f;
  }
  const int64_t jend = skip ? j0 : j1;  // a chunk with a bad page reads nothing
  for (int64_t base = j0; base < jend; base += static_cast<int64_t>(nkg) * kUnroll) {
    float kf[kUnroll][kEPT], vf[kUnroll][kEPT];
    bool ok[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + static_cast<int64_t>(u) * nkg + kg;
      ok[u] = j < jend;
      if (ok[u]) {
        int fmt = 0;
        int64_t row = 0;
        const int64_t e = EntryOf(a.p, b, j, &row);
        const uint8_t* pg = LayerBase(a.p, TableAt(a.p, b, e), &fmt);
        const codecs::PageLayout& lay = a.p.layouts[fmt];
        const int r = static_cast<int>(row);
        if (d0 < D) {
          Decode8<VEC>(pg, fmt, lay, 0, static_cast<int>(hk), r, ps, d0, D, kf[u]);
          Decode8<VEC>(pg, fmt, lay, 1, static_cast<int>(hk), r, ps, d0, D, vf[u]);
        } else {
#pragma unroll
          for (int i = 0; i < kEPT; ++i) kf[u][i] = vf[u][i] = 0.0f;
        }
      } else {
#pragma unroll
        for (int i = 0; i < kEPT; ++i) kf[u][i] = vf[u][i] = 0.0f;
      }
    }
    float sc[GM][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < kEPT; ++i) s = fmaf(qf[g][i], kf[u][i], s);
        for (int off = tpk >> 1; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        sc[g][u] = ok[u] ? s : -INFINITY;
      }
    }
    if (!ok[0]) continue;
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      float mb = sc[g][0];
#pragma unroll
      for (int u = 1; u < kUnroll; ++u) mb = fmaxf(mb, sc[g][u]);
      const float mn = fmaxf(m[g], mb);
      const float corr = __expf(m[g] - mn);
      l[g] *= corr;
#pragma unroll
      for (int i = 0; i < kEPT; ++i) acc[g][i] *= corr;
      m[g] = mn;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) sc[g][u] = __expf(sc[g][u] - mn);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!ok[u]) break;
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        const float p = sc[g][u];
        l[g] += p;
#pragma unroll
        for (int i = 0; i < kEPT; ++i) acc[g][i] = fmaf(p, vf[u][i], acc[g][i]);
      }
    }
  }

  // merge the key groups (as the dense kernel)
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    float mw = m[g];
    for (int off = 16; off >= tpk; off >>= 1) mw = fmaxf(mw, __shfl_xor_sync(0xffffffffu, mw, off));
    if (lane == 0) s_m[warp][g] = mw;
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    float mb = s_m[0][g];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) mb = fmaxf(mb, s_m[w][g]);
    const float fct = m[g] == -INFINITY ? 0.0f : __expf(m[g] - mb);
    float lw = l[g] * fct;
    float aw[kEPT];
#pragma unroll
    for (int i = 0; i < kEPT; ++i) aw[i] = acc[g][i] * fct;
    for (int off = 16; off >= tpk; off >>= 1) {
      lw += __shfl_xor_sync(0xffffffffu, lw, off);
#pragma unroll
      for (int i = 0; i < kEPT; ++i) aw[i] += __shfl_xor_sync(0xffffffffu, aw[i], off);
    }
    if (lane < tpk) {
#pragma unroll
      for (int i = 0; i < kEPT; ++i)
        if (d0 + i < D) s_acc[warp][g][d0 + i] = aw[i];
      if (lane == 0) s_l[warp][g] = lw;
    }
  }
  __syncthreads();
  for (int x = tid; x < gn * D; x += kThreads) {
    const int g = x / D, d = x % D;
    float lb = 0.0f, ab = 0.0f, mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      lb += s_l[w][g];
      ab += s_acc[w][g][d];
      mb = fmaxf(mb, s_m[w][g]);
    }
    const int64_t head = hk * G + g0 + g;
    if (S == 1) {
      T* o = static_cast<T*>(a.out) + ((b * a.T + t) * a.Hq + head) * a.D;
      o[d] = FromF<T>(lb > 0.0f ? ab / lb : 0.0f);  // a refused row's output is 0 (reported)
    } else {
      float* p = a.partial + ((unit * G + g0 + g) * S + split) * (a.D + 2);
      p[d] = ab;
      if (d == 0) {
        p[a.D] = mb;
        p[a.D + 1] = lb;
      }
    }
  }
}

// Block 0's thread 0 of the epilogue: the attention's report (word [1]).
__device__ void ReportAttention(const PagedAttentionCudaView& a, unsigned long long key) {
  ortkv_device_error* err = a.error_word ? static_cast<ortkv_device_error*>(a.error_word) + 1 : nullptr;
  const unsigned long long detail = key & ((1ull << 60) - 1);
  const int64_t b = static_cast<int64_t>(detail >> 28), sub = static_cast<int64_t>(detail & ((1ull << 28) - 1));
  const int64_t cap = RowTotal(a.p, b);
  const int64_t st = a.start[b * a.start_stride];
  if (sub == 0) {
    WriteReport(err, a.label, st < 0 ? ORTKV_DERR_NEGATIVE : ORTKV_DERR_CAPACITY, b, st, a.T, cap, 0,
                a.p.page_fill != nullptr ? 1 : 0, 0);
    return;
  }
  const int64_t pi = sub - 1, id = TableAt(a.p, b, pi);
  uint64_t detail_word = EntryDetail(a.p, b, pi, false);
  // a valid page of another format than the node's page_format attribute (Note [Paged CUDA uniform 16-bit])
  // (problem byte: kPageFormatHint | the attribute's format << 4; device_errors.cc decodes it)
  if ((detail_word & 0xFFu) == kPageOk && a.page_format >= 0 &&
      ((detail_word >> 8) & 0xFFu) != static_cast<uint64_t>(a.page_format))
    detail_word |= kPageFormatHint | (static_cast<uint64_t>(a.page_format) << 4);
  WriteReport(err, a.label, ORTKV_DERR_PAGE, b, st, a.T, cap, static_cast<uint64_t>(pi), static_cast<uint64_t>(id),
              detail_word);
}

// One block per (unit, query head): merges the S chunks (splits > 1); block 0 also reports.
// LOG2: the partials' m is in base 2 (Note [Paged CUDA v2]); then the combine may be a programmatic
// dependent of the attention, and waits for it before reading the flag and the partials, and the
// attention blocks' keys are scanned by a block of their own, the grid's last (the only one when
// splits <= 1; LaunchCombine adds it), beside the merges instead of before block 0's merge: the scan was
// ~0.35 us of every node (benchmarks/results/paged_attention_cuda_h200.md).
template <typename T, bool LOG2>
__global__ void __launch_bounds__(kMergeThreads) PagedCombineKernel(const AttnArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);  // a programmatic dependent may start (it waits)
  if (LOG2) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const PagedAttentionCudaView& a = args.v;
  if (LOG2) {  // v2: the smallest of the attention blocks' own keys (Note [Paged CUDA v2])
    if (blockIdx.x == gridDim.x - 1) {
      __shared__ unsigned long long s_key;
      if (threadIdx.x == 0) s_key = kNoError;
      __syncthreads();
      const int64_t n = a.B * a.Hkv * a.T * args.head_blocks * a.splits;
      unsigned long long mine = kNoError;
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mine = a.block_flags[i] < mine ? a.block_flags[i] : mine;
      if (mine != kNoError) atomicMin(&s_key, mine);
      __syncthreads();
      if (threadIdx.x == 0 && s_key != kNoError) ReportAttention(a, s_key);
      return;  // the scan's own block (merges: blocks 0 .. units * G - 1)
    }
  } else if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned long long key = *static_cast<const volatile unsigned long long*>(a.flag);
    if (a.row_flags != nullptr)  // Note [Page fill]: FillPrefixKernel's bad fills
      for (int64_t r = 0; r < a.B; ++r) key = a.row_flags[r] < key ? a.row_flags[r] : key;
    if (key != kNoError) ReportAttention(a, key);
  }
  if (a.splits <= 1) return;
  CombineUnitHead<T, LOG2>(a.partial, a.out, a.splits, a.T, a.Hq, a.Hkv, a.D);
}

template <typename T, bool VEC>
cudaError_t LaunchAttnT(const AttnArgs& a, int gm, int64_t blocks, cudaStream_t stream) {
  switch (gm) {
    case 1: PagedAttentionKernel<T, VEC, 1><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a); break;
    case 2: PagedAttentionKernel<T, VEC, 2><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a); break;
    case 3: PagedAttentionKernel<T, VEC, 3><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a); break;
    case 4: PagedAttentionKernel<T, VEC, 4><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a); break;
    default: PagedAttentionKernel<T, VEC, 8><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a); break;
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchAttn(const AttnArgs& a, int gm, int64_t blocks, cudaStream_t stream) {
  cudaError_t e = a.v.vec ? LaunchAttnT<T, true>(a, gm, blocks, stream) : LaunchAttnT<T, false>(a, gm, blocks, stream);
  if (e != cudaSuccess) return e;
  const int64_t G = a.v.group();
  const unsigned combine_blocks = a.v.splits > 1 ? static_cast<unsigned>(a.v.units() * G) : 1u;
  const int threads = CombineThreads(a.v.splits, a.v.D);  // Note [Combine in one load round]
  PagedCombineKernel<T, false><<<combine_blocks, threads, 0, stream>>>(a);
  return cudaGetLastError();
}

// ---- PagedCacheAttention v2: Note [Paged CUDA v2] ----------------------------------------------------
// Note [Paged CUDA v2]
// ~~~~~~~~~~~~~~~~~~~~
// The first paged kernel (PagedAttentionKernel above, ORTKV_CUDA_ATTENTION=v1) was latency-bound: for
// every 4 keys a thread loaded the page-table entry, then the directory entry, then the bytes, and
// only then computed; three dependent global loads per step and nothing in flight while computing, so
// it ran at ~0.6 TB/s at 32K x 8 and narrow pages (INT4) were no faster than F16. v2 streams pages as
// Note [CacheAttention CUDA v2] streams a dense cache:
//   * Page metadata once per page, not per key: the block resolves its chunk's pages in sub-chunks of
//     up to kMaxPages pages (one thread per page: table entry, directory entry, every check of
//     PageProblem) into shared memory (layer base pointer and format), plus each format's layout
//     (row bytes, section offsets) once per block. A bad page in a sub-chunk is recorded (atomicMin
//     on the flag, as v1) before any byte of that sub-chunk is read, and the block then drops what it
//     accumulated: its output / partial is empty, exactly as v1's "a chunk with a bad page reads
//     nothing" leaves it (earlier sub-chunks' pages were valid; their bytes are simply discarded).
//   * A key group (TPK threads, TPK * 8 >= head size) owns kU = 4 CONSECUTIVE keys per stage,
//     aligned to 4, so with page_size % 4 == 0 they lie in one page: one page lookup (shared memory)
//     and one format dispatch per group, and every index is 32-bit (a first draft spent most of its
//     time in 64-bit j / ps and j % ps per key).
//   * The group copies its 4 rows with cp.async into its region of a kStages-deep shared-memory ring:
//     the 4 rows' K payload and V payload are contiguous in the page, so the copy is split into
//     16-byte pieces over the group's threads whatever the format: a narrow page moves fewer bytes
//     with fewer instructions (head size 64: F16 four pieces per thread for K and four for V, INT8
//     two, INT4 one, INT2 half the threads one), plus the 4 rows' K scales and V scales (8 or 16
//     adjacent bytes each) by two threads. A first v2 gave each thread its own 8 channels of every
//     row (the dense kernel's private slots): INT4 then issued as many copy instructions as F16, of
//     4 bytes each, and was no faster. Sharing a region costs a __syncwarp per stage (after
//     cp.async.wait_group: every copy of the stage has landed and is visible to the group, and every
//     thread has finished reading the stage the next copy refills).
//   * Decoding is in registers, specialized per format at compile time (IssueGroup<F> /
//     DecodeGroup<F> behind one switch per group); INT8 / INT4 / INT2 codes become floats with
//     magic-number arithmetic and FP8 pairs with the hardware conversion, not I2F (1/8 of the FP32
//     rate on sm_90). The scores and their shuffles run after the switch, every thread converged.
//     Keys of a group outside the window are copied (same page) but never counted. *_KC keys read
//     their per-channel (s, m) of the page with __ldg, once per group.
//   * No memset before the launch (one graph node less per layer): each block keeps its first failure
//     (bad start, bad page) in shared memory and writes it to its own slot of block_flags at the end,
//     kNoError included; the combine's block 0 takes the smallest, the same key v1's atomicMin on one
//     pre-cleared flag gives.
//   * Scores in base 2, lazy rescale, partials in base 2 (PagedCombineKernel<T, true>, launched as a
//     programmatic dependent on sm_90+), the split count trimmed to one wave of this kernel (its
//     occupancy: ~52 KiB of dynamic shared memory per block), as Note [CacheAttention CUDA v2 waves].
// v2 runs when view.vec (D % 8 == 0, 16-byte aligned query and output), D <= 256 and page_size % 4 == 0;
// else v1.
namespace pv2 {

constexpr int kU = 4;
constexpr int kStages = 3;
// A key group (TPK threads, kU consecutive rows of one page) has a region per ring stage: the kU rows' K
// payload, their V payload (each at most kU * 2 * head_size bytes: 64 * TPK for head_size <= 8 * TPK),
// then their K scales and V scales (16 bytes each).
template <int TPK>
__host__ __device__ constexpr int GroupBytes() { return 2 * 64 * TPK + 32; }
constexpr int kStageBytes = (kThreads / 8) * GroupBytes<8>();  // the largest over TPK = 8, 16, 32
constexpr int kMaxPages = 256;

// The page window that starts at key s0 of a block's keys [.., j1): pages p0 .. p1, keys [s0, s1), at most kMaxPages
// pages (ResolveWindow relies on that bound).
struct PageSpan {
  int64_t p0, s1, p1;
};
__device__ __forceinline__ PageSpan WindowAt(int64_t s0, int64_t j1, int ps) {
  const int64_t p0 = s0 / ps;
  const int64_t s1 = j1 < (p0 + kMaxPages) * ps ? j1 : (p0 + kMaxPages) * ps;
  return {p0, s1, (s1 - 1) / ps};
}

struct FormatInfo {
  uint32_t row_bytes, v_payload, k_scales, v_scales, srb, bits;
};

// A block's resolved pages (shared memory), for v2 and v3: one key window of up to kMaxPages pages at a time,
// each format's layout, and the block's first failure (kNoError if none), written to block_flags at the end.
struct PageWindow {
  const uint8_t* page[kMaxPages];
  unsigned long long key;
  FormatInfo fi[codecs::kNumPageFormats];
  uint32_t formats[kWarps];  // per warp: the OR of 1 << format over the pages it resolved (ResolveWindow)
  uint8_t fmt[kMaxPages];
};

__device__ __forceinline__ uint32_t WarpOr(uint32_t x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_or_sync(0xffffffffu, x);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x |= __shfl_xor_sync(0xffffffffu, x, o);
  return x;
#endif
}

// Threads 0 .. kNumPageFormats - 1 fill w.fi (read after the next barrier).
__device__ __forceinline__ void LoadFormats(const PagedAttentionCudaView& a, int tid, PageWindow& w) {
  if (tid < codecs::kNumPageFormats) {
    const codecs::PageLayout& lay = a.p.layouts[tid];
    FormatInfo f;
    f.row_bytes = static_cast<uint32_t>(lay.row_bytes);
    f.v_payload = static_cast<uint32_t>(lay.v_payload);
    f.k_scales = static_cast<uint32_t>(lay.k_scales);
    f.v_scales = static_cast<uint32_t>(lay.v_scales);
    f.srb = static_cast<uint32_t>(lay.scale_row_bytes);
    f.bits = static_cast<uint32_t>(codecs::PayloadBits(static_cast<PageFormat>(tid)));
    w.fi[tid] = f;
  }
}

// Every thread of the block: resolves row b's pages p0 .. p1 (p1 - p0 < kMaxPages: every caller's window comes from
// WindowAt) into w (table, directory, every check of PageProblem) after a barrier (the previous window's list is no
// longer read, and w.fi is written). A bad
// page is recorded in w.key (atomicMin); true when the window has one (then nothing of it may be read).
// *formats: the OR of 1 << format over the window's pages, the same in every thread (each warp's OR goes into
// its own word, read after the closing barrier and rewritten only after the next window's opening one: no
// reset, no atomics; it replaced a second pass over w.fmt and a third barrier, ~0.35 us of every block's start).
// ids / bad_bits (EARLY's first window, Note [CUDA attention early start]): this thread's table entries (its k-th
// page p0 + tid + k * kThreads) and which of them were bad.
__device__ __forceinline__ bool ResolveWindow(const PagedAttentionCudaView& a, int64_t b, int64_t p0, int64_t p1,
                                              int tid, PageWindow& w, uint32_t* formats, int64_t* ids = nullptr,
                                              uint32_t* bad_bits = nullptr) {
  __syncthreads();
  int bad = 0;
  uint32_t mine = 0;
  // Note [Paged window loads]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A thread's table entries (at most kMaxPages / kThreads = 2) are all read, then all their directory rows, then
  // checked: two dependent load latencies per window, where the loop page by page paid two per page of the thread
  // (at 32K keys x 8 rows a block's window is ~186 pages: four latencies in a row before its first tile). H200,
  // paged_sweep (three alternated pairs): INT8 -4 %, INT4 -3 %, F16 -1 % at 32K x 8, F16 -3 % at 8K x 1;
  // through ORT (bench_paged_attention_cuda.py) F16 / dense 1.26 -> 1.19 at 8K x 1, 1.11 -> 1.10 at 32K x 8.
  // (A build with no lookups at all was 4-5 % faster than the page-by-page loop: the rest of the gap to dense is
  // not here; benchmarks/results/paged_attention_cuda_h200.md.)
  constexpr int kPer = kMaxPages / kThreads;
  static_assert(kMaxPages % kThreads == 0, "a thread resolves kPer pages of a window");
  int64_t id[kPer], f[kPer], off[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int64_t pi = p0 + tid + k * kThreads;
    id[k] = pi <= p1 ? TableAt(a.p, b, pi) : -1;
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const DirRow r = DirectoryRow(a.p, id[k]);
    f[k] = r.f;
    off[k] = r.off;
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int64_t pi = p0 + tid + k * kThreads;
    if (pi > p1) break;
    if (ids != nullptr) ids[k] = id[k];
    if (PageProblemAt(a.p, id[k], f[k], off[k], false) != kPageOk || (a.page_format >= 0 && f[k] != a.page_format)) {
      atomicMin(&w.key, Key(kClassRow, (static_cast<unsigned long long>(b) << 28) | static_cast<unsigned long long>(pi + 1)));
      bad = 1;
      if (bad_bits != nullptr) *bad_bits |= 1u << k;
    } else {
      w.page[pi - p0] = LayerBaseAt(a.p, f[k], off[k]);
      w.fmt[pi - p0] = static_cast<uint8_t>(f[k]);
      mine |= 1u << f[k];
    }
  }
  mine = WarpOr(mine);
  if ((tid & 31) == 0) w.formats[tid >> 5] = mine;
  const bool any_bad = __syncthreads_or(bad) != 0;
  uint32_t all = 0;
#pragma unroll
  for (int i = 0; i < kWarps; ++i) all |= w.formats[i];
  *formats = all;
  return any_bad;
}

struct Smem {
  uint4 ring[kStages * kStageBytes / 16];
  PageWindow w;
};

template <int GM>
using Merge = WarpMerge<kWarps, GM>;
static_assert(sizeof(Merge<kAttnCudaHeads>) <= kStages * kStageBytes, "merge arrays fit the ring");
static_assert((kThreads / 16) * GroupBytes<16>() <= kStageBytes && (kThreads / 32) * GroupBytes<32>() <= kStageBytes, "");

// 8 channels of a row piece `w` in the compile-time format F. `half`: which 16-bit half of the word
// holds the piece (INT2 payload); sc: the row's scale word ((s) or (s, m) as float16 bits).
template <int F>
__device__ __forceinline__ void DecodePiece(const uint4& w, uint32_t sc, bool half, float* x) {
  constexpr PageFormat f = static_cast<PageFormat>(F);
  if constexpr (f == PageFormat::kF16) {
    const __half2* h = reinterpret_cast<const __half2*>(&w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 y = __half22float2(h[i]);
      x[2 * i] = y.x;
      x[2 * i + 1] = y.y;
    }
  } else if constexpr (f == PageFormat::kBF16) {
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = Bf(u[i] & 0xFFFFu);
      x[2 * i + 1] = Bf(u[i] >> 16);
    }
  } else if constexpr (f == PageFormat::kInt8) {
    // codes + 128 as the low byte of 2^23 (one PRMT), minus 2^23 + 128: exact, and no int-to-float
    // conversion (those run at 1/8 of the FP32 rate on sm_90 and bounded the first INT8 / INT4 decode)
    const float s = H(sc & 0xFFFFu);
    const uint32_t lo = w.x ^ 0x80808080u, hi = w.y ^ 0x80808080u;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      x[i] = (__uint_as_float(__byte_perm(i < 4 ? lo : hi, 0x4B000000u, 0x7650u + (i & 3))) - 8388736.0f) * s;
  } else if constexpr (f == PageFormat::kFp8E4M3) {
    const float s = H(sc & 0xFFFFu);
    const uint32_t u[2] = {w.x, w.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // two codes per conversion (one instruction on sm_89+)
      const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>((u[i >> 1] >> (16 * (i & 1))) & 0xFFFFu), __NV_E4M3);
      const float2 y = __half22float2(*reinterpret_cast<const __half2*>(&r));
      x[2 * i] = y.x * s;
      x[2 * i + 1] = y.y * s;
    }
  } else if constexpr (f == PageFormat::kInt4 || f == PageFormat::kInt4KC) {
    const float s = H(sc & 0xFFFFu), m = H(sc >> 16);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = fmaf(__uint_as_float(((w.x >> (4 * i)) & 0xFu) | 0x4B000000u) - 8388608.0f, s, m);
  } else {  // INT2, INT2_KC
    const float s = H(sc & 0xFFFFu), m = H(sc >> 16);
    const uint32_t q = half ? w.x >> 16 : w.x;
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = fmaf(__uint_as_float(((q >> (2 * i)) & 0x3u) | 0x4B000000u) - 8388608.0f, s, m);
  }
}

__host__ __device__ constexpr bool IsKC(int f) {
  return f == static_cast<int>(PageFormat::kInt4KC) || f == static_cast<int>(PageFormat::kInt2KC);
}
__host__ __device__ constexpr int Bits(int f) { return f <= 1 ? 16 : (f <= 3 ? 8 : (f == 4 || f == 6 ? 4 : 2)); }
__host__ __device__ constexpr int ScaleBytes(int f) { return f <= 1 ? 0 : (f <= 3 ? 2 : 4); }  // per row

// The group's copy of rows row0 .. row0 + kU - 1 of one page (format F) into its region `g` of a ring
// stage, spread over the group's TPK threads (`sub`) in 16-byte pieces (8 when kU rows of INT2 are not
// a multiple of 16 bytes): the kU rows' K payload and V payload are contiguous in the page, so a narrow
// format moves fewer bytes with fewer instructions (INT4 at head size 64: one piece per thread for K and
// one for V; F16: four each). Then the kU rows' K scales and V scales (8 or 16 adjacent bytes each;
// row0 % kU == 0 keeps them aligned) by threads 0 and 1. *_KC keys' per-channel scales are not copied.
template <int F, int TPK>
__device__ __forceinline__ void IssueGroup(uint8_t* g, const uint8_t* pg, const FormatInfo& fi, uint32_t row0, int sub) {
  const uint32_t bytes = kU * fi.row_bytes;
  const uint8_t* ks = pg + row0 * fi.row_bytes;
  const uint8_t* vs = ks + fi.v_payload;
  uint8_t* vd = g + 64 * TPK;
  if (bytes % 16u == 0) {
    for (uint32_t c = static_cast<uint32_t>(sub) * 16u; c < bytes; c += TPK * 16u) {
      CpAsync<16>(g + c, ks + c);
      CpAsync<16>(vd + c, vs + c);
    }
  } else {
    for (uint32_t c = static_cast<uint32_t>(sub) * 8u; c < bytes; c += TPK * 8u) {
      CpAsync<8>(g + c, ks + c);
      CpAsync<8>(vd + c, vs + c);
    }
  }
  constexpr int kSb = ScaleBytes(F) * kU;
  if constexpr (kSb > 0) {
    uint8_t* sd = g + 128 * TPK;
    if (sub == 0 && !IsKC(F)) CpAsync<kSb>(sd, pg + fi.k_scales + row0 * ScaleBytes(F));
    if (sub == 1) CpAsync<kSb>(sd + 16, pg + fi.v_scales + row0 * ScaleBytes(F));
  }
}

// This thread's 8 channels of row u of a group region, as the low bytes of a uint4.
template <int F>
__device__ __forceinline__ uint4 LoadPiece(const uint8_t* p) {
  constexpr int kBits = Bits(F);
  if constexpr (kBits == 16) {
    return *reinterpret_cast<const uint4*>(p);
  } else if constexpr (kBits == 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    return make_uint4(w.x, w.y, 0u, 0u);
  } else if constexpr (kBits == 4) {
    return make_uint4(*reinterpret_cast<const uint32_t*>(p), 0u, 0u, 0u);
  } else {
    return make_uint4(*reinterpret_cast<const uint16_t*>(p), 0u, 0u, 0u);
  }
}

// Decodes this thread's channels of the group's kU rows from region g: kf / vf [kU][8] (zeros where
// !want).
template <int F, int TPK>
__device__ __forceinline__ void DecodeGroup(const uint8_t* g, const uint8_t* pg, const FormatInfo& fi, int hk, int D,
                                            int d0, const bool* want, float (*kf)[kEPT], float (*vf)[kEPT]) {
  constexpr int kBits = Bits(F);
  uint32_t ks[kU] = {}, vs[kU] = {};
  const uint8_t* sd = g + 128 * TPK;
  if constexpr (ScaleBytes(F) == 4) {
    const uint4 a = *reinterpret_cast<const uint4*>(sd), c = *reinterpret_cast<const uint4*>(sd + 16);
    ks[0] = a.x, ks[1] = a.y, ks[2] = a.z, ks[3] = a.w;
    vs[0] = c.x, vs[1] = c.y, vs[2] = c.z, vs[3] = c.w;
  } else if constexpr (ScaleBytes(F) == 2) {
    const uint2 a = *reinterpret_cast<const uint2*>(sd), c = *reinterpret_cast<const uint2*>(sd + 16);
    ks[0] = a.x & 0xFFFFu, ks[1] = a.x >> 16, ks[2] = a.y & 0xFFFFu, ks[3] = a.y >> 16;
    vs[0] = c.x & 0xFFFFu, vs[1] = c.x >> 16, vs[2] = c.y & 0xFFFFu, vs[3] = c.y >> 16;
  }
  uint32_t cs[8] = {};  // *_KC keys: (s, m) of the thread's 8 channels, the same for every row of the page
  if constexpr (IsKC(F)) {
    const uint4* p = reinterpret_cast<const uint4*>(pg + fi.k_scales + (static_cast<uint32_t>(hk) * D + d0) * 4u);
    const uint4 a = __ldg(p), c = __ldg(p + 1);
    cs[0] = a.x, cs[1] = a.y, cs[2] = a.z, cs[3] = a.w, cs[4] = c.x, cs[5] = c.y, cs[6] = c.z, cs[7] = c.w;
  }
  const uint32_t off = (static_cast<uint32_t>(d0) * kBits) / 8u;
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    if (!want[u]) {
#pragma unroll
      for (int i = 0; i < kEPT; ++i) kf[u][i] = vf[u][i] = 0.0f;
      continue;
    }
    const uint4 kw = LoadPiece<F>(g + u * fi.row_bytes + off);
    if constexpr (IsKC(F)) {
      constexpr uint32_t mask = (1u << kBits) - 1u;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        kf[u][i] = fmaf(__uint_as_float(((kw.x >> (kBits * i)) & mask) | 0x4B000000u) - 8388608.0f, H(cs[i] & 0xFFFFu),
                        H(cs[i] >> 16));
    } else {
      DecodePiece<F>(kw, ks[u], false, kf[u]);
    }
    DecodePiece<F>(LoadPiece<F>(g + 64 * TPK + u * fi.row_bytes + off), vs[u], false, vf[u]);
  }
}

#define ORTKV_PAGED_FORMAT_SWITCH(f, CALL) \
  switch (f) {                             \
    case 0: CALL(0); break;                \
    case 1: CALL(1); break;                \
    case 2: CALL(2); break;                \
    case 3: CALL(3); break;                \
    case 4: CALL(4); break;                \
    case 5: CALL(5); break;                \
    case 6: CALL(6); break;                \
    default: CALL(7); break;               \
  }

template <typename T, int TPK, int GM>
__global__ void __launch_bounds__(kThreads) PagedAttentionV2(const AttnArgs args) {
  extern __shared__ __align__(16) unsigned char dsm[];
  Smem& sm = *reinterpret_cast<Smem*>(dsm);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
  const PagedAttentionCudaView& a = args.v;
  constexpr int kNkg = kThreads / TPK;
  constexpr int64_t kPerIt = static_cast<int64_t>(kNkg) * kU;

  const int64_t S = a.splits;
  int64_t blk = blockIdx.x;
  const int64_t split = blk % S;
  blk /= S;
  const int64_t hb = blk % args.head_blocks;
  const int64_t unit = blk / args.head_blocks;
  const int64_t t = unit % a.T;
  const int hk = static_cast<int>((unit / a.T) % a.Hkv);
  const int64_t b = unit / (a.T * a.Hkv);
  const int64_t G = a.Hq / a.Hkv;
  const int64_t g0 = hb * GM;
  const int gn = static_cast<int>(G - g0 < GM ? G - g0 : GM);
  const int D = static_cast<int>(a.D);
  const int ps = a.p.shape.page_size;  // a multiple of kU (the launch checks)
  if (threadIdx.x == 0) sm.w.key = kNoError;  // read and written only after the barriers below

  bool bad_start = false;
  const int64_t st = ClampedStart(a, b, &bad_start);
  const int64_t L = st + t + 1;
  int64_t j0, j1;
  SplitKeys<1>(L, S, split, &j0, &j1);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane & (TPK - 1);
  const int kg = tid / TPK;
  const int d0 = sub * kEPT;
  const bool dv = d0 < D;

  LoadFormats(a, tid, sm.w);

  const float qscale = a.scale * 1.4426950408889634f;
  const T* qp = static_cast<const T*>(a.q) + ((b * a.T + t) * a.Hq + hk * G + g0) * a.D;
  float qf[GM][kEPT];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    if (g < gn) {
      LoadQ<T, true>(qp + g * a.D, d0, D, qf[g]);
#pragma unroll
      for (int i = 0; i < kEPT; ++i) qf[g][i] *= qscale;
    } else {
#pragma unroll
      for (int i = 0; i < kEPT; ++i) qf[g][i] = 0.0f;
    }
  }
  float m[GM], l[GM], acc[GM][kEPT];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < kEPT; ++i) acc[g][i] = 0.0f;
  }

  bool skip = false;
  for (int64_t s0 = j0; s0 < j1;) {
    const auto [p0, s1, p1] = pv2::WindowAt(s0, j1, ps);
    uint32_t formats = 0;
    if (ResolveWindow(a, b, p0, p1, tid, sm.w, &formats)) {
      skip = true;
      break;
    }

    // key groups of kU consecutive keys, aligned to kU (so within one page); the window's keys are
    // [s0, s1); a group's keys outside it are neither copied nor counted
    const int64_t a0 = s0 & ~static_cast<int64_t>(kU - 1);
    const int base_off = static_cast<int>(a0 - p0 * ps);  // >= 0: p0 * ps is a multiple of kU
    const int win = static_cast<int>(s1 - a0);
    const int lo = static_cast<int>(s0 - a0);
    const int n_it = (win + static_cast<int>(kPerIt) - 1) / static_cast<int>(kPerIt);
    const uint32_t hrow = static_cast<uint32_t>(hk) * ps;
    int on = kg * kU;  // offset (from a0) of the next group to copy
    int stage_in = 0;
    auto issue = [&]() {
      if (on < win && on + kU > lo) {  // every thread of the group copies (D < 8 * TPK included)
        const int o = base_off + on;
        const int lp = o / ps;
        const uint32_t row0 = hrow + static_cast<uint32_t>(o - lp * ps);
        const int f = sm.w.fmt[lp];
        const FormatInfo& fi = sm.w.fi[f];
        const uint8_t* pg = sm.w.page[lp];
        uint8_t* g = reinterpret_cast<uint8_t*>(sm.ring) + stage_in * kStageBytes + kg * GroupBytes<TPK>();
#define ORTKV_ISSUE(F) IssueGroup<F, TPK>(g, pg, fi, row0, sub)
        ORTKV_PAGED_FORMAT_SWITCH(f, ORTKV_ISSUE)
#undef ORTKV_ISSUE
      }
      CpAsyncCommit();
      on += static_cast<int>(kPerIt);
      stage_in = stage_in + 1 == kStages ? 0 : stage_in + 1;
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) issue();

    int oc = kg * kU;  // offset of the group being computed
    int stage = 0;
    for (int it = 0; it < n_it; ++it, oc += static_cast<int>(kPerIt), stage = stage + 1 == kStages ? 0 : stage + 1) {
      CpAsyncWait<kStages - 2>();
      __syncwarp();  // the group's copies of this stage are complete and visible to the whole group, and
                     // every thread is done reading the stage the next issue() refills
      issue();
      bool ok[kU];
      bool any = false;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        ok[u] = oc + u >= lo && oc + u < win;
        any = any || ok[u];
      }
      float kf[kU][kEPT], vf[kU][kEPT];
      if (any && dv) {
        const int lp = (base_off + oc) / ps;
        const int f = sm.w.fmt[lp];
        const FormatInfo& fi = sm.w.fi[f];
        const uint8_t* g = reinterpret_cast<const uint8_t*>(sm.ring) + stage * kStageBytes + kg * GroupBytes<TPK>();
#define ORTKV_DECODE(F) DecodeGroup<F, TPK>(g, sm.w.page[lp], fi, hk, D, d0, ok, kf, vf)
        ORTKV_PAGED_FORMAT_SWITCH(f, ORTKV_DECODE)
#undef ORTKV_DECODE
      } else {
#pragma unroll
        for (int u = 0; u < kU; ++u)
#pragma unroll
          for (int i = 0; i < kEPT; ++i) kf[u][i] = vf[u][i] = 0.0f;
      }
      // scores (the shuffles need every thread: keys outside the window score -inf below)
      float sc[GM][kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
#pragma unroll
        for (int g = 0; g < GM; ++g) {
          float s = 0.0f;
#pragma unroll
          for (int i = 0; i < kEPT; ++i) s = fmaf(qf[g][i], kf[u][i], s);
#pragma unroll
          for (int off = TPK >> 1; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
          sc[g][u] = ok[u] ? s : -INFINITY;
        }
      }
      if (!any) continue;
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        float mb = sc[g][0];
#pragma unroll
        for (int u = 1; u < kU; ++u) mb = fmaxf(mb, sc[g][u]);
        if (mb > m[g]) {
          const float corr = Exp2(m[g] - mb);
          l[g] *= corr;
#pragma unroll
          for (int i = 0; i < kEPT; ++i) acc[g][i] *= corr;
          m[g] = mb;
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) sc[g][u] = Exp2(sc[g][u] - m[g]);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (!ok[u]) continue;  // a key outside the window: its (unread) values never enter the sum
#pragma unroll
        for (int g = 0; g < GM; ++g) {
          const float p = sc[g][u];
          l[g] += p;
#pragma unroll
          for (int i = 0; i < kEPT; ++i) acc[g][i] = fmaf(p, vf[u][i], acc[g][i]);
        }
      }
    }
    CpAsyncWait<0>();
    s0 = s1;
  }
  if (skip) {  // a bad page in the chunk: its output / partial is empty (reported by the epilogue)
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      m[g] = -INFINITY;
      l[g] = 0.0f;
#pragma unroll
      for (int i = 0; i < kEPT; ++i) acc[g][i] = 0.0f;
    }
  }
  CpAsyncWait<0>();
  __syncthreads();
  if (threadIdx.x == 0) {  // every block writes its key: no memset of the flags before the launch
    const unsigned long long sk = bad_start ? Key(kClassRow, static_cast<unsigned long long>(b) << 28) : kNoError;
    a.block_flags[blockIdx.x] = sk < sm.w.key ? sk : sm.w.key;
  }
  Merge<GM>& mg = *reinterpret_cast<Merge<GM>*>(sm.ring);
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    float mw = m[g];
#pragma unroll
    for (int off = 16; off >= TPK; off >>= 1) mw = fmaxf(mw, __shfl_xor_sync(0xffffffffu, mw, off));
    if (lane == 0) mg.m[warp][g] = mw;
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    float mb = mg.m[0][g];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) mb = fmaxf(mb, mg.m[w][g]);
    const float fct = m[g] == -INFINITY ? 0.0f : Exp2(m[g] - mb);
    float lw = l[g] * fct;
    float aw[kEPT];
#pragma unroll
    for (int i = 0; i < kEPT; ++i) aw[i] = acc[g][i] * fct;
#pragma unroll
    for (int off = 16; off >= TPK; off >>= 1) {
      lw += __shfl_xor_sync(0xffffffffu, lw, off);
#pragma unroll
      for (int i = 0; i < kEPT; ++i) aw[i] += __shfl_xor_sync(0xffffffffu, aw[i], off);
    }
    if (lane < TPK) {
#pragma unroll
      for (int i = 0; i < kEPT; ++i)
        if (d0 + i < D) mg.acc[warp][g][d0 + i] = aw[i];
      if (lane == 0) mg.l[warp][g] = lw;
    }
  }
  __syncthreads();
  for (int x = tid; x < gn * D; x += kThreads) {
    const int g = x / D, d = x % D;
    float lb = 0.0f, ab = 0.0f, mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      lb += mg.l[w][g];
      ab += mg.acc[w][g][d];
      mb = fmaxf(mb, mg.m[w][g]);
    }
    const int64_t head = hk * G + g0 + g;
    if (S == 1) {
      T* o = static_cast<T*>(a.out) + ((b * a.T + t) * a.Hq + head) * a.D;
      o[d] = FromF<T>(lb > 0.0f ? ab / lb : 0.0f);
    } else {
      float* p = a.partial + ((unit * G + g0 + g) * S + split) * (a.D + 2);
      p[d] = ab;
      if (d == 0) {
        p[a.D] = mb;
        p[a.D + 1] = lb;
      }
    }
  }
}

int CurrentMajor() {
  static const int major = [] {
    int dev = 0, mj = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&mj, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return mj;
  }();
  return major;
}

// The base-2 combine after a v2 / v3 attention (a.v.splits: the trimmed split count): reports the blocks'
// failure keys (one block) and merges the partials (one block per unit and query head when splits > 1); a
// programmatic dependent on sm_90+ (Note [CacheAttention CUDA v2 waves]).
template <typename T>
cudaError_t LaunchCombine(const AttnArgs& a, cudaStream_t stream) {
  const unsigned combine_blocks = a.v.splits > 1 ? static_cast<unsigned>(a.v.units() * a.v.group()) + 1u : 1u;
  const int threads = CombineThreads(a.v.splits, a.v.D);  // Note [Combine in one load round]
  if (CurrentMajor() >= 9 && LaunchProgrammatic(PagedCombineKernel<T, true>, combine_blocks, threads, 0, stream, a))
    return cudaSuccess;
  PagedCombineKernel<T, true><<<combine_blocks, threads, 0, stream>>>(a);  // refused or before sm_90
  return cudaGetLastError();
}

template <typename T, int TPK, int GM>
cudaError_t LaunchOne(AttnArgs a, cudaStream_t stream) {
  static const int per_sm = [] {
    (void)cudaFuncSetAttribute(PagedAttentionV2<T, TPK, GM>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(sizeof(Smem)));
    (void)cudaFuncSetAttribute(PagedAttentionV2<T, TPK, GM>, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
    (void)cudaGetLastError();
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, PagedAttentionV2<T, TPK, GM>, kThreads, sizeof(Smem)) !=
            cudaSuccess || n < 1) {
      (void)cudaGetLastError();
      n = 3;
    }
    return n;
  }();
  const int64_t base = a.v.units() * a.head_blocks;
  if (a.v.splits > 1 && a.v.sm_count > 0)  // one wave (Note [CacheAttention CUDA v2 waves])
    a.v.splits = std::max<int64_t>(1, std::min<int64_t>(a.v.splits, static_cast<int64_t>(per_sm) * a.v.sm_count / base));
  PagedAttentionV2<T, TPK, GM><<<static_cast<unsigned>(base * a.v.splits), kThreads, sizeof(Smem), stream>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  return LaunchCombine<T>(a, stream);
}

template <typename T, int TPK>
cudaError_t LaunchTpk(const AttnArgs& a, int gm, cudaStream_t stream) {
  switch (gm) {
    case 1: return LaunchOne<T, TPK, 1>(a, stream);
    case 2: return LaunchOne<T, TPK, 2>(a, stream);
    case 3: return LaunchOne<T, TPK, 3>(a, stream);
    case 4: return LaunchOne<T, TPK, 4>(a, stream);
    default: return LaunchOne<T, TPK, 8>(a, stream);
  }
}

template <typename T>
cudaError_t Launch(const AttnArgs& a, int gm, cudaStream_t stream) {
  if (a.v.D <= 64) return LaunchTpk<T, 8>(a, gm, stream);
  if (a.v.D <= 128) return LaunchTpk<T, 16>(a, gm, stream);
  return LaunchTpk<T, 32>(a, gm, stream);
}

}  // namespace pv2

// ---- PagedCacheAttention v3: Note [Paged CUDA v3] ----------------------------------------------------
// Note [Paged CUDA one-launch report]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A v2 / v3 attention block writes its first failure key (kNoError if none) to block_flags, and the combine's last
// block reports the smallest (Note [Paged CUDA v2]): the CPU plan's first failure. With one split that combine had
// nothing else to do, yet it was a second launch in every short-row node (H200, paged_sweep, 16 keys x 1 row: F16
// promised 4.10 -> 2.96 us, INT4 7.20 -> 5.14 us without it; benchmarks/results/paged_attention_cuda_h200.md). When
// the node has one split and one batch row (one sequence whose page table is narrower than 2 x kAttnCudaMinChunk keys:
// the splits come from the table's width; the launch decides after trimming them, so a graph's shape is stable),
// every block of token t resolves the same pages [0, start + t], so the block of the last token (KV head 0, head
// block 0) holds the smallest key of the whole node and reports it itself; the v3 and uniform kernels then launch
// nothing after the attention, as dense CacheAttention. Several rows: a block cannot know that the rows before its
// own are fine, so the blocks count themselves and the last reports (Note [Paged CUDA last block reports]). With
// 2..8 splits the same holds of each cluster (Note [Paged CUDA cluster merge]).
__host__ __device__ __forceinline__ bool ReportsInBlock(const PagedAttentionCudaView& v) {
  return v.splits == 1 && v.B == 1;
}

// Note [Paged CUDA last block reports]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// One split over several rows (every decode step at batch > 1 whose rows fit the 256-key table bucket) has no
// partials to merge, yet no block can know that the rows before its own are fine, so the node launched the combine
// for its one scan block: a second kernel a node. Instead the node's blocks meet in two device words of their own
// (PagedReportWords: one pair per node and stream, made at the node's first launch there, outside any capture):
// word 0 counts the blocks in its low 32 bits and the failed blocks above them, word 1 holds the smallest failure
// key. Thread 0 of each block (the uniform kernel's last thread: Note [Uniform key thread]), its key final and
// before the merge, atomicMins a failure into word 1 and fences (a failed block only), then adds itself to word 0;
// it reads what atomicAdd returned after the merge, so the round trip overlaps it. The block that counted last
// (gridDim.x - 1 before it) sets word 0 back to 0 and, if any block failed, takes word 1 (atomicExch with kNoError)
// and reports it: the smallest key of the node, the CPU plan's first failure. So the words are 0 / kNoError again
// when the grid ends, and the next launch on the stream (stream order, or after griddepcontrol.wait: a block counts
// itself after its wait) starts from them; a CUDA graph replays the same pair. Two streams never share a pair.
// Without a pair (none could be made: the node's first launch on that stream was captured) the node keeps the scan
// block.
// H200 (benchmarks/results/paged_attention_cuda_h200.md, thirteenth session), combine scan -> last block:
// paged_sweep, two alternated rounds, 16 keys x 8 rows promised F16 3.62 -> 2.75 us, every-format F16 4.27 -> 3.49,
// INT4 6.09 -> 4.71 (counted after the merge instead, the round trip at the block's end: F16 2.93; with a fence in
// every block: 3.22; no count and no report at all, the floor: 2.49); single-row nodes (ReportsInBlock, unchanged
// code) +0.02-0.04 us. Through ORT (bench_paged_attention_cuda.py), promised F16 with static tables / dense: 16 x 8
// 1.27 -> 0.99, 144 keys x 8 rows in a 256-key table (a batch-8 decode step's node) 1.22 -> 1.02; INT4 there 6.4
// -> 5.0 us. The paged decode step at batch 8 (bench_paged_generate_cuda.py; this change and 2d9aea9's update
// kernel against 73dcd2a): 1.11 -> 1.03x dense at 2K max length, 1.13 -> 1.06x at 8K.
__host__ __device__ __forceinline__ bool LastBlockReports(const PagedAttentionCudaView& v) {
  return v.splits == 1 && v.B > 1 && v.report_words != nullptr;
}

// Note [Paged CUDA cluster merge]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// One batch row with 2..8 splits (a sequence's decode over a page table wider than 2 x kAttnCudaMinChunk keys and at
// most ~2K keys: the splits come from the table's width) and at most one block per SM: the v3 and uniform kernels
// are launched as clusters of the unit's split blocks and merge through distributed shared memory (Note [Cluster
// merge] in tile_mma.cuh, as dense CacheAttention v3), with no partials and no combine launch. Between the cluster
// barriers rank 0 also takes the smallest of its ranks' failure keys (all ranks' keys loaded together, Note [Cluster
// merge loads]; only when a rank flagged a failure or `start` is bad: Note [Cluster merge flag]): the unit's key over
// all its pages, the same in every cluster of the last token, whose (KV head 0, head block 0) cluster reports it
// (Note [Paged CUDA one-launch report]). Only the early instantiation is
// clustered: its griddepcontrol.wait returns at once when the launch is not programmatic (ORTKV_CUDA_EARLY=0).
// H200, paged_sweep, cluster vs combine, us (2026-12-03 fifth session, when rank 0 read its ranks one after the
// other): one row in a table of 2K keys (8 splits), every-format F16 5.97 vs 5.88, INT8 6.39 vs 6.77, INT4 7.52 vs
// 8.46, uniform F16 16 keys 5.34 vs 4.95 (so the uniform kernel clustered 2..4 splits only); with the loads in flight
// together (2026-12-04): uniform F16 16 / 128 keys in a 2K table 3.82 / 4.24 clustered vs 4.36 / 4.77 with the
// combine, so both kernels now cluster 2..8 splits (benchmarks/results/paged_attention_cuda_h200.md).
inline bool ClusterMerges(const PagedAttentionCudaView& v, int64_t blocks, int max_cluster) {
  return v.B == 1 && v.splits >= 2 && v.splits <= max_cluster && blocks <= v.sm_count;
}

// The launch of a decode attention kernel of kThreads threads as its plain, early (Note [CUDA attention early start])
// and clustered instantiations, shared by v3 and the uniform kernel: MakeKernels once per kernel (dynamic shared
// memory and carveout set on all three; the plain one's occupancy), then LaunchOneWave: the splits trimmed to one
// wave (Note [CacheAttention CUDA v2 waves]), the clustered launch where it applies, else the early launch where it
// can be made, then the combine unless the kernel reports itself.
using AttnKernel = void (*)(const AttnArgs);
struct AttnKernels {
  AttnKernel plain, early, cluster;
  size_t smem, cluster_smem;
  int max_cluster, per_sm;
  AttnKernel inblock = nullptr;  // the early kernel of nodes that report in their block (Note [Uniform in-block report])
  int threads = kThreads;        // a block's threads (Note [Uniform INT4 single-row warps]: 256)
};
AttnKernels MakeKernels(AttnKernel plain, AttnKernel early, AttnKernel cluster, size_t smem, size_t cluster_smem,
                        int max_cluster, AttnKernel inblock = nullptr, int threads = kThreads) {
  AttnKernels k{plain, early, cluster, smem, cluster_smem, max_cluster, 2, inblock, threads};
  for (AttnKernel f : {plain, early, cluster, inblock}) {
    if (f == nullptr) continue;
    (void)cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(f == cluster ? cluster_smem : smem));
    (void)cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  }
  (void)cudaGetLastError();
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, plain, threads, smem) != cudaSuccess || n < 1) {
    (void)cudaGetLastError();
  } else {
    k.per_sm = n;
  }
  return k;
}
template <typename T>
cudaError_t LaunchOneWave(const AttnKernels& k, AttnArgs a, cudaStream_t stream) {
  const int64_t base = a.v.units() * a.head_blocks;
  if (a.v.splits > 1 && a.v.sm_count > 0)  // one wave (Note [CacheAttention CUDA v2 waves])
    a.v.splits =
        std::max<int64_t>(1, std::min<int64_t>(a.v.splits, static_cast<int64_t>(k.per_sm) * a.v.sm_count / base));
  const unsigned blocks = static_cast<unsigned>(base * a.v.splits);
  const bool sm90 = pv2::CurrentMajor() >= 9, early = sm90 && CudaEarlyLaunch();
  if (sm90 && ClusterMerges(a.v, blocks, k.max_cluster) &&  // Note [Paged CUDA cluster merge]
      LaunchEx(k.cluster, blocks, static_cast<unsigned>(k.threads), k.cluster_smem, stream,
               static_cast<unsigned>(a.v.splits), early, a))
    return cudaSuccess;
  // Note [CUDA attention early start]
  const AttnKernel ek = k.inblock != nullptr && ReportsInBlock(a.v) ? k.inblock : k.early;
  if (!(early && LaunchProgrammatic(ek, blocks, static_cast<unsigned>(k.threads), k.smem, stream, a)))
    k.plain<<<blocks, k.threads, k.smem, stream>>>(a);
  cudaError_t e = cudaGetLastError();
  // Note [Paged CUDA one-launch report], Note [Paged CUDA last block reports]
  if (e != cudaSuccess || ReportsInBlock(a.v) || LastBlockReports(a.v)) return e;
  return pv2::LaunchCombine<T>(a, stream);
}

// The (split, head block, unit = (row, KV head, token)) a block of the v3 / uniform kernels serves, from its
// blockIdx (split fastest), and its query heads g0 .. g0 + gn - 1 of the group of G (one head block for G <= 8, else
// 8 heads each).
struct BlockUnit {
  int64_t split, unit, t, b, G, g0;
  int hk, gn;
};
__device__ __forceinline__ BlockUnit BlockUnitOf(const AttnArgs& args) {
  const PagedAttentionCudaView& a = args.v;
  BlockUnit u;
  int64_t blk = blockIdx.x;
  u.split = blk % a.splits;
  blk /= a.splits;
  const int64_t hb = blk % args.head_blocks;
  u.unit = blk / args.head_blocks;
  u.t = u.unit % a.T;
  u.hk = static_cast<int>((u.unit / a.T) % a.Hkv);
  u.b = u.unit / (a.T * a.Hkv);
  u.G = a.Hq / a.Hkv;
  u.g0 = hb * 8;
  u.gn = static_cast<int>(u.G - u.g0 < 8 ? u.G - u.g0 : 8);
  return u;
}

// Thread 0 of an attention block, its key final: to block_flags for the combine (before the merge, as the key is
// known), or under ReportsInBlock (after the merge, where the report's code costs the loop no registers) the report
// itself from the block that holds the node's smallest key. Under LastBlockReports the block counts itself into the
// node's words before the merge, and after it the last to count reports (Note [Paged CUDA last block reports]):
// StoreBlockKey returns word 0 before its own count, ReportBlockKey reads it (`counted`).
constexpr unsigned long long kFailedBlock = 1ull << 32;  // word 0: arrivals in the low half, failed blocks above
__device__ __forceinline__ unsigned long long StoreBlockKey(const PagedAttentionCudaView& a, unsigned long long key) {
  if (LastBlockReports(a)) {
    unsigned long long add = 1;
    if (key != kNoError) {
      atomicMin(a.report_words + 1, key);
      __threadfence();  // the key before the count
      add += kFailedBlock;
    }
    return atomicAdd(a.report_words, add);  // read after the merge: the round trip overlaps it
  }
  if (!ReportsInBlock(a)) a.block_flags[blockIdx.x] = key;
  return 0;
}
__device__ __forceinline__ void ReportBlockKey(const PagedAttentionCudaView& a, const BlockUnit& bu,
                                               unsigned long long key, unsigned long long counted) {
  if (LastBlockReports(a)) {
    if ((counted & 0xFFFFFFFFull) != gridDim.x - 1ull) return;
    atomicExch(a.report_words, 0ull);  // the words as the next launch expects them
    if (counted >= kFailedBlock || key != kNoError) {  // a block failed: its key is in word 1 (atomics, at L2)
      const unsigned long long node_key = atomicExch(a.report_words + 1, kNoError);
      if (node_key != kNoError) ReportAttention(a, node_key);
    }
    return;
  }
  if (ReportsInBlock(a) && key != kNoError && bu.split == 0 && bu.hk == 0 && bu.g0 == 0 && bu.t == a.T - 1)
    ReportAttention(a, key);
}

// A failed block's l in a clustered launch's `fin` (Note [Cluster merge flag] in tile_mma.cuh).
__device__ __forceinline__ float NanL() { return __int_as_float(0x7fc00000); }
// Thread 0 of a cluster's rank 0 between the cluster barriers (Note [Paged CUDA cluster merge]): the smallest of the
// ranks' failure keys (`key`: each block's in its shared memory), reported by the cluster that holds the node's.
// Called only where a rank flagged a failure or `start` is bad (Note [Cluster merge flag]).
template <typename Cluster>
__device__ __forceinline__ void ClusterReport(const PagedAttentionCudaView& a, const BlockUnit& bu,
                                              unsigned long long* key, Cluster& cl) {
  if (threadIdx.x != 0 || bu.hk != 0 || bu.g0 != 0 || bu.t != a.T - 1) return;
  unsigned long long k = kNoError;
#pragma unroll
  for (int r = 0; r < tile16::kMaxClusterRanks; ++r) {  // all loads in flight together (Note [Cluster merge loads])
    const unsigned long long x = r < a.splits ? *cl.map_shared_rank(key, r) : kNoError;
    k = x < k ? x : k;
  }
  if (k != kNoError) ReportAttention(a, k);
}

// The output row of query head g0 + gg of a block's unit.
template <typename T>
__device__ __forceinline__ T* OutRow(const PagedAttentionCudaView& a, const BlockUnit& bu, int gg) {
  return static_cast<T*>(a.out) + ((bu.b * a.T + bu.t) * a.Hq + bu.hk * bu.G + bu.g0 + gg) * a.D;
}
// A clustered launch's `fin` after the kernel's own shared memory: [8 query heads][D + 2] floats (Note [Cluster
// merge]).
template <int D>
constexpr size_t kFinBytes = 8 * (D + 2) * sizeof(float);

// A block's merged result for query head g0 + gg, element d (MergeWarpTiles' emit, base 2) without a cluster: the
// output itself when the row has one split, else this split's partial [acc, m, l] for the combine. A clustered
// block writes its partial to `fin` instead (Note [Uniform fin stores]).
template <typename T>
__device__ __forceinline__ void EmitMerged(const PagedAttentionCudaView& a, const BlockUnit& bu, int gg, int d,
                                           float mb, float lb, float ab) {
  const int64_t S = a.splits;
  if (S == 1) {
    OutRow<T>(a, bu, gg)[d] = FromF<T>(lb > 0.0f ? ab / lb : 0.0f);
    return;
  }
  float* p = a.partial + ((bu.unit * bu.G + bu.g0 + gg) * S + bu.split) * (a.D + 2);
  p[d] = ab;
  if (d == 0) {
    p[a.D] = mb;
    p[a.D + 1] = lb;
  }
}

// A v3 / uniform block's merged result for head gg, element d: with a cluster, into `fin` for the cluster's rank 0 at
// the compile-time head size (Note [Uniform fin stores]), l = NaN in a failed block (Note [Cluster merge flag]);
// else EmitMerged.
template <typename T, int D, bool CLUSTER>
__device__ __forceinline__ void EmitBlock(const PagedAttentionCudaView& a, const BlockUnit& bu, float* fin,
                                          bool failed, int gg, int d, float mb, float lb, float ab) {
  if constexpr (CLUSTER) {
    tile16::StoreFin<D>(fin, gg, d, mb, failed ? NanL() : lb, ab);
  } else {
    EmitMerged<T>(a, bu, gg, d, mb, lb, ab);
  }
}

// Note [Paged CUDA v3]
// ~~~~~~~~~~~~~~~~~~~~
// v2 (Note [Paged CUDA v2]) keeps HBM busy but is bound by instruction issue: for every key row its
// threads do the query heads' dot products and the value sums in FP32 (~30 warp instructions per key
// row at head size 64), so a page that moves 4x fewer bytes (INT4) was no faster than an F16 page. v3
// moves those products onto the tensor cores (mma.sync m16n8k16, FP32 accumulators):
//   * A warp owns whole tiles of 16 consecutive keys (page_size % 16 == 0: a tile lies in one page) and
//     streams them through its own kStages-deep cp.async ring; no block barrier inside the key loop.
//   * Pages of the queries' 16-bit type are copied straight into a 16-bit tile [16 keys][D] in shared
//     memory, 16-byte chunks swizzled by (row & 7) so ldmatrix reads them without bank conflicts. Every
//     other page (INT8, FP8, INT4, INT2, the per-channel key formats, and the other 16-bit type) copies
//     its payload and scales raw (fewer bytes) and the warp decodes them IN PLACE into that tile (each lane first loads its pieces into
//     registers, __syncwarp, then stores the 16-bit values): the decode is the same per-format code as
//     v2 (DecodePiece), run once per value instead of once per value and query head.
//   * S = Q K^T: A = the group's query heads (rows 0..7, padding rows zero; scale * log2(e) folded in,
//     rounded to the tile's 16-bit type), B = the key tile via ldmatrix (its row-major [key][D] IS the
//     "col" operand). P V: A = the probabilities, taken from S's accumulators without a shuffle (the
//     C layout of two n-tiles is the A layout of one k-step), B = the value tile via ldmatrix.trans.
//     The products run in the queries' 16-bit type (float16 or bfloat16; bfloat16 P against a float16
//     reference failed the float16 tolerance on the H200). A BF16 page under float16 queries becomes
//     float16 (its values came from float16 queries, so they fit).
//   * Online softmax in base 2 per query head (a quad of lanes holds one head's scores), lazy rescale
//     as v2. Keys of a tile outside the block's window score -inf, and their value rows are zeroed
//     before the product (0 * NaN would poison the sum: rows past a sequence's length are never
//     trusted, as the NaN-poisoned tests check).
//   * Page resolution (windows of kMaxPages pages in shared memory, every check of PageProblem), the
//     per-block failure keys, the one-wave split count, the base-2 partials and the PDL combine are
//     v2's. Precision: Q and P are rounded to 16 bits before the products (FlashAttention's choice);
//     accumulation is FP32.
// v3 runs for float16 / bfloat16 queries with head size 64 or 128, page_size % 16 == 0, no page_fill;
// ORTKV_CUDA_ATTENTION=v2 (or v1) selects the older kernels for A/B runs. H200 (SmolLM2 heads, pages of 16,
// benchmarks/results/paged_attention_cuda_h200.md): F16 pages 1.05-1.21x dense v3's time since Note [Paged CUDA v3
// ring alignment] (1.27-1.39x before), 0.72-0.79x v2's. Narrow pages decoded in place through shared memory were no
// faster than F16 ones (INT4 0.99-1.12x: that per-tile chain, not the bytes, set the pace); INT4 and INT8 under
// float16 queries now decode into the mma operand registers (Note [Paged CUDA v3 register decode]).
namespace pv3 {

using pv2::Bits;
using pv2::DecodePiece;
using pv2::FormatInfo;
using pv2::IsKC;
using pv2::kMaxPages;
using pv2::LoadPiece;
using pv2::ScaleBytes;

using tile16::kTile;
using tile16::LdMatrix4;
using tile16::LdMatrix4T;
using tile16::LoadQueryPairs;
using tile16::MergeWarpTiles;
using tile16::Mma;
using tile16::Pack2;
using tile16::QuadMaxRescale;
using tile16::QueryFragments;
using tile16::Sw;
using tile16::TileProducts;
using tile16::ZeroInvalidV;

template <int D>
struct Cfg {
#ifndef ORTKV_PAGED_V3_STAGES64  // ring depth at head size 64 (an A/B knob for benchmarks/cuda/paged_sweep.cu)
#define ORTKV_PAGED_V3_STAGES64 3
#endif
  static constexpr int kStages = D <= 64 ? ORTKV_PAGED_V3_STAGES64 : 2;
  static constexpr int kRegion = kTile * D * 2;          // one tile of K (or V) as 16-bit values
  static constexpr int kStageBytes = 2 * kRegion + 128;  // K, V, then 64 bytes of K scales and of V scales
  static constexpr int kWarpBytes = kStages * kStageBytes;
  static constexpr int kRingBytes = kWarps * kWarpBytes;
  static constexpr int kCh = D / 8;  // 16-byte chunks per 16-bit row
};

using pv2::PageWindow;

using Merge = WarpMerge<kWarps, 8>;  // up to 8 query heads per block

// Note [Paged CUDA v3 ring alignment]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The ring starts on a 128-byte boundary after the page window. Its tiles' 128-byte rows are swizzled in
// 16-byte chunks (tile16::Sw) on the assumption that a row IS one 128-byte line of shared memory; at the
// 16-byte boundary the ring used to start on (sizeof(PageWindow) = 2,504 bytes -> offset 2,512 = 80 mod 128)
// every row straddled two lines. ncu on the H200 (F16 pages, 32K keys x 8 rows, SmolLM2 heads): the same
// cp.async count and DRAM bytes as dense v3, but 4.1x the L2 requests (6.44 M vs 1.58 M: the copies were no
// longer coalesced) and 2x the L2 sectors, half of them hits, plus ldmatrix bank conflicts (short scoreboard
// stalls 28 % vs dense 16 %): 1.27-1.39x dense's time, with every earlier change to the loop moving nothing.
constexpr size_t kRingOffset = (sizeof(PageWindow) + 127) / 128 * 128;

template <int D>
constexpr size_t SmemBytes() {
  return kRingOffset + Cfg<D>::kRingBytes;
}
static_assert(sizeof(Merge) <= Cfg<64>::kRingBytes && sizeof(Merge) <= Cfg<128>::kRingBytes, "");

// Copies the tile's 16 rows of K and V (rows row0 .. row0 + 15 of the page's K / V payload) into stage st.
template <int F, int D, bool DIRECT>
__device__ __forceinline__ void IssueTile(uint8_t* st, const uint8_t* pg, const FormatInfo& fi, uint32_t row0,
                                          int lane) {
  using C = Cfg<D>;
  const uint8_t* ks = pg + row0 * fi.row_bytes;
  const uint8_t* vs = pg + fi.v_payload + row0 * fi.row_bytes;
  if constexpr (DIRECT) {  // the page's 16-bit type is the products' type: straight into the swizzled tile
#pragma unroll
    for (int i = lane; i < kTile * C::kCh; i += 32) {
      const int r = i / C::kCh, ch = i % C::kCh;
      CpAsync<16>(st + Sw<D>(r, ch), ks + r * (D * 2) + ch * 16);
      CpAsync<16>(st + C::kRegion + Sw<D>(r, ch), vs + r * (D * 2) + ch * 16);
    }
  } else {
    const uint32_t bytes = kTile * fi.row_bytes;  // a multiple of 16: D % 16 == 0
    for (uint32_t c = static_cast<uint32_t>(lane) * 16u; c < bytes; c += 512u) {
      CpAsync<16>(st + c, ks + c);
      CpAsync<16>(st + C::kRegion + c, vs + c);
    }
    constexpr int kSc = ScaleBytes(F) * kTile / 16;  // 16-byte pieces of one tile's scales: 0, 2 or 4
    const uint32_t so = row0 * static_cast<uint32_t>(ScaleBytes(F));
    if (!IsKC(F) && lane < kSc) CpAsync<16>(st + 2 * C::kRegion + lane * 16, pg + fi.k_scales + so + lane * 16);
    if (lane >= 4 && lane < 4 + kSc)
      CpAsync<16>(st + 2 * C::kRegion + 64 + (lane - 4) * 16, pg + fi.v_scales + so + (lane - 4) * 16);
  }
}

template <bool BF>
__device__ __forceinline__ uint4 Pack8(const float* x) {
  uint4 w;
  w.x = Pack2<BF>(x[0], x[1]);
  w.y = Pack2<BF>(x[2], x[3]);
  w.z = Pack2<BF>(x[4], x[5]);
  w.w = Pack2<BF>(x[6], x[7]);
  return w;
}

// Decodes a raw tile (a narrow format, or the other 16-bit type) in place into the swizzled 16-bit tiles of
// the products' type (BF: bfloat16, else float16); rows not in `valid` (bit r) become zeros. Every lane loads
// all its pieces before any lane stores.
// Note [Half2 decode]: for float16 products (Note [Paged CUDA v3]) the narrow formats decode straight into
// packed float16 pairs instead of 8 FP32 values rounded afterwards (~2.3x fewer instructions for INT4: the
// decode, not the bytes, set the pace of narrow tiles). A code c of 4 / 2 bits (or a byte u) ORed under the
// exponent of 1024.0h IS the float16 1024 + c (the mantissa has 10 bits), so one LOP3 makes two of them; the
// subtraction of 1024 (1152 for INT8's offset byte) is exact, and the one rounding is the final
// hfma2(c, s, m) / hmul2(c, s): the FP32 path rounded twice (FP32 FMA, then to float16), so the two may differ
// in the last float16 bit, within every format's bound. Pairs come out as (x_i, x_i+4) and are re-paired
// with two PRMTs per 4 values.
template <int F>
__host__ __device__ constexpr bool HalfDecodes() {
  return F == static_cast<int>(PageFormat::kInt8) || F == static_cast<int>(PageFormat::kFp8E4M3) ||
         F == static_cast<int>(PageFormat::kInt4) || F == static_cast<int>(PageFormat::kInt4KC) ||
         F == static_cast<int>(PageFormat::kInt2) || F == static_cast<int>(PageFormat::kInt2KC);
}

__device__ __forceinline__ uint32_t HFma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t HSub2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t HMul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Eight values of a per-row-scaled piece (w as LoadPiece gives it, sc its row's scale word) as float16.
template <int F>
__device__ __forceinline__ uint4 DecodeHalf8(const uint4& w, uint32_t sc) {
  constexpr PageFormat f = static_cast<PageFormat>(F);
  const uint32_t s2 = (sc & 0xFFFFu) * 0x10001u;  // (s, s)
  if constexpr (f == PageFormat::kInt8) {
    const uint32_t lo = w.x ^ 0x80808080u, hi = w.y ^ 0x80808080u;  // codes + 128
    const uint32_t off = 0x64806480u;                                // (1152, 1152)
    uint4 r;
    r.x = HMul2(HSub2(__byte_perm(lo, 0x64646464u, 0x4140), off), s2);
    r.y = HMul2(HSub2(__byte_perm(lo, 0x64646464u, 0x4342), off), s2);
    r.z = HMul2(HSub2(__byte_perm(hi, 0x64646464u, 0x4140), off), s2);
    r.w = HMul2(HSub2(__byte_perm(hi, 0x64646464u, 0x4342), off), s2);
    return r;
  } else if constexpr (f == PageFormat::kFp8E4M3) {
    uint32_t h[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2_raw x = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(((i < 2 ? w.x : w.y) >> (16 * (i & 1))) & 0xFFFFu), __NV_E4M3);
      h[i] = HMul2(static_cast<uint32_t>(x.x) | (static_cast<uint32_t>(x.y) << 16), s2);
    }
    return make_uint4(h[0], h[1], h[2], h[3]);
  } else {  // INT4 / INT2 (and the values of the *_KC formats): x = c * s + m
    const uint32_t m2 = (sc >> 16) * 0x10001u;
    constexpr bool k4 = f == PageFormat::kInt4 || f == PageFormat::kInt4KC;
    // t: codes 0..3 in the low half, 4..7 in the high half, each at bits (4 or 2) * i of its half
    const uint32_t t = k4 ? w.x : ((w.x & 0xFFu) | ((w.x & 0xFF00u) << 8));
    constexpr uint32_t mask = k4 ? 0x000F000Fu : 0x00030003u;
    constexpr int step = k4 ? 4 : 2;
    uint32_t v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)  // (x_i, x_i+4)
      v[i] = HFma2(HSub2(((t >> (step * i)) & mask) | 0x64006400u, 0x64006400u), s2, m2);
    return make_uint4(__byte_perm(v[0], v[1], 0x5410), __byte_perm(v[2], v[3], 0x5410),
                      __byte_perm(v[0], v[1], 0x7632), __byte_perm(v[2], v[3], 0x7632));
  }
}

template <int F, int D, bool BF>
__device__ __forceinline__ void DecodeTile(uint8_t* st, const uint8_t* pg, const FormatInfo& fi, int hk, int lane,
                                           uint32_t valid) {
  using C = Cfg<D>;
  constexpr int kPer = kTile * C::kCh / 32;  // pieces of 8 values per lane, for K and for V
  constexpr int kB = Bits(F);
  constexpr int kSb = ScaleBytes(F);
  uint4 kw[kPer], vw[kPer];
  uint32_t ksc[kPer], vsc[kPer];
#pragma unroll
  for (int p = 0; p < kPer; ++p) {
    const int i = lane + 32 * p, r = i / C::kCh, ch = i % C::kCh;
    const uint32_t off = r * fi.row_bytes + ch * kB;  // 8 values of kB bits
    kw[p] = LoadPiece<F>(st + off);
    vw[p] = LoadPiece<F>(st + C::kRegion + off);
    if constexpr (kSb == 4) {
      ksc[p] = *reinterpret_cast<const uint32_t*>(st + 2 * C::kRegion + r * 4);
      vsc[p] = *reinterpret_cast<const uint32_t*>(st + 2 * C::kRegion + 64 + r * 4);
    } else if constexpr (kSb == 2) {
      ksc[p] = *reinterpret_cast<const uint16_t*>(st + 2 * C::kRegion + r * 2);
      vsc[p] = *reinterpret_cast<const uint16_t*>(st + 2 * C::kRegion + 64 + r * 2);
    } else {
      ksc[p] = vsc[p] = 0u;  // 16-bit pages have no scales
    }
  }
  __syncwarp();
#pragma unroll
  for (int p = 0; p < kPer; ++p) {
    const int i = lane + 32 * p, r = i / C::kCh, ch = i % C::kCh;
    float x[8];
    const bool ok = (valid >> r) & 1u;
    if constexpr (!BF && HalfDecodes<F>()) {  // Note [Half2 decode]
      const uint4 z = make_uint4(0u, 0u, 0u, 0u);
      if constexpr (!IsKC(F)) *reinterpret_cast<uint4*>(st + Sw<D>(r, ch)) = ok ? DecodeHalf8<F>(kw[p], ksc[p]) : z;
      *reinterpret_cast<uint4*>(st + C::kRegion + Sw<D>(r, ch)) = ok ? DecodeHalf8<F>(vw[p], vsc[p]) : z;
      if constexpr (!IsKC(F)) continue;
    }
    if constexpr (IsKC(F)) {  // per-channel (s, m) of this head's channels ch * 8 .. + 7
      const uint4* cp = reinterpret_cast<const uint4*>(pg + fi.k_scales + (static_cast<uint32_t>(hk) * D + ch * 8) * 4u);
      const uint4 a = __ldg(cp), b = __ldg(cp + 1);
      const uint32_t cs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      constexpr uint32_t mask = (1u << kB) - 1u;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        x[e] = fmaf(__uint_as_float(((kw[p].x >> (kB * e)) & mask) | 0x4B000000u) - 8388608.0f, H(cs[e] & 0xFFFFu),
                    H(cs[e] >> 16));
    } else {
      DecodePiece<F>(kw[p], ksc[p], false, x);
    }
    if (!ok)
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = 0.0f;
    *reinterpret_cast<uint4*>(st + Sw<D>(r, ch)) = Pack8<BF>(x);
    if constexpr (!BF && HalfDecodes<F>()) continue;  // the values were decoded above (Note [Half2 decode])
    DecodePiece<F>(vw[p], vsc[p], false, x);
    if (!ok)
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = 0.0f;
    *reinterpret_cast<uint4*>(st + C::kRegion + Sw<D>(r, ch)) = Pack8<BF>(x);
  }
  __syncwarp();
}

// Bit k set for key off + k (k < N <= 32, offsets from the window's first tile) inside the window's keys [lo, win):
// a bit range, not a per-key loop (Note [Paged CUDA v3 register decode]: the loop's size counted).
template <int N>
using KeyMask = std::conditional_t<(N > 32), uint64_t, uint32_t>;
template <int N>
__device__ __forceinline__ KeyMask<N> KeysInWindow(int off, int lo, int win) {
  static_assert(N <= 64, "");
  if constexpr (N > 32) {
    const auto below = [](int e) { return e >= 64 ? ~0ull : (1ull << e) - 1ull; };
    uint64_t valid = below(N);
    if (off < lo || off + N > win) {
      const int a = lo > off ? lo - off : 0, e = win - off < N ? win - off : N;  // keys [a, e); a < N
      valid = e > a ? below(e) & ~below(a) : 0ull;
    }
    return valid;
  } else {
    uint32_t valid = N == 32 ? 0xFFFFFFFFu : (1u << N) - 1u;
    if (off < lo || off + N > win) {
      const int a = lo > off ? lo - off : 0, e = win - off < N ? win - off : N;  // keys [a, e); a < N
      valid = e > a ? (((N == 32 && e == 32) ? 0xFFFFFFFFu : (1u << e) - 1u) & ~((1u << a) - 1u)) : 0u;
    }
    return valid;
  }
}

// A window's keys [s0, s1) of a row as 16-key tiles aligned to kTile (so each within one page), counted from
// a0 = s0 rounded down to kTile: base_off = a0's key offset from page p0's first key, keys lo .. win - 1 (from a0)
// are the window's, n_tiles tiles cover them; hrow = KV head hk's first row in a page. WindowTiles and WindowTilesReg
// walk the same geometry.
struct WindowGeom {
  int base_off, lo, win, n_tiles;
  uint32_t hrow;
};
__device__ __forceinline__ WindowGeom Geom(int64_t s0, int64_t s1, int64_t p0, int ps, int hk) {
  const int64_t a0 = s0 & ~static_cast<int64_t>(kTile - 1);
  WindowGeom g;
  g.base_off = static_cast<int>(a0 - p0 * ps);
  g.lo = static_cast<int>(s0 - a0);
  g.win = static_cast<int>(s1 - a0);
  g.n_tiles = (g.win + kTile - 1) / kTile;
  g.hrow = static_cast<uint32_t>(hk) * ps;
  return g;
}

// One page window's tiles for one warp (Note [Paged CUDA v3]): warp w takes the window's 16-key tiles w, w + kWarps,
// ... through its ring. UF >= 0: every page of the window has format UF (the caller checked), so the loop has no
// per-tile format switch; UF = -1: any mix, the format read per tile. ps_shift: log2(page size) when it is a power
// of two, else -1 (then a division).
// Note [Paged CUDA v3 uniform windows]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ncu on the H200 (32K keys x 8 rows, F16 pages; benchmarks/results/paged_attention_cuda_h200.md) found the paged
// kernel waiting on its own instructions, not on memory: 33 % more instructions than dense v3 for the same
// tiles, 27 % of warp stalls on shared-memory latency and 8 % on instruction fetch. Per tile it looked up the
// page's format in shared memory, switched over 8 formats twice (the copy and the decode) and divided by the
// page size twice. A cache whose window of pages has one format (a single-format policy; the long runs of a
// recency policy) now takes a loop compiled for that format, and the page index is a shift for power-of-two
// page sizes; mixed windows keep the switch.
template <typename T, int D, int UF>
__device__ __forceinline__ void WindowTiles(const PageWindow& sh, uint8_t* wring, int64_t s0, int64_t s1, int64_t p0,
                                            int ps, int ps_shift, int hk, int warp, int lane,
                                            const uint32_t (*qa)[2], float& m, float& l, float (*o)[4]) {
  using C = Cfg<D>;
  constexpr bool BF = std::is_same<T, __nv_bfloat16>::value;
  constexpr int kDirect = BF ? static_cast<int>(PageFormat::kBF16) : static_cast<int>(PageFormat::kF16);
  const auto page_of = [&](int x) { return ps_shift >= 0 ? x >> ps_shift : x / ps; };
  // tiles of 16 keys aligned to 16 (within one page); warp w takes tiles w, w + kWarps, ...
  const WindowGeom wg = Geom(s0, s1, p0, ps, hk);
  const int base_off = wg.base_off, lo = wg.lo, win = wg.win, n_tiles = wg.n_tiles;
  const uint32_t hrow = wg.hrow;
  const int mine = n_tiles > warp ? (n_tiles - warp + kWarps - 1) / kWarps : 0;
  // Note [Paged CUDA v3 pointers ahead]: in a uniform window the format's layout is read from shared memory once,
  // and the page pointer and row of the tile issued next are read one issue ahead, so the copies of a tile do not
  // wait on a shared-memory load (ncu, F16 pages at 32K x 8: 28 % of warp stalls on short scoreboard vs 16 % for
  // dense v3)
  FormatInfo fiu{};
  if constexpr (UF >= 0) fiu = sh.fi[UF];
  const uint8_t* pg_next = nullptr;
  uint32_t row_next = 0;
  auto locate = [&](int idx) {
    const int o0 = base_off + (warp + idx * kWarps) * kTile;
    const int lp = page_of(o0);
    row_next = hrow + static_cast<uint32_t>(o0 - lp * ps);
    pg_next = sh.page[lp];
  };
  if constexpr (UF >= 0) {
    if (mine > 0) locate(0);
  }
  int next = 0, stage_in = 0;
  auto issue = [&]() {
    if (next < mine) {
      uint8_t* st = wring + stage_in * C::kStageBytes;
      if constexpr (UF >= 0) {
        IssueTile<UF, D, UF == kDirect>(st, pg_next, fiu, row_next, lane);
        if (next + 1 < mine) locate(next + 1);
      } else {
        const int o0 = base_off + (warp + next * kWarps) * kTile;
        const int lp = page_of(o0);
        const uint32_t row0 = hrow + static_cast<uint32_t>(o0 - lp * ps);
        const int f = sh.fmt[lp];
#define ORTKV_ISSUE3(F) IssueTile<F, D, F == kDirect>(st, sh.page[lp], sh.fi[F], row0, lane)
        ORTKV_PAGED_FORMAT_SWITCH(f, ORTKV_ISSUE3)
#undef ORTKV_ISSUE3
      }
    }
    CpAsyncCommit();
    ++next;
    stage_in = stage_in + 1 == C::kStages ? 0 : stage_in + 1;
  };
#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) issue();
  int stage = 0;
  for (int it = 0; it < mine; ++it, stage = stage + 1 == C::kStages ? 0 : stage + 1) {
    CpAsyncWait<C::kStages - 2>();
    __syncwarp();  // this tile's copies landed for the whole warp; the slot refilled next was read
    issue();
    const int off = (warp + it * kWarps) * kTile;  // from a0
    const uint32_t valid = KeysInWindow<kTile>(off, lo, win);
    const int lp = page_of(base_off + off);
    uint8_t* st = wring + stage * C::kStageBytes;
    if constexpr (UF >= 0) {
      if constexpr (UF != kDirect) {
        DecodeTile<UF, D, BF>(st, IsKC(UF) ? sh.page[lp] : nullptr, fiu, hk, lane, valid);
      } else if (valid != 0xFFFFu) {
        ZeroInvalidV<D>(st, lane, valid);
      }
    } else {
      const int f = sh.fmt[lp];
      if (f != kDirect) {
#define ORTKV_DECODE3(F) \
  if constexpr (F != kDirect) DecodeTile<F, D, BF>(st, sh.page[lp], sh.fi[F], hk, lane, valid);
        ORTKV_PAGED_FORMAT_SWITCH(f, ORTKV_DECODE3)
#undef ORTKV_DECODE3
      } else if (valid != 0xFFFFu) {
        ZeroInvalidV<D>(st, lane, valid);
      }
    }
    TileProducts<BF, D>(st, qa, lane, valid, m, l, o);
  }
}

// Note [Paged CUDA v3 register decode]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// INT4 and INT8 pages under float16 queries skip the decoded 16-bit tile of Note [Paged CUDA v3]: the warp
// turns the raw codes in its ring straight into the mma B fragments, and the per-row scales are applied outside
// the products, in FP32. A code ORed under the exponent of 1024.0h is the float16 1024 + code, exact (Note
// [Half2 decode]), and the products keep that offset instead of subtracting it per value:
//   * scores: B = 1024 + c (INT4; 1152 + code for INT8, whose bytes hold code + 128), so the raw score is
//     q . c + k0 with k0 = 1024 sum(q), and S = s_k (raw - k0) + m_k qsum per key (qsum: the row's sum of the
//     float16 query values; INT8 has no minimum). INT4's odd nibbles are left in place (1024 + 16 c) and the
//     query elements facing them are divided by 16 (exact), so one shift and four LOP3s give eight codes;
//     A score is one sum of D products, so the offset costs ~7 of FP32's 24 bits once (~2^-17 relative);
//   * values: sum_j p_j (c_j s_j + m_j) = sum_j (p_j s_j) c_j + sum_j p_j m_j, so P is scaled by each key's s_v
//     before it is rounded to float16 (as P alone was), sum p m is one more FP32 sum per query head (mv), added
//     to every element of o when the window ends. The value codes are exact (the offset subtracted per pair: an
//     HSUB2, or for INT4's high nibbles an HFMA2 by 1/16): o sums over thousands of keys, and an offset carried
//     in it (tried: removed at the window's end through the sum of P) cost ~14 bits at 4K keys per window and
//     failed the float16 tolerance on 37K-key rows.
// No shared-memory store of a decoded tile, no ldmatrix, no __syncwarp between decode and products: ~0.9
// instructions per INT4 value against ~2.5 before, and no float16 rounding of c s + m. Since every k-index of an
// mma is a sum, the dims a lane's B fragments hold may be any split of the head that the A fragments repeat:
//   * K: lane (g, q = lane % 4) takes the q-th quarter of key row kappa(g) (kappa = 0 4 1 5 2 6 3 7 within each
//     8-key n-tile: conflict-free loads of V below); INT4 word w gives the pairs (x_i, x_i+4), i < 4, as k-steps
//     2 j + i / 2; INT8 words give adjacent pairs. The query fragments come from the lane's quarter of the query
//     row (RegQuery).
//   * V: the B fragment pairs two KEYS of one dim, so two key rows' words are interleaved by one PRMT first;
//     lane g takes words g, g + 8, ... of each row, and n-tile nt, column n of o then holds dim DimOf(mode, nt, n)
//     (INT4: 64 (nt / 8) + 8 n + nt % 8), not nt * 8 + n. A block whose windows switch between the shared-memory
//     path and a register path permutes o through its warp's ring (ConvertO, at most once per window), and the
//     end-of-block merge reads o through the same map.
//   * Keys outside the window: their codes are finite integers, and their scales are never trusted (S and P are
//     replaced by selects, not products, as Note [Paged CUDA v3] zeroes their value rows).
// A step is two 16-key tiles where the warp's ring holds >= 3 such steps (INT4 at head size 64: 5 stages of
// 2 x 1,152 bytes, where F16 tiles fit 3 stages of one): one softmax update per 32 keys and two independent tiles'
// score products. The loop has no division (power-of-two page sizes get their own instance) and no per-key loop
// for the window's edges, which shrank it by a quarter: ncu showed 21 % of warp stalls on instruction fetch.
// H200 (benchmarks/results/paged_attention_cuda_h200.md, SmolLM2 heads, pages of 16, us per node): INT4 pages at
// 32K keys x 8 rows 61.2 -> 39.2 (F16 pages 62.5), INT8 57.5 -> 44.6; the INT4 loop per key costs ~0.5x F16's, and
// it is bound by instruction latency at 2 blocks of 4 warps per SM. The register path first cost F16 pages 4-6 %
// (the query quarter held from the kernel's start: 199 -> 230 registers); it is now read per register window
// (212 registers; F16 back to 93e882d's times). More warps per SM were measured with per-format instances and not
// kept: an INT4 / INT8-only kernel at 3 blocks per SM (149 registers) gained 4 % at 32K x 8 only, an F16-only one
// (165 registers, 3 blocks) nothing. BFloat16 queries keep the shared-memory decode. INT4 pages at head size 64
// now take the transposed form of this loop (Note [Paged CUDA v3 transposed INT4]); INT8, and INT4 at 128, this one.
constexpr int kInt4F = static_cast<int>(PageFormat::kInt4), kInt8F = static_cast<int>(PageFormat::kInt8);

// The layout of o after a window of format f (-1: mixed): 0 the 16-bit tiles' (dim nt * 8 + n), 1 INT4's, 2 INT8's.
__host__ __device__ constexpr int RegMode(int f) { return f == kInt4F ? 1 : f == kInt8F ? 2 : 0; }
#ifndef ORTKV_PAGED_V3_INT8T  // 1: INT8 windows at head size 64 take the transposed form too (Note [Paged CUDA v3
#define ORTKV_PAGED_V3_INT8T 0  // transposed INT8]; an A/B knob for paged_sweep.cu until it has run on a GPU)
#endif
// Whether a register-decoded window of format f at head size D runs the transposed form.
template <int D>
__host__ __device__ constexpr bool RegTransposed(int f) {
  return D == 64 && (f == kInt4F || (ORTKV_PAGED_V3_INT8T != 0 && f == kInt8F));
}
// The layout of o after a register-decoded window at head size D: the transposed form (INT4 at head size 64, and
// INT8 there under ORTKV_PAGED_V3_INT8T) merges its state into layout 0 (Note [Paged CUDA v3 transposed INT4]).
template <int D>
__host__ __device__ constexpr int RegModeD(int f) { return RegTransposed<D>(f) ? 0 : RegMode(f); }
__device__ __forceinline__ int DimOf(int mode, int nt, int n) {
  return mode == 1 ? 64 * (nt >> 3) + 8 * n + (nt & 7) : mode == 2 ? 32 * (nt >> 2) + 4 * n + (nt & 3) : nt * 8 + n;
}

template <int F, int D>
struct RegCfg {
  static constexpr int kRB = D * Bits(F) / 8;  // payload bytes of one key row
  static constexpr int kV = kTile * kRB;       // the V rows in a stage (the K rows at 0)
  static constexpr int kS = 2 * kTile * kRB;   // K scales (64 bytes reserved), then V scales (64 bytes)
  static constexpr int kStageBytes = (kS + 128 + 127) / 128 * 128;
  static constexpr int kKW = kRB / 16;  // 32-bit words in a lane's quarter of a key row
};
static_assert(RegCfg<kInt4F, 64>::kStageBytes == 1152 && RegCfg<kInt8F, 64>::kStageBytes == 2176, "");

// The tile's raw K rows, V rows and their scales (rows row0 .. row0 + 15 of the page) into a narrow stage, by LPT
// lanes (`lane` < LPT): the whole warp, or a tile's group of a step (Note [Uniform INT4 group copies]).
template <int F, int D, int LPT = 32>
__device__ __forceinline__ void IssueNarrow(uint8_t* st, const uint8_t* pg, const FormatInfo& fi, uint32_t row0,
                                            int lane) {
  using R = RegCfg<F, D>;
  static_assert(LPT >= 8 && LPT <= 32, "lanes 0 .. 7 copy the scales");
  const uint8_t* ks = pg + row0 * R::kRB + lane * 16;
  const uint8_t* vs = ks + fi.v_payload;
  uint8_t* d = st + lane * 16;
#pragma unroll
  for (int c = 0; c < R::kV; c += 16 * LPT) {
    if (R::kV % (16 * LPT) == 0 || lane * 16 + c < R::kV) {
      CpAsync<16>(d + c, ks + c);
      CpAsync<16>(d + R::kV + c, vs + c);
    }
  }
  constexpr int kSc = ScaleBytes(F) * kTile / 16;  // 16-byte pieces of one tile's K (or V) scales: 2 or 4
  const int which = lane >> 2, piece = lane & 3;    // lanes 0 .. 3: K scales, 4 .. 7: V scales
  if (lane < 8 && piece < kSc)
    CpAsync<16>(st + R::kS + which * 64 + piece * 16,
                pg + (which != 0 ? fi.v_scales : fi.k_scales) + row0 * static_cast<uint32_t>(ScaleBytes(F)) + piece * 16);
}

// (a & b) | c in one LOP3 (the compiler's own lowering takes two: LOP3 holds one immediate).
__device__ __forceinline__ uint32_t AndOr(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
// What a register-decoded B value holds besides its code (times 16 for INT4's high nibbles): 1024 + c for INT4,
// 1024 + (code + 128) = 1152 + code for INT8.
template <int F>
__host__ __device__ constexpr float RegOffset() { return F == kInt4F ? 1024.0f : 1152.0f; }
// The offset form of Int4Quad, two instructions fewer per pair: r[0], r[2] = 1024 + c (nibbles 0, 2), r[1], r[3] =
// 1024 + 16 c (nibbles 1, 3) as float16 pairs, exact.
__device__ __forceinline__ void Int4QuadRaw(uint32_t t, uint32_t* r) {
  const uint32_t ex = 0x64006400u, lo = 0x000F000Fu, hi = 0x00F000F0u;
  const uint32_t t8 = t >> 8;
  r[0] = AndOr(t, lo, ex);
  r[1] = AndOr(t, hi, ex);
  r[2] = AndOr(t8, lo, ex);
  r[3] = AndOr(t8, hi, ex);
}
// The offset form of Int8Pair: 1024 + u (u = code + 128) from bytes 0, 1 (hi: 2, 3) of u.
__device__ __forceinline__ uint32_t Int8PairRaw(uint32_t u, bool hi) { return __byte_perm(u, 0x64646464u, hi ? 0x4342 : 0x4140); }
// The INT4 codes at nibbles 0..3 of each 16-bit half of t as float16 pairs r[i] = (c_i of the low half, of the high
// half): exact. Nibble 1 (3) keeps its place under the exponent of 1024.0h (1024 + 16 c, exact) and is scaled by
// 1/16 in the subtraction's FMA, so one shift serves four pairs (9 instructions where shift-mask-or-subtract per
// pair took 15).
__device__ __forceinline__ void Int4Quad(uint32_t t, uint32_t* r) {
  Int4QuadRaw(t, r);
  r[0] = HSub2(r[0], 0x64006400u);
  r[1] = HFma2(r[1], 0x2C002C00u, 0xD400D400u);  // (1024 + 16 c) / 16 - 64
  r[2] = HSub2(r[2], 0x64006400u);
  r[3] = HFma2(r[3], 0x2C002C00u, 0xD400D400u);
}
// INT8 codes from bytes 0, 1 (hi: 2, 3) of u (the stored bytes ^ 0x80: code + 128) as float16: exact.
__device__ __forceinline__ uint32_t Int8Pair(uint32_t u, bool hi) { return HSub2(Int8PairRaw(u, hi), 0x64806480u); }
// The stored INT8 codes of bytes i = 0..3 of two key rows' words p, q as float16 pairs r[i] = (p's, q's): exact
// (the B / A fragments that pair two keys of one dim, Note [Paged CUDA v3 register decode]).
__device__ __forceinline__ void Int8KeyPairs(uint32_t p, uint32_t q, uint32_t* r) {
  const uint32_t x = __byte_perm(p, q, 0x5140) ^ 0x80808080u, y = __byte_perm(p, q, 0x7362) ^ 0x80808080u;
  r[0] = Int8Pair(x, false);
  r[1] = Int8Pair(x, true);
  r[2] = Int8Pair(y, false);
  r[3] = Int8Pair(y, true);
}

// This lane's D / 4 consecutive query elements (quarter lane % 4 of row g; zeros for padding rows g >= gn).
template <int D>
__device__ __forceinline__ void LoadQueryChunk(const __half* qp, int g, int gn, int c, uint32_t* qc) {
#pragma unroll
  for (int i = 0; i < D / 8; ++i) qc[i] = g < gn ? *reinterpret_cast<const uint32_t*>(qp + c * (D / 4) + 2 * i) : 0u;
}

// The A fragments of format F's K fragments (RegTiles) from the lane's quarter qc, scaled by qscale and rounded to
// float16 (INT4: the elements facing a high nibble, b1, then divided by 16: exact), qsum: the sum of the rounded
// values over the lane's query row, and k0: the raw scores' offset, RegOffset<F>() x the sum of the fragments' values
// (Note [Paged CUDA v3 register decode]).
template <int F, int D>
__device__ __forceinline__ void RegQuery(const uint32_t* qc, float qscale, uint32_t (*qa)[2], float* qsum, float* k0) {
  float sum = 0.0f, frag = 0.0f;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
#pragma unroll
    for (int bi = 0; bi < 2; ++bi) {
      uint32_t raw;
      if constexpr (F == kInt8F) {
        raw = qc[2 * ks + bi];  // elements 4 ks + 2 bi, + 1 of the quarter
      } else {                  // elements ld, ld + 4 of the quarter
        const int ld = 8 * (ks >> 1) + 2 * (ks & 1) + bi;
        raw = __byte_perm(qc[ld >> 1], qc[(ld + 4) >> 1], (ld & 1) ? 0x7632 : 0x5410);
      }
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&raw));
      qa[ks][bi] = Pack2<false>(f.x * qscale, f.y * qscale);
      const float2 r = __half22float2(*reinterpret_cast<const __half2*>(&qa[ks][bi]));
      sum += r.x + r.y;
      if (F == kInt4F && bi == 1) qa[ks][bi] = HMul2(qa[ks][bi], 0x2C002C00u);  // / 16
      const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&qa[ks][bi]));
      frag += h.x + h.y;
    }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  frag += __shfl_xor_sync(0xffffffffu, frag, 1);
  frag += __shfl_xor_sync(0xffffffffu, frag, 2);
  *qsum = sum;
  *k0 = RegOffset<F>() * frag;
}

// NT raw narrow tiles' products (Note [Paged CUDA v3 register decode]; tile h of the step at st + h * kStageBytes,
// key h * 16 + k of the step valid where bit h * 16 + k of `valid` is set): S, the online softmax over the step's
// keys (as TileProducts), o += (P s_v) C_v, mv += P m_v.
template <int F, int D, int NT>
__device__ __forceinline__ void RegTiles(const uint8_t* st, const uint32_t (*qa)[2], float qsum, float k0, int lane,
                                         uint32_t valid, float& m, float& l, float& mv, float (*o)[4]) {
  using R = RegCfg<F, D>;
  constexpr bool k4 = F == kInt4F;
  const int g = lane >> 2, c = lane & 3;
  float s[2 * NT][4];
  const int kg = (g >> 1) + 4 * (g & 1);  // kappa(g): the key of column g of an n-tile
#pragma unroll
  for (int x = 0; x < 2 * NT; ++x) {  // n-tile x: keys 8 x .. 8 x + 7 of the step (tile x / 2)
    s[x][0] = s[x][1] = s[x][2] = s[x][3] = 0.0f;
    uint32_t w[R::kKW];
    const uint8_t* src = st + (x >> 1) * R::kStageBytes + ((x & 1) * 8 + kg) * R::kRB + c * (R::kRB / 4);
    if constexpr (R::kKW == 2) {
      const uint2 y = *reinterpret_cast<const uint2*>(src);
      w[0] = y.x, w[1] = y.y;
    } else {
#pragma unroll
      for (int i = 0; i < R::kKW / 4; ++i) {
        const uint4 y = *reinterpret_cast<const uint4*>(src + 16 * i);
        w[4 * i] = y.x, w[4 * i + 1] = y.y, w[4 * i + 2] = y.z, w[4 * i + 3] = y.w;
      }
    }
    uint32_t kb[D / 16][2];
#pragma unroll
    for (int j = 0; j < R::kKW; ++j) {
      if constexpr (k4) {
        uint32_t r[4];
        Int4QuadRaw(w[j], r);  // b0: 1024 + c, b1: 1024 + 16 c (its query elements are / 16)
#pragma unroll
        for (int i = 0; i < 4; ++i) kb[2 * j + (i >> 1)][i & 1] = r[i];
      } else {
        const uint32_t u = w[j] ^ 0x80808080u;
        kb[j][0] = Int8PairRaw(u, false);
        kb[j][1] = Int8PairRaw(u, true);
      }
    }
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) Mma<false>(s[x], qa[ks][0], qa[ks][1], kb[ks][0], kb[ks][1]);
  }
  // accumulator (x, e) of this lane holds key 8 x + c + 4 e of the step (kappa(2 c) = c, kappa(2 c + 1) = c + 4)
  float vs[2 * NT][2], vm[2 * NT][2];
  float mx = -INFINITY;
#pragma unroll
  for (int x = 0; x < 2 * NT; ++x)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = 8 * x + c + 4 * e;
      const uint8_t* sc = st + (x >> 1) * R::kStageBytes + R::kS;
      const int k = key & 15;
      const bool ok = (valid >> key) & 1u;
      float sk, mk = 0.0f, sv, mvk = 0.0f;
      if constexpr (k4) {
        const uint32_t kw = *reinterpret_cast<const uint32_t*>(sc + k * 4);
        const uint32_t vw = *reinterpret_cast<const uint32_t*>(sc + 64 + k * 4);
        sk = H(kw & 0xFFFFu), mk = H(kw >> 16), sv = H(vw & 0xFFFFu), mvk = H(vw >> 16);
      } else {
        sk = H(*reinterpret_cast<const uint16_t*>(sc + k * 2));
        sv = H(*reinterpret_cast<const uint16_t*>(sc + 64 + k * 2));
      }
      // s = sk (raw - k0) + mk qsum: the raw score carries k0 (RegOffset)
      s[x][e] = ok ? fmaf(s[x][e], sk, k4 ? fmaf(-sk, k0, mk * qsum) : -sk * k0) : -INFINITY;
      vs[x][e] = ok ? sv : 0.0f;
      vm[x][e] = ok ? mvk : 0.0f;
      mx = fmaxf(mx, s[x][e]);
    }
  QuadMaxRescale<D>(mx, m, l, o, &mv);
  uint32_t pa[NT][2];
#pragma unroll
  for (int h = 0; h < NT; ++h) {
    float pv[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int x = 2 * h + nt;
        const float p = Exp2(s[x][e] - m);  // 0 for a key outside the window
        l += p;
        mv = fmaf(p, vm[x][e], mv);
        pv[nt][e] = p * vs[x][e];
      }
    pa[h][0] = Pack2<false>(pv[0][0], pv[0][1]);
    pa[h][1] = Pack2<false>(pv[1][0], pv[1][1]);
  }
  // V of tile h: b0 pairs its keys (c, c + 4), b1 its keys (c + 8, c + 12), at dim DimOf(mode, nt, g)
#pragma unroll
  for (int h = 0; h < NT; ++h) {
    uint32_t vb[D / 8][2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const uint8_t* ra = st + h * R::kStageBytes + R::kV + (hf * 8 + c) * R::kRB;
      const uint8_t* rb = ra + 4 * R::kRB;
      if constexpr (k4) {
#pragma unroll
        for (int j = 0; j < D / 64; ++j) {
          const uint32_t wa = *reinterpret_cast<const uint32_t*>(ra + 4 * (g + 8 * j));
          const uint32_t wb = *reinterpret_cast<const uint32_t*>(rb + 4 * (g + 8 * j));
          uint32_t rl[4], rh[4];
          Int4Quad(__byte_perm(wa, wb, 0x5410), rl);
          Int4Quad(__byte_perm(wa, wb, 0x7632), rh);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            vb[8 * j + i][hf] = rl[i];
            vb[8 * j + 4 + i][hf] = rh[i];
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < D / 32; ++j) {
          const uint32_t wa = *reinterpret_cast<const uint32_t*>(ra + 4 * (g + 8 * j));
          const uint32_t wb = *reinterpret_cast<const uint32_t*>(rb + 4 * (g + 8 * j));
          uint32_t r[4];
          Int8KeyPairs(wa, wb, r);
#pragma unroll
          for (int i = 0; i < 4; ++i) vb[4 * j + i][hf] = r[i];
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) Mma<false>(o[nt], pa[h][0], pa[h][1], vb[nt][0], vb[nt][1]);
  }
}

// Note [Paged CUDA v3 transposed INT4]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// INT4 pages at head size 64 under float16 queries take the keys as the mma's M dimension: S^T = K Q^T and
// O^T = V^T P^T. The register decode's loop (Note [Paged CUDA v3 register decode]) put the query heads in M, where
// rows 8..15 are padding: every product of 8 keys needed an mma and two registers of zeros that ptxas re-made
// before each one. Here a 16-key tile is one mma per 16 dims for S and one per 16 dims for O, with no padding:
//   * S^T: A = the raw K codes of key rows kappa(g) (rows 0..7 of A) and 8 + kappa(g) (rows 8..15), the lane's
//     quarter of each as in the register decode (Int4QuadRaw), B = the query fragments qa of RegQuery unchanged
//     (their k-indices and dims are the A fragments' of the register decode). C: lane (g, c) holds keys kappa(g)
//     and 8 + kappa(g) for query heads 2c and 2c + 1: the offset k0 and qsum of those two heads come from lanes
//     8c and 8c + 4 once per window, the per-key scales are read for 4 keys a lane per 32-key step (8 before).
//   * The online softmax runs per query head (column): the maxima reduce over the 8 lanes of a column (xor 4, 8,
//     16), and each lane keeps m, l and sum p m_v for its two columns.
//   * P^T as B: the C fragment of S^T (row = key, 2 columns a lane) is the transpose of the B fragment that O^T
//     needs (k = key, 1 column a lane); movmatrix.trans turns one into the other, one instruction per 8 keys. Row
//     m of S^T is key kappa(m) (8 + kappa(m - 8)), so B's k-indices 2c, 2c + 1 are keys c, c + 4 (8 + c, 12 + c).
//   * V^T as A: lane (g, c) pairs keys (c, c + 4) and (8 + c, 12 + c) of word g of the value rows (one PRMT per
//     pair of rows, Int4Quad exact as before): dims 8 g + i in rows 0..7 of m-tile i, 8 g + 4 + i in rows 8..15.
// The window's state merges into the block's (m, l, o in layout 0) at its end through the warp's ring (2 KB;
// its copies have landed): o = o 2^(m - M) + O_w 2^(m_w - M), l likewise on one lane of the quad (l is a per-lane
// partial until the block's end). 217 registers (212 before), 452 instructions per 32-key step with 16 HMMA
// (526 with 32; 500 for page sizes that are not powers of two; `python benchmarks/cuda/sass_loops.py`). H200
// harness (SmolLM2 heads, pages of 16, 2 alternating rounds, us): INT4 32K x 8 36.5 -> 33.0-33.5, 8K x 8
// 17.4-17.7 -> 16.9, 32K x 1 14.9 -> 14.6, 8K x 1 10.4 -> 10.5;
// INT8 1-2 % faster (the shared kernel's registers), F16 unchanged; the same largest difference to v2 as before
// (<= 0.0039). Through ORT (bench_paged_attention_cuda.py, one round): INT4 / F16 0.55 at 128K x 4 (0.58 before),
// 0.60 at 32K x 8 (0.64). Still a lane-latency-bound loop at 8 warps per SM, and the per-block fixed part (a third
// of the samples at 32K x 8, benchmarks/results/paged_attention_cuda_h200.md) is untouched.
// Steps of 4 tiles (64 keys: four independent S^T products and one softmax update per step, the ring two steps
// deep) with the query fragments read after the ring's prologue is issued (their load overlaps the copies), since
// the kernel starts early (Note [CUDA attention early start] in cache_attention.cu): 928 instructions per step with
// 32 HMMA, 230 registers (226 for the plain launch). H200 harness, early launches, INT4 us at 8K x 1 / 8K x 8 /
// 32K x 1 / 32K x 8: 9.22 / 15.38 / 12.97 / 31.44 with steps of 2 tiles, 8.92 / 13.96 / 12.70 / 28.77 with 4;
// without the early start 4 tiles were no faster than 2 (and INT8 pages lost 1-9 % to the registers it moved), so
// ORTKV_PAGED_V3_INT4T_NT (2, 3 or 4) stays an A/B knob for paged_sweep.cu.
__device__ __forceinline__ void MmaRows16(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// The 8 x 8 matrix of 16-bit values whose row lane / 4, columns 2 (lane % 4) + {0, 1} the lane holds, transposed.
__device__ __forceinline__ uint32_t Transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Note [Paged CUDA v3 transposed INT8]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// INT8 pages at head size 64 in the transposed form of Note [Paged CUDA v3 transposed INT4] (NarrowTilesT<kInt8F>):
//   * S^T: A = the raw K codes of key rows kappa(g) and 8 + kappa(g), the lane's quarter of each (16 bytes: word ks
//     is k-step ks, bytes 0, 1 its k-indices 2c, 2c + 1 and bytes 2, 3 its 2c + 8, 2c + 9, the elements RegQuery
//     <kInt8F> pairs in the query fragments), each byte ^ 0x80 under the exponent of 1024.0h (Int8PairRaw: 1152 +
//     code, the offset k0 taken out of the scores as before). A 16-key tile takes four HMMA for its scores and four
//     for its values, as INT4's; the register decode (RegTiles) takes sixteen, half of them on padded query rows.
//   * INT8 has one scale per key and no minimum: s = s_k (raw - k0), and no sum p m_v (mv stays 0).
//   * V^T as A: lane (g, c) reads bytes 8 g .. 8 g + 7 (dims) of key rows c, c + 4, 8 + c and 12 + c; one PRMT pairs
//     two rows' bytes of two dims and Int8Pair makes each pair exact (code, not offset: o sums over thousands of
//     keys). Dim 8 g + i sits in rows g (i < 4) and g + 8 (i >= 4) of m-tile i % 4: INT4's map, so MergeWindowT
//     merges either format's window.
// The uniform INT8 kernel (Note [Paged CUDA uniform INT8]) runs it. In the every-format kernel INT8 windows keep
// the register decode (RegTiles) unless built with ORTKV_PAGED_V3_INT8T=1: an A/B knob for paged_sweep.cu until
// the form has run on a GPU (written and compiled in the twenty-second session, which had no GPU machine). sm_90
// SASS (`python benchmarks/cuda/sass_loops.py`): that kernel's INT8 loop 317 -> 284 instructions per 16-key step
// (293 -> 260 for page sizes that are not powers of two), 224 registers either way.
// Its index maps (each lane's fragments, kappa, the dim map MergeWindowT reads) are checked without a GPU by a
// lane-level numpy model, benchmarks/cuda/int8_transposed_model.py (tests/test_int8_transposed_model.py); the code
// itself only by the CUDA tests.
//
// One step of NT raw INT4 or INT8 tiles (head size 64) in the transposed form: S^T, the per-column online softmax,
// O^T += V^T (P s_v)^T, mv += P m_v (Note [Paged CUDA v3 transposed INT4]; INT8: Note [Paged CUDA v3 transposed
// INT8], which has no minimum, so mv stays 0).
template <int F, int NT>
__device__ __forceinline__ void NarrowTilesT(const uint8_t* st, const uint32_t (*qa)[2], const float* qs,
                                             const float* k0, int lane, KeyMask<NT * kTile> valid, float* m, float* l,
                                             float* mv, float (*o)[4]) {
  static_assert(F == kInt4F || F == kInt8F, "");
  using R = RegCfg<F, 64>;
  constexpr bool k4 = F == kInt4F;
  const int g = lane >> 2, c = lane & 3;
  const int kg = (g >> 1) + 4 * (g & 1);  // kappa(g): the key of row g of S^T
  float s[NT][4];
#pragma unroll
  for (int h = 0; h < NT; ++h) {
    s[h][0] = s[h][1] = s[h][2] = s[h][3] = 0.0f;
    const uint8_t* t = st + h * R::kStageBytes;
    uint32_t ka[4][4];  // k-step ks: the A fragments a0 .. a3 (rows kappa(g), 8 + kappa(g); k 2c, 2c + 8)
    if constexpr (k4) {
      const uint2 wl = *reinterpret_cast<const uint2*>(t + kg * R::kRB + c * 8);
      const uint2 wh = *reinterpret_cast<const uint2*>(t + (8 + kg) * R::kRB + c * 8);
      uint32_t rl[2][4], rh[2][4];  // per word: k-steps 2 j, 2 j + 1 (as RegTiles' kb)
      Int4QuadRaw(wl.x, rl[0]);
      Int4QuadRaw(wl.y, rl[1]);
      Int4QuadRaw(wh.x, rh[0]);
      Int4QuadRaw(wh.y, rh[1]);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const int j = ks >> 1, i = 2 * (ks & 1);
        ka[ks][0] = rl[j][i], ka[ks][1] = rh[j][i], ka[ks][2] = rl[j][i + 1], ka[ks][3] = rh[j][i + 1];
      }
    } else {  // word ks of the lane's quarter: elements 4 ks .. 4 ks + 3, as RegQuery<kInt8F> pairs them
      const uint4 wl = *reinterpret_cast<const uint4*>(t + kg * R::kRB + c * 16);
      const uint4 wh = *reinterpret_cast<const uint4*>(t + (8 + kg) * R::kRB + c * 16);
      const uint32_t xl[4] = {wl.x, wl.y, wl.z, wl.w}, xh[4] = {wh.x, wh.y, wh.z, wh.w};
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const uint32_t ul = xl[ks] ^ 0x80808080u, uh = xh[ks] ^ 0x80808080u;
        ka[ks][0] = Int8PairRaw(ul, false), ka[ks][1] = Int8PairRaw(uh, false);
        ka[ks][2] = Int8PairRaw(ul, true), ka[ks][3] = Int8PairRaw(uh, true);
      }
    }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) MmaRows16(s[h], ka[ks][0], ka[ks][1], ka[ks][2], ka[ks][3], qa[ks][0], qa[ks][1]);
  }
  float vs[NT][2], vm[NT][2];  // vm: INT4's minima only
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int h = 0; h < NT; ++h)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int k = 8 * hi + kg;
      const uint8_t* sc = st + h * R::kStageBytes + R::kS;
      if constexpr (k4) {
        const uint32_t kw = *reinterpret_cast<const uint32_t*>(sc + k * 4);
        const uint32_t vw = *reinterpret_cast<const uint32_t*>(sc + 64 + k * 4);
        const float sk = H(kw & 0xFFFFu), mk = H(kw >> 16);
        const bool ok = (valid >> (16 * h + k)) & 1u;
#pragma unroll
        for (int e = 0; e < 2; ++e) {  // s = sk (raw - k0) + mk qsum: the raw score carries k0 (RegOffset)
          float& x = s[h][2 * hi + e];
          x = ok ? fmaf(x, sk, fmaf(-sk, k0[e], mk * qs[e])) : -INFINITY;
          mx[e] = fmaxf(mx[e], x);
        }
        vs[h][hi] = ok ? H(vw & 0xFFFFu) : 0.0f;
        vm[h][hi] = ok ? H(vw >> 16) : 0.0f;
      } else {  // one scale a key, no minimum: s = sk (raw - k0)
        const float sk = H(*reinterpret_cast<const uint16_t*>(sc + k * 2));
        const uint32_t vb = *reinterpret_cast<const uint16_t*>(sc + 64 + k * 2);
        const bool ok = (valid >> (16 * h + k)) & 1u;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[h][2 * hi + e];
          x = ok ? fmaf(x, sk, -sk * k0[e]) : -INFINITY;
          mx[e] = fmaxf(mx[e], x);
        }
        vs[h][hi] = ok ? H(vb) : 0.0f;
      }
    }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], x));
    if (mx[e] > m[e]) {
      const float corr = Exp2(m[e] - mx[e]);
      l[e] *= corr;
      if constexpr (k4) mv[e] *= corr;
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) o[mt][e] *= corr, o[mt][e + 2] *= corr;
      m[e] = mx[e];
    }
  }
#pragma unroll
  for (int h = 0; h < NT; ++h) {
    float pv[2][2];
#pragma unroll
    for (int hi = 0; hi < 2; ++hi)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = Exp2(s[h][2 * hi + e] - m[e]);  // 0 for a key outside the window
        l[e] += p;
        if constexpr (k4) mv[e] = fmaf(p, vm[h][hi], mv[e]);
        pv[hi][e] = p * vs[h][hi];
      }
    const uint32_t b0 = Transpose8x8(Pack2<false>(pv[0][0], pv[0][1]));  // keys c, c + 4; column g
    const uint32_t b1 = Transpose8x8(Pack2<false>(pv[1][0], pv[1][1]));  // keys 8 + c, 12 + c
    // a[hf][dh][i]: dim 8 g + 4 dh + i of keys (c, c + 4) (hf 0) or (8 + c, 12 + c) (hf 1), m-tile i's rows g
    // (dh 0) and g + 8 (dh 1), as Int4Quad gives them
    uint32_t a[2][2][4];
    if constexpr (k4) {
      const uint8_t* v = st + h * R::kStageBytes + R::kV + 4 * g;
      const uint32_t wa = *reinterpret_cast<const uint32_t*>(v + c * R::kRB);
      const uint32_t wb = *reinterpret_cast<const uint32_t*>(v + (c + 4) * R::kRB);
      const uint32_t wc = *reinterpret_cast<const uint32_t*>(v + (c + 8) * R::kRB);
      const uint32_t wd = *reinterpret_cast<const uint32_t*>(v + (c + 12) * R::kRB);
      Int4Quad(__byte_perm(wa, wb, 0x5410), a[0][0]);  // dims 8 g + i: keys (c, c + 4)
      Int4Quad(__byte_perm(wa, wb, 0x7632), a[0][1]);  // dims 8 g + 4 + i
      Int4Quad(__byte_perm(wc, wd, 0x5410), a[1][0]);  // keys (8 + c, 12 + c)
      Int4Quad(__byte_perm(wc, wd, 0x7632), a[1][1]);
    } else {  // bytes 8 g .. 8 g + 7 of the four key rows
      const uint8_t* v = st + h * R::kStageBytes + R::kV + 8 * g;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const uint2 x0 = *reinterpret_cast<const uint2*>(v + (8 * hf + c) * R::kRB);
        const uint2 x1 = *reinterpret_cast<const uint2*>(v + (8 * hf + c + 4) * R::kRB);
        Int8KeyPairs(x0.x, x1.x, a[hf][0]);
        Int8KeyPairs(x0.y, x1.y, a[hf][1]);
      }
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) MmaRows16(o[mt], a[0][0][mt], a[0][1][mt], a[1][0][mt], a[1][1][mt], b0, b1);
  }
}

// A transposed window's column sums: l and sum p m_v of query-head columns 2c, 2c + 1 over the keys of every row g.
__device__ __forceinline__ void ColumnSumsT(float* lw, float* mvw) {
#pragma unroll
  for (int x = 4; x < 32; x <<= 1)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      lw[e] += __shfl_xor_sync(0xffffffffu, lw[e], x);
      mvw[e] += __shfl_xor_sync(0xffffffffu, mvw[e], x);
    }
}
// The end of a transposed INT4 window (Note [Paged CUDA v3 transposed INT4]): its state (per query-head column
// m, l, sum p m_v, and O^T) merged into the block's m, l and o of layout 0 through the warp's ring, whose copies
// have all landed.
__device__ __forceinline__ void MergeWindowT(uint8_t* wring, int lane, const float* mw, float* lw, float* mvw,
                                             const float (*ow)[4], float& m, float& l, float (*o)[4]) {
  constexpr int D = 64, kRow = D + 1;  // [8 heads][65] floats: O with sum p m_v on every dim, then m and l per head
  const int g = lane >> 2, c = lane & 3;
  CpAsyncWait<0>();
  ColumnSumsT(lw, mvw);
  float* buf = reinterpret_cast<float*>(wring);
  float* ml = buf + 8 * kRow;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) buf[(2 * c + (e & 1)) * kRow + 8 * g + mt + 4 * (e >> 1)] = ow[mt][e] + mvw[e & 1];
  if (g == 0) {
    ml[2 * c] = mw[0], ml[2 * c + 1] = mw[1];
    ml[8 + 2 * c] = lw[0], ml[8 + 2 * c + 1] = lw[1];
  }
  __syncwarp();
  const float mr = ml[g], lr = ml[8 + g];
  const float mn = fmaxf(m, mr);
  if (mn != -INFINITY) {
    const float ca = Exp2(m - mn), cb = Exp2(mr - mn);
    l = l * ca + (c == 0 ? lr * cb : 0.0f);  // l is a per-lane partial: the window's sum on one lane of the quad
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      o[nt][0] = o[nt][0] * ca + buf[g * kRow + nt * 8 + 2 * c] * cb;
      o[nt][1] = o[nt][1] * ca + buf[g * kRow + nt * 8 + 2 * c + 1] * cb;
    }
    m = mn;
  }
  __syncwarp();  // the ring is the next window's
}

// Tiles per step of a register-decoded window: the transposed INT4 loop's ORTKV_PAGED_V3_INT4T_NT (4: 64 keys per
// step, Note [Paged CUDA v3 transposed INT4]); else 2 (32 keys: one softmax update and two independent tiles'
// products per step) where the warp's ring holds >= 3 such steps, else 1.
#ifndef ORTKV_PAGED_V3_INT4T_NT  // tiles per step of the transposed INT4 loop (an A/B knob for paged_sweep.cu)
#define ORTKV_PAGED_V3_INT4T_NT 4
#endif
template <int F, int D>
__host__ __device__ constexpr int RegStepTiles() {
  if (F == kInt4F && D == 64) return ORTKV_PAGED_V3_INT4T_NT;
  return Cfg<D>::kWarpBytes / (2 * RegCfg<F, D>::kStageBytes) >= 3 ? 2 : 1;
}

// WindowTiles for a uniform window of INT4 or INT8 pages under float16 queries (Note [Paged CUDA v3 register
// decode]): warp w takes the window's steps of NT tiles w, w + kWarps, ...; o leaves in layout RegModeD<D>(F)
// (INT4 at head size 64: the transposed form, Note [Paged CUDA v3 transposed INT4]).
// POW2: ps == 1 << ps_shift (the page of a key offset by a shift, and no division in the loop's code).
template <int D, int F, bool POW2>
__device__ __forceinline__ void WindowTilesReg(const PageWindow& sh, uint8_t* wring, int64_t s0, int64_t s1,
                                               int64_t p0, int ps, int ps_shift, int hk, int warp, int lane,
                                               const __half* qrow, int gn, float qscale, float& m, float& l,
                                               float (*o)[4]) {
  using R = RegCfg<F, D>;
  constexpr bool kT = RegTransposed<D>(F);  // Note [Paged CUDA v3 transposed INT4]
  constexpr int NT = RegStepTiles<F, D>();
  constexpr int kStep = NT * R::kStageBytes;
  constexpr int kStages0 = Cfg<D>::kWarpBytes / kStep;
  constexpr int kStages = kStages0 < 8 ? kStages0 : 8;
  static_assert(kStages >= 2, "");
  const auto page_of = [&](int x) { return POW2 ? x >> ps_shift : x / ps; };
  const WindowGeom wg = Geom(s0, s1, p0, ps, hk);
  const int base_off = wg.base_off, lo = wg.lo, win = wg.win, n_tiles = wg.n_tiles;
  const uint32_t hrow = wg.hrow;
  const int n_steps = (n_tiles + NT - 1) / NT;
  const int mine = n_steps > warp ? (n_steps - warp + kWarps - 1) / kWarps : 0;
  const FormatInfo fi = sh.fi[F];
  int next = 0, stage_in = 0;
  constexpr int kLpt = 32 / NT;                  // tile gt of a step is copied by lanes [gt * kLpt, (gt + 1) * kLpt)
  const int gt = lane / kLpt, gj = lane % kLpt;  // (Note [Uniform INT4 group copies])
  auto issue = [&]() {
    const int tile = (warp + next * kWarps) * NT + gt;
    if (next < mine && gt < NT && tile < n_tiles) {
      const int o0 = base_off + tile * kTile;
      const int lp = page_of(o0);
      IssueNarrow<F, D, kLpt>(wring + stage_in * kStep + gt * R::kStageBytes, sh.page[lp], fi,
                              hrow + static_cast<uint32_t>(o0 - lp * ps), gj);
    }
    CpAsyncCommit();
    ++next;
    stage_in = stage_in + 1 == kStages ? 0 : stage_in + 1;
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue();
  // the query's fragments for this format, read while the prologue's copies fly (the lane's quarter of its row:
  // 8 registers, not kept from the kernel's start)
  uint32_t qa[D / 16][2];
  float qsum, k0;
  {
    uint32_t qc[D / 8];
    LoadQueryChunk<D>(qrow, lane >> 2, gn, lane & 3, qc);
    RegQuery<F, D>(qc, qscale, qa, &qsum, &k0);
  }
  // the transposed form's window state, per query-head column 2c, 2c + 1 (rows of lanes 8c and 8c + 4)
  float qs[2] = {0.0f, 0.0f}, kc[2] = {0.0f, 0.0f};
  if constexpr (kT) {
    const int c = lane & 3;
    qs[0] = __shfl_sync(0xffffffffu, qsum, 8 * c), qs[1] = __shfl_sync(0xffffffffu, qsum, 8 * c + 4);
    kc[0] = __shfl_sync(0xffffffffu, k0, 8 * c), kc[1] = __shfl_sync(0xffffffffu, k0, 8 * c + 4);
  }
  float mv = 0.0f;
  float mw[2] = {-INFINITY, -INFINITY}, lw[2] = {0.0f, 0.0f}, mvw[2] = {0.0f, 0.0f};
  float ow[4][4] = {};  // O^T of the window: dims 8 g + mt (+ 4), columns 2c, 2c + 1
  int stage = 0;
  for (int it = 0; it < mine; ++it, stage = stage + 1 == kStages ? 0 : stage + 1) {
    CpAsyncWait<kStages - 2>();
    __syncwarp();  // this step's copies landed for the whole warp; the slot refilled next was read
    issue();
    const int off = (warp + it * kWarps) * NT * kTile;  // from a0
    const auto valid = KeysInWindow<NT * kTile>(off, lo, win);
    if constexpr (kT)
      NarrowTilesT<F, NT>(wring + stage * kStep, qa, qs, kc, lane, valid, mw, lw, mvw, ow);
    else
      RegTiles<F, D, NT>(wring + stage * kStep, qa, qsum, k0, lane, valid, m, l, mv, o);
  }
  if constexpr (kT) {
    MergeWindowT(wring, lane, mw, lw, mvw, ow, m, l, o);
    return;
  }
  mv += __shfl_xor_sync(0xffffffffu, mv, 1);  // the quad's keys: sum_j p_j m_j of query head g
  mv += __shfl_xor_sync(0xffffffffu, mv, 2);
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    o[nt][0] += mv;
    o[nt][1] += mv;
  }
}

// Re-lays o from layout `from` to layout `to` (DimOf) through the warp's ring (free between windows: the previous
// window's copies were waited for, and its reads are behind the window's block barrier).
template <int D>
__device__ __forceinline__ void ConvertO(uint8_t* wring, int lane, int from, int to, float (*o)[4]) {
  float* buf = reinterpret_cast<float*>(wring);  // [8 heads][D]
  const int g = lane >> 2, c = lane & 3;
  __syncwarp();
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) buf[g * D + DimOf(from, nt, 2 * c + e)] = o[nt][e];
  __syncwarp();
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) o[nt][e] = buf[g * D + DimOf(to, nt, 2 * c + e)];
  __syncwarp();
}
static_assert(8 * 128 * 4 <= Cfg<128>::kWarpBytes && 8 * 64 * 4 <= Cfg<64>::kWarpBytes, "ConvertO fits a warp's ring");

// Blocks per SM the compiler must leave room for (__launch_bounds__' second argument). 1 lets it take the 199
// registers per thread it wants (2 blocks of 4 warps per SM on the H200). Measured (benchmarks/cuda/paged_sweep.cu,
// benchmarks/results/paged_attention_cuda_h200.md): 3 (168 registers, no spills) is slower for F16 pages at 8K x 8
// (22.6 -> 23.2-23.6 us) and faster for INT8 / INT4 at 32K x 8 (54.7 -> 51.0, 59.1 -> 54.5); 4 spills and is slower.
// A build flag for A/B runs: `nvcc ... -DORTKV_PAGED_V3_MIN_BLOCKS=3 benchmarks/cuda/paged_sweep.cu`.
#ifndef ORTKV_PAGED_V3_MIN_BLOCKS
#define ORTKV_PAGED_V3_MIN_BLOCKS 1
#endif
// The page formats PagedAttentionV3 is compiled for (bit f: PageFormat f; 0xFF, every format and the mixed windows'
// loop, is the only value the library is built with). A harness-only A/B knob: `nvcc ... -DORTKV_PAGED_V3_FORMATS=1u
// -DORTKV_PAGED_V3_MIN_BLOCKS=3 benchmarks/cuda/paged_sweep.cu` builds a kernel for uniform F16 windows alone (a
// window of any other format traps), to measure what a format-specialized kernel with fewer registers would gain.
// Measured on the H200 (benchmarks/results/paged_attention_cuda_h200.md): F16-only (143 / 167 registers) and
// INT4-only (165 / 168) kernels at 3 blocks / SM are 2-10 % slower at 8K keys than this every-format kernel, also
// with the small combine (Note [Combine in one load round]); INT4-only is 5 % faster at 32K x 1 alone.
#ifndef ORTKV_PAGED_V3_FORMATS
#define ORTKV_PAGED_V3_FORMATS 0xFFu
#endif
// CLUSTER: Note [Paged CUDA cluster merge] (instantiated with EARLY only).
template <typename T, int D, bool EARLY = false, bool CLUSTER = false>
__global__ void __launch_bounds__(kThreads, ORTKV_PAGED_V3_MIN_BLOCKS) PagedAttentionV3(const AttnArgs args) {
  using C = Cfg<D>;
  constexpr bool BF = std::is_same<T, __nv_bfloat16>::value;  // the products' 16-bit type is the queries'
  extern __shared__ __align__(128) unsigned char dsm[];
  PageWindow& sh = *reinterpret_cast<PageWindow*>(dsm);
  uint8_t* ring = dsm + kRingOffset;  // Note [Paged CUDA v3 ring alignment]
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
  const PagedAttentionCudaView& a = args.v;
  const BlockUnit bu = BlockUnitOf(args);
  const int64_t S = a.splits, split = bu.split, t = bu.t, b = bu.b, G = bu.G, g0 = bu.g0;
  const int hk = bu.hk, gn = bu.gn;
  const int ps = a.p.shape.page_size;  // a multiple of kTile (the launch checks)
  const int ps_shift = (ps & (ps - 1)) == 0 ? __ffs(ps) - 1 : -1;  // page index by a shift where it can be
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) sh.key = kNoError;

  // this lane's raw query pairs (row g = lane / 4: head g0 + g when g < gn), loaded before `start` so that the
  // two loads overlap (as dense v3); converted into the mma fragments below, once `start` is back
  const int g = lane >> 2, c = lane & 3;
  uint32_t qr[D / 16][2];
  const T* qrow = static_cast<const T*>(a.q) + ((b * a.T + t) * a.Hq + hk * G + g0 + g) * a.D;
  if constexpr (!EARLY) LoadQueryPairs<T, D>(qrow, g, gn, c, qr);

  bool bad_start = false;
  int64_t st0 = ClampedStart(a, b, &bad_start), j0 = 0, j1 = 0;
  const auto chunk_of = [&]() {  // this block's keys [j0, j1) of the row's [0, st0 + t + 1)
    const int64_t L = st0 + t + 1;
    SplitKeys<kTile>(L, S, split, &j0, &j1);  // whole tiles: no tile read by two blocks (as dense v3)
  };
  chunk_of();

  LoadFormats(a, tid, sh);
  // EARLY: the first window's pages are resolved before the wait, the page of row st0 included (checked after it:
  // Note [Paged CUDA late pages]; its rows are read after the wait: Note [CUDA attention early start])
  bool pre = false, pre_bad = false;
  uint32_t pre_formats = 0;
  if constexpr (EARLY) {
    constexpr int kPer = kMaxPages / kThreads;
    int64_t pre_ids[kPer];
    uint32_t pre_bad_bits = 0;
    if (j0 < j1) {
      const auto [p0, s1, p1] = pv2::WindowAt(j0, j1, ps);
      pre_bad = ResolveWindow(a, b, p0, p1, tid, sh, &pre_formats, pre_ids, &pre_bad_bits);
      pre = true;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the previous kernel's writes are visible from here
#endif
    LoadQueryPairs<T, D>(qrow, g, gn, c, qr);
    bool bad2 = false;
    const int64_t st2 = ClampedStart(a, b, &bad2);
    if (st2 != st0 || bad2 != bad_start) {  // `start` was written by the previous kernel: resolve after the wait
      st0 = st2, bad_start = bad2, pre = false;
      if (tid == 0) sh.key = kNoError;  // a bad page seen above is not this row's (ResolveWindow syncs first)
      chunk_of();
    } else if (pre && j1 > st0 && !a.static_tables) {  // block-uniform: the window holds the pages of rows from
      // st0 on (with static tables, Note [Paged CUDA static tables], what was read is final), whose table
      // entries and directory rows the kernel before may have written (the table computed on the device): read
      // again, against what was resolved before the wait (the page's id, format and address); any change, or a
      // bad page among them, and the window is resolved after the wait
      const auto [p0, s1, p1] = pv2::WindowAt(j0, j1, ps);
      bool stale = false;
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int64_t pi = p0 + tid + k * kThreads;
        if (pi <= p1 && (pi + 1) * ps > st0) {
          const int64_t id = pre_ids[k], id2 = TableAt(a.p, b, pi);
          const DirRow r = DirectoryRow(a.p, id);
          stale = stale || ((pre_bad_bits >> k) & 1u) != 0 || id2 != id || r.f != sh.fmt[pi - p0] ||
                  LayerBaseAt(a.p, r.f, r.off) != sh.page[pi - p0];
        }
      }
      if (__syncthreads_or(stale) != 0) {
        pre = false;
        if (tid == 0) sh.key = kNoError;  // every early atomicMin is done (the barrier); the window's checks rerun
      }
    }
  }

  // this lane's query fragments from the raw pairs (zeros for padding rows: qr is 0 there)
  uint32_t qa[D / 16][2];
  const float qscale = a.scale * 1.4426950408889634f;  // base-2 scores
  QueryFragments<BF, D>(qr, qscale, qa);
  float m = -INFINITY, l = 0.0f, o[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;

  uint8_t* wring = ring + warp * C::kWarpBytes;
  bool skip = false;
  int mode = 0;  // the layout of o: DimOf (Note [Paged CUDA v3 register decode])
  for (int64_t s0 = j0; s0 < j1;) {
    const auto [p0, s1, p1] = pv2::WindowAt(s0, j1, ps);
    uint32_t formats = 0;
    if (pre && s0 == j0 ? (formats = pre_formats, pre_bad) : ResolveWindow(a, b, p0, p1, tid, sh, &formats)) {
      skip = true;
      break;
    }
    // Note [Paged CUDA v3 uniform windows]: one format for the whole window -> a loop without the format switch
    const int uf = (formats & (formats - 1)) == 0 ? __ffs(static_cast<int>(formats)) - 1 : -1;
    const int want = BF ? 0 : RegModeD<D>(uf);
    if (want != mode) {  // block-uniform; o is all zeros before the first window
      if (s0 != j0) ConvertO<D>(wring, lane, mode, want, o);
      mode = want;
    }
    switch (uf) {
#define ORTKV_WINDOW3(F) WindowTiles<T, D, F>(sh, wring, s0, s1, p0, ps, ps_shift, hk, warp, lane, qa, m, l, o)
#define ORTKV_WINDOW3R(F)                                                                          \
  if constexpr (BF) {                                                                              \
    ORTKV_WINDOW3(F);                                                                              \
  } else {                                                                                         \
    const __half* qh = reinterpret_cast<const __half*>(qrow);                                      \
    if (ps_shift >= 0)                                                                             \
      WindowTilesReg<D, F, true>(sh, wring, s0, s1, p0, ps, ps_shift, hk, warp, lane, qh, gn, qscale, m, l, o); \
    else                                                                                           \
      WindowTilesReg<D, F, false>(sh, wring, s0, s1, p0, ps, ps_shift, hk, warp, lane, qh, gn, qscale, m, l, o); \
  }
#define ORTKV_IF_FORMAT(F, X)                                     \
  if constexpr (((ORTKV_PAGED_V3_FORMATS >> (F)) & 1u) != 0u) { \
    X;                                                          \
  } else {                                                      \
    __trap();                                                   \
  }
      case 0: ORTKV_IF_FORMAT(0, ORTKV_WINDOW3(0)); break;
      case 1: ORTKV_IF_FORMAT(1, ORTKV_WINDOW3(1)); break;
      case 2: ORTKV_IF_FORMAT(2, ORTKV_WINDOW3R(2)); break;
      case 3: ORTKV_IF_FORMAT(3, ORTKV_WINDOW3(3)); break;
      case 4: ORTKV_IF_FORMAT(4, ORTKV_WINDOW3R(4)); break;
      case 5: ORTKV_IF_FORMAT(5, ORTKV_WINDOW3(5)); break;
      case 6: ORTKV_IF_FORMAT(6, ORTKV_WINDOW3(6)); break;
      case 7: ORTKV_IF_FORMAT(7, ORTKV_WINDOW3(7)); break;
      default:
        if constexpr (ORTKV_PAGED_V3_FORMATS == 0xFFu) {
          ORTKV_WINDOW3(-1);
        } else {
          __trap();
        }
        break;
#undef ORTKV_IF_FORMAT
#undef ORTKV_WINDOW3R
#undef ORTKV_WINDOW3
    }
    CpAsyncWait<0>();
    s0 = s1;
  }
  if (skip) {
    m = -INFINITY;
    l = 0.0f;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = 0.0f;
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  CpAsyncWait<0>();
  __syncthreads();
  unsigned long long counted = 0;  // thread 0: Note [Paged CUDA last block reports]
  if (tid == 0) {  // the block's key (Note [Paged CUDA one-launch report])
    const unsigned long long sk = bad_start ? Key(kClassRow, static_cast<unsigned long long>(b) << 28) : kNoError;
    sh.key = sk < sh.key ? sk : sh.key;
    if constexpr (!CLUSTER) counted = StoreBlockKey(a, sh.key);
  }
  float* fin = CLUSTER ? reinterpret_cast<float*>(ring + C::kRingBytes) : nullptr;  // at SmemBytes<D>()
  MergeWarpTiles<kWarps, D>(
      *reinterpret_cast<Merge*>(ring), m, l, o, gn,
      [&](int gg, int d, float mb, float lb, float ab) {
        EmitBlock<T, D, CLUSTER>(a, bu, fin, skip, gg, d, mb, lb, ab);  // a skipped block fails in `fin`
      },
      [mode](int nt, int n) { return DimOf(mode, nt, n); });
  if constexpr (CLUSTER)  // Note [Paged CUDA cluster merge]
    tile16::ClusterMerge<T, D>(
        fin, static_cast<int>(S), gn, tid, kThreads, [&](int gg) { return OutRow<T>(a, bu, gg); },
        [&](auto& cl, bool flagged) {
          if (flagged || bad_start) ClusterReport(a, bu, &sh.key, cl);
        });
  else if (tid == 0)
    ReportBlockKey(a, bu, sh.key, counted);  // Note [Paged CUDA one-launch report]
}

template <typename T, int D>
cudaError_t LaunchD(const AttnArgs& a, cudaStream_t stream) {
  static const AttnKernels k =
      MakeKernels(PagedAttentionV3<T, D>, PagedAttentionV3<T, D, true>, PagedAttentionV3<T, D, true, true>,
                  SmemBytes<D>(), SmemBytes<D>() + kFinBytes<D>,
                  tile16::kMaxClusterRanks);  // Note [Paged CUDA cluster merge]
  return LaunchOneWave<T>(k, a, stream);
}

template <typename T>
cudaError_t Launch(const AttnArgs& a, cudaStream_t stream) {
  return a.v.D == 64 ? LaunchD<T, 64>(a, stream) : LaunchD<T, 128>(a, stream);
}

}  // namespace pv3

// ---- PagedCacheAttention over pages of one 16-bit format: Note [Paged CUDA uniform 16-bit] ----------------------
// Note [Paged CUDA uniform 16-bit]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A node whose `page_format` attribute names the queries' own 16-bit format (F16 pages under float16 queries,
// BF16 under bfloat16) promises that every page it reads has that format: ortkv's single-format policies set it.
// Such pages need no decode, no per-window format mask and no page window in shared memory, so the node runs dense
// v3's kernel shape (Note [CacheAttention CUDA v3]: 4 warps, a 4-deep ring at head size 64, 3 deep at 128, ~128
// registers, 3 blocks per SM, the ring's prologue issued before griddepcontrol.wait) with one difference: a tile's
// 16 rows come from the page that holds them. Each lane resolves the page of one of its warp's next 32 tiles
// (table entry, directory row, every check of PageProblem plus "the format is the attribute's"), the warp reads a
// tile's pointer from the lane that resolved it (a shuffle), and the 33rd tile's batch is resolved when it is
// reached. Before the wait the first batch of pages is resolved and the prologue's rows before `start` are copied
// (Note [CUDA attention early start]); after it this step's rows and the rest (Note [Paged CUDA late pages]). A bad
// page is recorded in the block's key (atomicMin, the order of v3's) and the block's output is empty, as v3; a page
// of another format is problem kPageFormatHint (the report says which attribute and which page). Without the attribute, or for any other format, Note [Paged CUDA v3] runs.
// H200, SmolLM2 heads, pages of 16 (benchmarks/results/paged_attention_cuda_h200.md, 2026-12-03): 124 registers at
// head size 64, 3 blocks per SM; through ORT F16 pages promised at 0.98 / 1.05 / 1.00 / 1.00x dense v3's time at
// 8K x 1 / 8K x 8 / 32K x 8 / 128K x 4 keys x rows (the every-format kernel 1.25 / 1.15 / 1.05 / 1.04x).
// Where a short node's paged-only time goes (H100, twenty-sixth session;
// benchmarks/results/paged_attention_cuda_h200.md): ncu of 128 keys x 1 row, dense v3 against this kernel, both
// isolated: 16,638 against 19,467 warp instructions, 7,575 / 9,303 of them before griddepcontrol.wait (the page
// resolution, which overlaps the kernel before) and 9,063 / 10,164 after it (the prologue's late copies and the block's
// end: ~90 more a warp). Two changes aimed at them gained nothing in the harness (within +-1 % at 16-1K keys): each
// lane's first table entry read beside `start` (one round trip fewer before the first copy) and the tile copies' row
// tests in 32 bits with a test-free path for whole tiles; nor, through ORT, `start` clamped without RowTotal's
// page_fill branch in the v3 kernels (F16 pages unchanged, the uniform INT4 / INT8 kernels 2-5 % slower).
// What is left is after the wait: ~1 us of spinning added before it (twenty-seventh session, through ORT) left
// every short node as fast (128 x 1 1.12 -> 1.11x dense), so the page resolution and the prologue's copies are hidden
// behind the node before with time to spare. An empty asm does not keep arithmetic before the wait (ptxas moves it).
// Also measured through ORT and not kept: the last thread's key tail (Note [Uniform key thread]) skipped before the
// merge in blocks that report themselves (F16 pages 0.02 slower at 16 / 128 keys x 1 row; the kernel grew by ~700
// instructions); and the kernel parameters are not the gap (dense with 640 unused bytes more times the same).
// Note [Uniform fin stores]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A clustered uniform block (16-bit or INT4 / INT8) leaves its merged partial in `fin` for the cluster's rank 0.
// It used to go through EmitMerged, whose one pointer is either `fin` (shared memory) or the combine's partials
// (global memory), indexed by the runtime head size: generic stores (ST, 6 in the SASS) and 64-bit index math for
// every element. FinishUniform now writes `fin` itself at the compile-time head size, as dense v3 does (STS; the
// clustered 16-bit kernel 4,640 -> 4,600 instructions, 120 -> 115 registers; INT4 4,576 -> 4,528; the unclustered
// kernels' SASS unchanged). ncu of the clustered 512 x 1 node before it: 96 warp instructions more than dense v3
// between the key loop and the first cluster barrier. Through ORT on an H100 (a wheel of it against HEAD's,
// alternated twice in one lease, `bench_paged_attention_cuda.py --rounds 5 --cells 512x1,1024x1,128x1@2048,
// 1024x1@2048,128x1`), F16 static / dense 1.11 -> 1.10 at 512 x 1, 1.09 -> 1.08 at 1K x 1 and 1K keys in a 2K table,
// 1.09 -> 1.07 at 128 keys in a 2K table, 128 x 1 (unclustered, the control) 1.11 both; INT4 at 512 x 1 5.0 ->
// 4.8 us. pytest -m cuda tests/test_cuda_paged.py: 618 passed on that wheel.
// The every-format kernel (PagedAttentionV3) does the same since the twenty-seventh session (clustered, head size 64:
// 225 -> 221 registers); through ORT on an H100, its wheel against HEAD's alternated twice in one lease
// (`bench_paged_attention_cuda.py --rounds 5 --reps 20 --kinds dense,F16,INT4 --cells 16x1,128x1,512x1,1024x1,
// 128x1@2048,8192x1`), its F16 pages / dense 1.35-1.36 -> 1.33 at 512 x 1, 1.33-1.34 -> 1.30-1.31 at 1K x 1,
// 1.35-1.36 -> 1.33 at 128 keys in a 2K table; INT4 pages 6.3-6.4 -> 6.2 us at 512 x 1, 6.6-6.7 -> 6.5 at 1K x 1;
// the unclustered cells (16 / 128 / 8K x 1) unchanged. EmitMerged keeps only the unclustered blocks' stores.
// Measured with it and not kept: those stores from two row bases computed once per block at the compile-time head
// size (an int offset per element; the single-split store 11 -> 7 instructions in the merge loop of the unclustered
// 16-bit kernel): F16 static / dense at 128 x 1 1.11 / 1.10 -> 1.11 / 1.11, 16 x 1 1.08 -> 1.09-1.10, 16 x 8 1.01 ->
// 1.03 (same lease, two alternated rounds; benchmarks/results/paged_attention_cuda_h200.md).
// Note [Paged CUDA late pages]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Launched early (Note [CUDA attention early start]), both v3 kernels resolve the first window of pages before
// griddepcontrol.wait, the page that holds row `start` included (the "late" pages: those of this step's rows), and
// the uniform 16-bit kernel also copies the prologue's rows before `start` from them. Only the late pages' table
// entries and directory rows may have been written by the kernel before (a page table computed on the device;
// ortkv's own kernels write neither), so after the wait the block of the row's last keys reads each late page's
// entry and row again and compares them with what it resolved (id, format, offset / address); a change, in any
// thread (__syncthreads_or), and the block resolves again after the wait (the uniform kernel starts over, as for a
// changed `start`; the every-format kernel resolves its first window again). A bad page seen before the wait stays
// reported only if it is still bad after it. The uniform kernel issues this step's rows from the early pages
// before that barrier, so the check overlaps their copy.
// H200, paged_sweep (head size 64, pages of 16, three alternated rounds, medians; benchmarks/results/
// paged_attention_cuda_h200.md, "sixth session"), before -> after: 16 keys x 1 row uniform F16 3.04 -> 2.53 us,
// every-format F16 3.91 -> 3.58, INT4 5.22 -> 4.79; 1K x 1 uniform 5.84 -> 5.68; 16 x 8 uniform 4.32 -> 3.83;
// 8K x 1 6.92 -> 6.71; 8K x 8 16.94 -> 16.90. Without the check (every late page trusted) the short rows gained
// more (16 x 1 uniform 2.25 us, every-format 3.10): the check's barrier and loads cost ~0.3-0.5 us there; that
// variant would make a page table computed on the device by a kernel that lets its dependents start early unsafe,
// so it is not kept. Nor is a check deferred to after the keys (the uniform kernel streaming again on a change):
// the same 2.54 us at 16 x 1, but the loop lifted the kernel from 124 to 168 registers and 8K x 8 to 18.94 us.
// Note [Paged CUDA static tables]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The second look of Note [Paged CUDA late pages] guards against one writer: the kernel right before this node, when
// it lets its dependents start early and writes this node's page table or directory. A node whose tables are graph
// inputs or initializers (written before the run, by the host or a copy, never by a kernel of the graph) has no
// such writer, so PagedCacheAttention's optional attribute static_tables = 1 promises it, and both v3 kernels then
// keep what they resolved before griddepcontrol.wait: no re-read of the late pages, no __syncthreads_or, and a bad
// page seen before the wait is the report (the row, the page, as without the attribute). `start` is read again
// after the wait either way (its own check, block-uniform, no barrier). The promise cannot be verified on the
// device, so ortkv's checker (rule static-tables, python/ortkv/graph/checker.py) refuses it on a table that a node
// computes or writes in place; the paged decoder (python/ortkv/generate/paged.py, "paged4") sets it on every node,
// its tables being graph inputs. The CPU kernels read the tables once either way and ignore it.
// H200, harness (benchmarks/cuda/paged_sweep.cu, `paged_sweep 20 0145678 F4`, one run; levels v3u / v3us: uniform
// F16 without / with the attribute, v3 / v3s the every-format kernel; us): 16 keys x 1 row 2.57 -> 2.35 (uniform),
// 3.59 -> 3.09 (every-format F16), 4.81 -> 4.28 (INT4); 16 x 8 3.81 -> 3.61, 4.72 -> 4.26, 6.64 -> 6.12; 1K x 1
// 5.72 -> 5.65, 6.96 -> 6.72; 16 / 128 keys in a 2K table 4.59 -> 4.37 / 5.02 -> 4.79 (uniform); 8K x 1 / 8K x 8
// unchanged (6.70 / 6.65, 17.00 / 17.02; INT4 8.59 / 8.60, 13.58 / 13.57). Through ORT against dense CacheAttention
// (benchmarks/results/paged_attention_cuda_h200.md, tenth session): F16 promised with static tables 1.10 / 1.12 /
// 1.12x dense at 16 / 128 / 1K keys x 1 row (1.18-1.20 / 1.14 without), 1.07-1.09x in 2K-key tables.
// Note [Uniform key thread]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The block's failure key after the streaming (the s_key store with the start's failure, StoreBlockKey,
// ReportBlockKey) is the work of the block's LAST thread: warp 3 has the fewest tiles and waits at the merge's
// barrier anyway, where thread 0 (warp 0, the most tiles) did it between its streaming and the merge. A timing
// build without that tail (no key at all) had shown what it cost: 16 x 1 2.39 -> 2.16 us, 128 x 1 2.83 -> 2.61.
// H200 harness (`paged_sweep 20 4,9,6,13,11,5 F`, uniform F16 with static tables, two alternated rounds, us; dense
// v3 in the same lease `QUICK=1 RANDOM=1 attention_sweep 20 10,11,12,14,15`): 16 keys x 1 row 2.38-2.39 -> 2.26-2.27
// (dense 2.05-2.06), 128 x 1 2.82 -> 2.71 (2.45-2.47), 16 x 8 2.76 -> 2.59-2.60, 144 x 8 in a 256-key table
// 3.89-3.90 -> 3.70; the clustered 512 / 1K x 1 unchanged (4.45 / 4.47-4.48 us; dense 3.69-3.70 / 3.97-3.99).
// Through ORT (bench_paged_attention_cuda.py, before / after alternated twice), F16 static / dense: 16 x 1 1.12 ->
// 1.06-1.07, 128 x 1 1.13-1.14 -> 1.08, 16 x 8 0.99 -> 0.93-0.94, 512 / 1K x 1 1.13-1.15 -> 1.13-1.14.
// Measured beside it and not kept: the key folded into the merge (EmitMerged reading s_key after the merge's own
// barrier instead of a branch over m / l / o before it): no change anywhere; that plus the start's failure folded
// into s_key where it is known: 512 / 1K x 1 -0.04-0.08 us, every other cell +0.02-0.07.
// The key it reports (the block's key with the start's failure) goes into a shared slot of its own (s_rep, which
// the cluster's rank 0 reads): stored into s_key, as it was, it raced with the other warps' read of s_key after the
// same barrier (a lagging warp could take a bad start for a bad page and empty its output).
//
// Note [Uniform short loop]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A warp whose tiles all went into the ring before the key loop (mine <= ST - 1: every warp of a block of at most
// 4 (ST - 1) tiles, 192 keys at head size 64, 128 at 128) streams them with an issue() that only commits its empty
// group: the loop instance with the real issue() has ptxas hoist the copy addresses of later
// tiles into the loop's preamble (~63 instructions a warp at sm_90, on the critical path of a node of a few tiles:
// one warp a scheduler, nothing hides an instruction's latency), the commit-only instance ~35. The kernel 4,456 ->
// 4,752 SASS instructions (the loop twice).
//
// Note [Uniform in-block report]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A node that reports in its block (ReportsInBlock: one batch row, one split, so no cluster and no combine) is
// launched early as its own instantiation (INBLOCK): the last thread's key tail before the merge is the min with
// the start's failure alone (no s_rep, which only a cluster's rank 0 reads; no StoreBlockKey with its
// LastBlockReports / ReportsInBlock parameter tests), and after the merge it reports as ReportBlockKey's
// ReportsInBlock branch does (a failure, from the block of the last token's KV head 0, head block 0): the
// instantiation 4,376 SASS instructions against the early one's 4,752. The plain launch (no programmatic launch)
// keeps the general kernel.
//
// Both measured on an H100 through ORT (benchmarks/results/paged_attention_cuda_h200.md, twenty-eighth session;
// `bench_paged_attention_cuda.py --rounds 7 --reps 20 --kinds "dense,F16 static,INT4 uniform"`, wheels alternated
// in one lease), F16 pages with static tables, us (HEAD -> short loop -> both): 128 keys x 1 row 2.8 (9 runs of 9)
// -> 2.7-2.8 -> 2.7 (7 of 9), 512 x 1 4.8-4.9 -> 4.7-4.8 -> 4.7-4.8, 8K x 1 6.6-6.7 -> 6.4-6.6 -> 6.4-6.6; 16 x 1
// 2.3-2.4 throughout; against dense in the same process (whose wheel carried the same commit-only loop in dense v3,
// below): 16 x 1 1.08-1.09 -> 1.03-1.04 -> 1.05-1.06, 128 x 1 1.11-1.13 -> 1.08-1.09 -> 1.07 (1.09 once), 512 x 1
// 1.09-1.11 -> 1.08 -> 1.08. The in-block report took 0.01 off 128 x 1 and put 0.01-0.02 on 16 x 1 (there warp 0
// holds the node's only tile, and warp 3's tail was not on the critical path). The same commit-only loop in dense
// CacheAttention v3 made dense slower (8K x 1 6.5-6.6 -> 6.6-6.9 us, 16 x 8 2.7-2.8 -> 2.8-3.0, 128 x 1 2.5 -> 2.5-2.6)
// and in the uniform INT4 / INT8 kernel changed nothing measurable (INT4 128 x 1 3.1 -> 3.0-3.1 us, INT4 / F16 at 8K
// x 8 0.55-0.56 -> 0.54-0.55); neither was kept, so the ratios above are against a dense kernel a little slower than
// this build's (128 x 1: 2.6 us in 4 of its 15 runs, HEAD's 2.5 in all 9). This build (its 16 uniform 16-bit kernels
// the short-loop + in-block wheel's, its other 257 HEAD 8f85a41's, by cuobjdump), timed as one on an H100 later that
// day (two runs, 7 rounds each): F16 static / dense 1.05-1.06 at 16 x 1, 1.07 at 128 x 1 (2.7 / 2.5 us), 1.07 at 512
// x 1, 1.05-1.06 at 1K x 1, 0.98-1.05 from 8K keys on.
namespace pu {

using tile16::kTile;

// Note [Uniform kernel helpers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The pieces the uniform kernels share (the 16-bit one and its INT4 twin, Note [Paged CUDA uniform INT4]): a lane's
// page resolution (UniformPage), the late-page check (SeenPageChanged), the restart (RestartKey) and the block's end
// (FinishUniform). Their shape is the one whose sm_90 SASS is the inline code's (cuobjdump, 2026-12-05): a first
// form (a SeenPage struct, the offset returned with -1 for a bad page, every o lane zeroed) added 8-72 instructions
// per instantiation; with the page record as four scalars behind pointers, `res` set inside, a bool result and ZL
// lanes zeroed, 10 of the 18 instantiations are the inline code's instruction for instruction and the other 8 (EARLY)
// differ only in the order and registers of the few FSEL / STS that write the bad-page m and l and the merge arrays
// at the block's end (8-48 lines of 9-15K). Not yet run on a GPU (no device was lent that session): `paged_sweep 20
// 4,9,5,0,1,2,3 F4` and `pytest -m cuda` on the next one.
//
// Entry pi of row b: true with the page's offset in the pool in *off if it passes every check of PageProblem and has
// format uf, else false with its failure key in *key (atomicMin); *res once the entry is read. EARLY: what was read
// (Note [Paged CUDA late pages]: the entry, page id, format, offset) into *rpi, *rid, *rf, *roff.
template <bool EARLY>
__device__ __forceinline__ bool UniformPage(const PagedAttentionCudaView& a, int64_t b, int64_t pi, int64_t uf,
                                            unsigned long long* key, int64_t* rpi, int64_t* rid, int64_t* rf,
                                            int64_t* roff, int64_t* off, bool* res) {
  const int64_t id = TableAt(a.p, b, pi);
  const DirRow r = DirectoryRow(a.p, id);
  const int64_t f = r.f, o = r.off;
  *res = true;
  if constexpr (EARLY) *rpi = pi, *rid = id, *rf = f, *roff = o;
  if (PageProblemAt(a.p, id, f, o, false) != kPageOk || f != uf) {
    atomicMin(key, Key(kClassRow, (static_cast<unsigned long long>(b) << 28) | static_cast<unsigned long long>(pi + 1)));
    return false;
  }
  *off = o;
  return true;
}
// After griddepcontrol.wait: has the entry or directory row of a page seen before it changed?
__device__ __forceinline__ bool SeenPageChanged(const PagedAttentionCudaView& a, int64_t b, int64_t rpi, int64_t rid,
                                                int64_t rf, int64_t roff) {
  const int64_t id2 = TableAt(a.p, b, rpi);
  const DirRow r = DirectoryRow(a.p, rid);
  return id2 != rid || r.f != rf || r.off != roff;
}
// The block starts over after the wait (`start`, a table entry or a directory row was written by the kernel
// before): its copies landed and its early atomicMins done, s_key is cleared for the checks that rerun.
__device__ __forceinline__ void RestartKey(int tid, unsigned long long& s_key) {
  CpAsyncWait<0>();
  __syncthreads();  // every early atomicMin is done
  if (tid == 0) s_key = kNoError;
  __syncthreads();
}
// The end of a uniform block after the barrier that frees the ring and its key `key` (s_key): the last thread
// reports the block's key with the start's failure (Note [Uniform key thread]: s_rep, a slot of its own, since the
// other threads read s_key after the same barrier); `merge(mg, failed, emit)` merges the warps' states (a failed
// block's as m = -inf, l = 0, o = 0) through dsm and emits every (head, element); then the cluster (Note [Paged
// CUDA cluster merge]) or the node's report (Note [Paged CUDA one-launch report], Note [Paged CUDA last block
// reports]). FinishUniform's merge is MergeWarpTiles; the uniform INT4 / INT8 kernel's, its transposed window's own
// stores (Note [Uniform transposed finish]).
template <typename T, int D, int NW, bool CLUSTER, bool INBLOCK, typename Merge>
__device__ __forceinline__ void FinishUniformAfter(const PagedAttentionCudaView& a, const BlockUnit& bu,
                                                   unsigned char* dsm, unsigned long long& s_rep, bool bad_start,
                                                   float* fin, unsigned long long key, Merge merge) {
  const int tid = threadIdx.x;
  unsigned long long counted = 0, rep = kNoError;
  if (tid == NW * 32 - 1) {
    const unsigned long long sk = bad_start ? Key(kClassRow, static_cast<unsigned long long>(bu.b) << 28) : kNoError;
    rep = sk < key ? sk : key;
    if constexpr (!INBLOCK) {  // Note [Uniform in-block report]: nothing to store before the merge
      s_rep = rep;
      if constexpr (!CLUSTER) counted = StoreBlockKey(a, rep);
    }
  }
  // CLUSTER: a block with a bad page leaves l = NaN in `fin` for rank 0 (Note [Cluster merge flag]); the partial
  // goes to `fin` as dense v3 writes it (Note [Uniform fin stores])
  const bool failed = key != kNoError;
  merge(*reinterpret_cast<WarpMerge<NW, 8>*>(dsm), failed, [&](int gg, int d, float mb, float lb, float ab) {
    EmitBlock<T, D, CLUSTER>(a, bu, fin, failed, gg, d, mb, lb, ab);
  });
  if constexpr (CLUSTER)
    tile16::ClusterMerge<T, D>(
        fin, static_cast<int>(a.splits), bu.gn, tid, NW * 32, [&](int gg) { return OutRow<T>(a, bu, gg); },
        [&](auto& cl, bool flagged) {
          if (flagged || bad_start) ClusterReport(a, bu, &s_rep, cl);
        });
  else if (tid == NW * 32 - 1) {
    if constexpr (INBLOCK) {  // ReportBlockKey under ReportsInBlock
      if (rep != kNoError && bu.hk == 0 && bu.g0 == 0 && bu.t == a.T - 1) ReportAttention(a, rep);
    } else {
      ReportBlockKey(a, bu, rep, counted);
    }
  }
}
// The end of a uniform block, its warps' (m, l, o) of layout 0 final: a bad page empties the block's output (as Note
// [Paged CUDA v3]).
template <typename T, int D, int NW, bool CLUSTER, int ZL, bool INBLOCK = false>
__device__ __forceinline__ void FinishUniform(const PagedAttentionCudaView& a, const BlockUnit& bu, unsigned char* dsm,
                                              unsigned long long& s_key, unsigned long long& s_rep, bool bad_start,
                                              float* fin, float m, float l, float (*o)[4]) {
  __syncthreads();  // the ring becomes the merge arrays; s_key is final
  const unsigned long long key = s_key;
  if (key != kNoError) {
    m = -INFINITY;
    l = 0.0f;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
      for (int z = 0; z < ZL; ++z) o[nt][z] = 0.0f;
  }
  FinishUniformAfter<T, D, NW, CLUSTER, INBLOCK>(a, bu, dsm, s_rep, bad_start, fin, key,
                                                 [&](WarpMerge<NW, 8>& mg, bool, auto emit) {
                                                   tile16::MergeWarpTiles<NW, D>(mg, m, l, o, bu.gn, emit);
                                                 });
}
using tile16::LoadQueryPairs;
using tile16::MergeWarpTiles;
using tile16::StreamWarpTiles;
using tile16::Sw;

template <int D>
struct Cfg {
  static constexpr int kStages = D <= 64 ? 4 : 3;  // dense v3's rings
  static constexpr int kRegion = kTile * D * 2;
  static constexpr int kStageBytes = 2 * kRegion;  // K, then V
  static constexpr int kWarpBytes = kStages * kStageBytes;
  static constexpr int kRingBytes = kWarps * kWarpBytes;
  static constexpr int kCh = D / 8;
  static constexpr size_t kSmem = kRingBytes + 16;  // + the block's first failure key, then the key it reports
};
using Merge = WarpMerge<kWarps, 8>;
static_assert(sizeof(Merge) <= Cfg<64>::kRingBytes && sizeof(Merge) <= Cfg<128>::kRingBytes, "");

// INT8 / INT4 pages through this kernel's shape (their tiles copied raw and decoded in shared memory with
// pv3::IssueTile / pv3::DecodeTile, 111 / 115 registers at head size 64) were measured on the H200 and not kept:
// paged_sweep, INT8 8.9 / 17.0 / 49.3 us and INT4 9.7 / 17.7 / 54.7 us at 8K x 1 / 8K x 8 / 32K x 8 against
// Note [Paged CUDA v3]'s register decode at 8.4 / 15.2 / 34.9 and 8.5 / 13.3 / 27.6
// (benchmarks/results/paged_attention_cuda_h200.md, 2026-12-03 third session). INT4 pages with that register
// decode in this kernel's shape: Note [Paged CUDA uniform INT4].
// CLUSTER: Note [Paged CUDA cluster merge] (instantiated with EARLY only). INBLOCK: Note [Uniform in-block report]
// (EARLY only, not CLUSTER).
template <typename T, int D, bool EARLY = false, bool CLUSTER = false, bool INBLOCK = false>
__global__ void __launch_bounds__(kThreads) PagedAttentionU16(const AttnArgs args) {
  using C = Cfg<D>;
  constexpr bool BF = std::is_same<T, __nv_bfloat16>::value;
  constexpr int64_t UF = BF ? static_cast<int64_t>(PageFormat::kBF16) : static_cast<int64_t>(PageFormat::kF16);
  constexpr int NW = kWarps, ST = C::kStages;
  extern __shared__ __align__(128) unsigned char dsm[];
  unsigned long long& s_key = *reinterpret_cast<unsigned long long*>(dsm + C::kRingBytes);
  unsigned long long& s_rep = *reinterpret_cast<unsigned long long*>(dsm + C::kRingBytes + 8);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
  const PagedAttentionCudaView& a = args.v;
  const BlockUnit bu = BlockUnitOf(args);
  const int64_t S = a.splits, split = bu.split, t = bu.t, b = bu.b, G = bu.G, g0 = bu.g0;
  const int hk = bu.hk, gn = bu.gn;
  const int ps = a.p.shape.page_size;  // a multiple of kTile (the launch checks)
  const int ps_shift = (ps & (ps - 1)) == 0 ? __ffs(ps) - 1 : -1;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const uint64_t v_off = a.p.layouts[UF].v_payload;
  const uint64_t layer_off = static_cast<uint64_t>(a.p.layer) * a.p.layouts[UF].page_bytes;
  if (tid == 0) s_key = kNoError;

  uint32_t qr[D / 16][2];
  const T* qrow = static_cast<const T*>(a.q) + ((b * a.T + t) * a.Hq + hk * G + g0 + g) * a.D;
  if constexpr (!EARLY) LoadQueryPairs<T, D>(qrow, g, gn, c, qr);

  bool bad_start = false;
  int64_t st0 = ClampedStart(a, b, &bad_start), j0 = 0, j1 = 0;
  int mine = 0, next = 0, stage_in = 0;
  const auto setup = [&]() {  // this block's keys [j0, j1) of [0, st0 + t + 1) in whole tiles; this warp's tiles
    const int64_t L = st0 + t + 1;
    SplitKeys<kTile>(L, S, split, &j0, &j1);
    const int n_tiles = static_cast<int>((j1 - j0 + kTile - 1) / kTile);
    mine = n_tiles > warp ? (n_tiles - warp + NW - 1) / NW : 0;
    next = 0, stage_in = 0;
  };
  // This lane's tile of the batch (tiles 32 * batch + lane of the warp): `kp`, its first K row (nullptr: a bad
  // page, recorded in s_key), resolved when `res`; EARLY resolves the first batch before the wait, the page of row
  // st0 included, and checks that page's table entry and directory row again after it (Note [Paged CUDA late
  // pages]): what it read of them (rpi, rid, rf, roff).
  const uint8_t* kp = nullptr;
  bool res = false;
  int64_t rpi = -1, rid = -1, rf = -1, roff = 0;
  const auto resolve = [&](int batch) {
    const int idx = batch * 32 + lane;
    if (res || idx >= mine) return;
    const int64_t k0 = j0 + static_cast<int64_t>(warp + idx * NW) * kTile;
    const int64_t pi = ps_shift >= 0 ? k0 >> ps_shift : k0 / ps;
    int64_t off;
    if (!UniformPage<EARLY>(a, b, pi, UF, &s_key, &rpi, &rid, &rf, &roff, &off, &res)) {
      kp = nullptr;
      return;
    }
    kp = a.p.pool + off + layer_off + (static_cast<uint64_t>(hk) * ps + static_cast<uint64_t>(k0 - pi * ps)) * (D * 2);
  };
  uint8_t* wring = dsm + warp * C::kWarpBytes;
  const auto copy_rows = [&](uint8_t* sg, const uint8_t* p, int64_t k0, int64_t lo, int64_t hi) {  // rows [lo, hi)
    if (p == nullptr) return;
#pragma unroll
    for (int i = lane; i < kTile * C::kCh; i += 32) {
      const int r = i / C::kCh, ch = i % C::kCh;
      if (k0 + r >= lo && k0 + r < hi) {
        CpAsync<16>(sg + Sw<D>(r, ch), p + r * (D * 2) + ch * 16);
        CpAsync<16>(sg + C::kRegion + Sw<D>(r, ch), p + v_off + r * (D * 2) + ch * 16);
      }
    }
  };
  // the tile `next` into the ring (an empty group past the warp's tiles), its rows below `lim`: EARLY's prologue
  // (before the wait) stops at row st0, this step's rows (the kernel before writes them), copied after the wait
  uint32_t pending = 0;  // EARLY: prologue tiles with rows left for after the wait
  int64_t lim = j1;
  const auto issue = [&]() {
    if (next < mine) {
      if ((next & 31) == 0 && next > 0) {  // the next batch of 32 tiles (every lane's tile of the last one was issued)
        res = false;
        resolve(next >> 5);
      }
      const unsigned long long pv = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(kp), next & 31);
      const int64_t k0 = j0 + static_cast<int64_t>(warp + next * NW) * kTile;
      copy_rows(wring + stage_in * C::kStageBytes, reinterpret_cast<const uint8_t*>(pv), k0, k0, lim);
      if (k0 + kTile > lim && lim < j1) pending |= 1u << next;
    }
    CpAsyncCommit();  // one group per tile, empty ones included: the waits count groups
    ++next;
    stage_in = stage_in + 1 == ST ? 0 : stage_in + 1;
  };
  setup();
  __syncthreads();  // s_key is set before any atomicMin
  resolve(0);
  lim = EARLY && st0 < j1 ? st0 : j1;
  // block-uniform: only the block of a row's last keys has this step's rows; none with static tables (Note [Paged
  // CUDA static tables])
  const bool recheck = EARLY && j1 > st0 && !a.static_tables;
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) issue();
  if constexpr (EARLY) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the previous kernel's writes are visible from here
#endif
    LoadQueryPairs<T, D>(qrow, g, gn, c, qr);
    bool bad2 = false;
    const int64_t st2 = ClampedStart(a, b, &bad2);
    // Note [Paged CUDA late pages]: the pages that hold rows from st0 on, read again
    const bool stale = recheck && res && (rpi + 1) * ps > st0 && SeenPageChanged(a, b, rpi, rid, rf, roff);
    // meanwhile this step's rows of the prologue's tiles, from the pages resolved before the wait
    const int64_t from = lim;
    lim = j1;
    if (pending != 0) {  // warp-uniform
#pragma unroll
      for (int s = 0; s < ST - 1; ++s) {
        if ((pending >> s) & 1u) {
          const unsigned long long pv = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(kp), s);
          const int64_t k0 = j0 + static_cast<int64_t>(warp + s * NW) * kTile;
          copy_rows(wring + s * C::kStageBytes, reinterpret_cast<const uint8_t*>(pv), k0, from, j1);
        }
      }
      CpAsyncCommit();
    }
    bool again = st2 != st0 || bad2 != bad_start;  // block-uniform
    if (recheck) again = __syncthreads_or(again || stale) != 0;
    if (again) {  // `start`, a table entry or a directory row was written by the previous kernel: start over
      RestartKey(tid, s_key);
      st0 = st2, bad_start = bad2, res = false, kp = nullptr, pending = 0;
      setup();
      lim = j1;
      resolve(0);
#pragma unroll
      for (int s = 0; s < ST - 1; ++s) issue();
    } else if (pending != 0) {
      CpAsyncWait<0>();  // the extra group: the ring's waits count ST - 1 groups ahead
    }
  }

  float m, l, o[D / 8][4];
  const auto stream = [&](const auto& step_issue) {
    StreamWarpTiles<BF, D, NW, ST, C::kStageBytes>(wring, qr, a.scale * 1.4426950408889634f, j0, j1, mine, warp,
                                                   lane, step_issue, m, l, o);  // base-2 scores
  };
  const auto commit = []() { CpAsyncCommit(); };
  if (mine <= ST - 1)  // every tile of this warp is in the ring already: Note [Uniform short loop]
    stream(commit);
  else
    stream(issue);
  FinishUniform<T, D, NW, CLUSTER, 4, INBLOCK>(a, bu, dsm, s_key, s_rep, bad_start,
                                   CLUSTER ? reinterpret_cast<float*>(dsm + C::kSmem) : nullptr, m, l, o);
}

template <typename T, int D>
cudaError_t LaunchD(const AttnArgs& a, cudaStream_t stream) {
  static const AttnKernels k =
      MakeKernels(PagedAttentionU16<T, D>, PagedAttentionU16<T, D, true>, PagedAttentionU16<T, D, true, true>,
                  Cfg<D>::kSmem, Cfg<D>::kSmem + kFinBytes<D>,
                  tile16::kMaxClusterRanks,                     // Note [Paged CUDA cluster merge]
                  PagedAttentionU16<T, D, true, false, true>);  // Note [Uniform in-block report]
  return LaunchOneWave<T>(k, a, stream);
}

template <typename T>
cudaError_t Launch(const AttnArgs& a, cudaStream_t stream) {
  return a.v.D == 64 ? LaunchD<T, 64>(a, stream) : LaunchD<T, 128>(a, stream);
}

}  // namespace pu

// ---- PagedCacheAttention over INT4 pages alone: Note [Paged CUDA uniform INT4] --------------------------------
// Note [Paged CUDA uniform INT4]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A node whose `page_format` attribute is INT4, under float16 queries at head size 64, promises INT4 pages alone
// (the single-format policy kv_format = INT4). It runs the uniform 16-bit kernel's shape (Note [Paged CUDA uniform
// 16-bit]: no page window in shared memory, no format mask, each lane resolving one tile's page of its warp's next
// 32 tiles, the ring's prologue issued before griddepcontrol.wait, the same failure keys and reports) around the
// every-format kernel's INT4 step (Note [Paged CUDA v3 transposed INT4]: ORTKV_PAGED_V3_INT4T_NT tiles of raw
// codes and scales a step, decoded in the mma operand registers, the window's transposed state merged once at the
// end). Before the wait only whole tiles below `start` are copied; a tile that holds this step's rows (written by
// the kernel before) is copied after it, whole (its scales are per 16-row tile). A page of another format is
// refused as in the uniform 16-bit kernel (problem kPageFormatHint). 127 registers at head size 64, no spills.
// Its shape, timed on the H200 (benchmarks/results/paged_attention_cuda_h200.md, sixteenth session; harness
// `paged_sweep 20 0,1,2,3 4`, two alternated rounds, us at 8K x 1 / 8K x 8 / 32K x 1 / 32K x 8 keys x rows; the
// every-format kernel's INT4 8.52-8.59 / 13.32-13.44 / 13.71-13.79 / 27.8-28.1, uniform F16 6.4-6.6 / 16.7-16.8 /
// 13.4-13.5 / 50.6-50.8):
//   ring of 3 steps, 4 blocks per SM       6.52-6.56 / 16.4-16.8 / 11.32-11.36 / 32.1-32.5
//   3 steps, splits for 3 blocks per SM    6.50-6.53 / 11.67-11.70 / 11.30-11.31 / 29.24-29.26   (kept)
//   the same, splits >= 512 keys           7.25 / 11.80-11.89 / 11.41-11.42 / 29.52
//   the same, splits >= 1024 keys          8.69-8.71 / 14.08-14.14 / 10.41-10.43 / 29.33-29.35
//   ring of 4 steps (3 blocks per SM)      7.03-7.05 / 12.06-12.19 / 11.03-11.12 / 26.6-26.7
//   4 steps, splits >= 512 keys            6.94 / 12.06-12.08 / 10.41-10.50 / 26.65-26.70
//   4 steps, splits >= 1024 keys           8.21-8.24 / 12.47-12.49 / 11.38-11.41 / 26.57-26.67
// (splits >= N keys: where the combine merges them, fewer and longer splits than the plan's 256-key ones.) Four
// blocks per SM split the 8-row nodes into more, uneven chunks (22 splits of 384 keys at 8K x 8: 6 steps over 4
// warps); 4 steps in flight per warp pay at 32K x 8 (~2 TB/s: 26.7 against 29.3 us) and cost 0.15-0.5 us in every
// short node (16 / 128 / 1K keys x 1 row 3.64 / 3.54 / 5.06 against 3.40 / 3.31 / 4.91; 8K x 1 above). Hence two
// instantiations, the splits of 3 blocks per SM for both: a ring of 4 steps where the page table spans >= 32K keys
// a row (ORTKV_PAGED_U4_LONG_KEYS; 32K x 1 and 32K x 8 above, the better ring there), else 3 steps (every cell of
// <= 8K keys). The rule's cells between (16K keys a row: paged_sweep case 14 is 16K x 8) are not measured yet. Each
// instantiation's sm_90 SASS is the same as that of the single-ring build that was timed and passed `pytest -m
// cuda` (cuobjdump; the rule itself has not run on a GPU: no device time was left). Longer splits were dropped.
// Through ORT (bench_paged_attention_cuda.py, 3 rounds), INT4 promised with static tables against F16 promised
// with static tables at 16 / 128 / 1K / 8K keys x 1 row, 8K x 8, 32K x 1, 32K x 8: this kernel 1.46 / 1.22 / 1.09 /
// 1.08, 0.71, 0.86, 0.58 (3.5 / 3.4 / 5.0 / 6.6, 12.5, 12.2, 30.3 us); a ring of 3 steps and splits >= 512 keys
// 1.45 / 1.22 / 1.09 / 1.21, 0.72, 0.85, 0.59; a ring of 4 steps 1.56 / 1.29 / 1.14 / 1.18, 0.73, 0.84, 0.53 (the
// every-format kernel's INT4: 1.86 / 1.64 / 1.36 / 1.40, 0.81, 1.03, 0.56). The single-row nodes stay
// latency-bound: at 8K x 1 a block streams 256 keys either way (one step, or 4 F16 tiles, a warp), so 4x fewer
// bytes do not shorten it.
//
// Note [Uniform INT4 group copies]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A step's NT tiles are copied into the ring by groups of 32 / NT lanes, one group a tile (8 lanes at NT = 4: 4 + 4
// cp.async of 16 bytes of its K and V codes, 1 of its scales), where every tile used to be copied by the whole warp
// (IssueNarrow: its page pointer shuffled to all lanes, its row and addresses in 64 bits, the prologue's pending
// test, all once per tile: ~60 instructions a tile, ~250 of a 64-key step's ~1,000). Now a lane reads its group's
// page pointer and row (kr, worked out by the lane that resolved the tile) in three shuffles a step, and its copies
// take immediate offsets from two addresses: the loop's code 1,251 -> 981 instructions (sm_90, the early ring of 4
// steps; the kernel 7,616 -> 4,632; 987 and 4,704 now that it copies through IssueNarrow<F, D, LPT>, shared with the
// every-format kernel below: the scales' source is no longer hoisted out of the loop, and the harness times the two
// alike, e.g. 32K x 8 25.11-25.35 / 25.19-25.44 us, 8K x 1 6.24-6.29 / 6.23-6.29), the same stage layout and
// bytes, every L2 line still whole (8 lanes x 16 bytes). The prologue's tiles that hold the step's rows
// (`pending`) are deferred per tile as before. H100 harness
// (`paged_sweep 20 3,14,1,0,2 4`, three alternated rounds; us, INT4 v3us of the last round, before / after): 8K x 1
// 6.55 / 6.35, 8K x 8 12.52 / 11.96, 16K x 8 17.68 / 15.74, 32K x 1 11.31 / 10.85, 32K x 8 28.32 / 24.57 (24.57 in
// the second round too); `paged_sweep 20 4,9,5 4`, two rounds: 16 / 128 / 1K keys x 1 row 3.43-3.46 /
// 3.32-3.34 / 5.40-5.41 -> 3.16-3.17 / 3.06 / 5.15-5.16; outputs against v2 unchanged (max |diff| 0.001-0.008).
// ncu at 32K x 8 (its locked clocks): 42.5 -> 34.6 us, 0.42 -> 0.46 instructions issued per scheduler-cycle; the
// top stall is now the wait for the ring's copies (long scoreboard 1.48 cycles an instruction), then issue (1.00)
// and fixed latency (0.98). The every-format kernel's register windows (WindowTilesReg: INT8, INT4) copy by groups
// too, through the same IssueNarrow<F, D, LPT> (its page pointers come from the block's page window): its
// transposed INT4 loop 931 -> 746 instructions; on another H100, three alternated rounds, us, before / after: INT4
// (every format) 8K x 1 8.65-8.70 / 8.46-8.56, 8K x 8 13.98-14.04 / 13.40-13.47, 32K x 1 13.93-13.95 / 13.61-13.68,
// 32K x 8 31.18-31.60 / 30.29-30.40; INT8 (NT = 2, 16 lanes a tile; its loop 327 -> 317) within -2 / +1 %: 8.76-8.81
// / 8.76-8.82, 16.98-17.10 / 17.20-17.28, 15.32-15.41 / 15.04-15.13, 45.18-45.40 / 45.37-45.80; F16 unchanged.
// Note [Uniform INT4 single-row warps]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On the H200 (2026-12-06, benchmarks/results/paged_attention_cuda_h200.md) the INT4 node of one row over 8K keys
// took 6.3 us against F16 pages' 6.1: not faster, as issue 11 asks. There the grid is 3 KV heads x 32 splits of 256
// keys, one block an SM, and each of a block's 4 warps runs exactly ONE 64-key step (~980 instructions, its warp
// alone on its scheduler: a dependent chain), where an F16 warp runs four 16-key tiles. The INT4 node's per-key part
// is the smaller one (8K x 1 minus 16 x 1: 3.2 against F16's 3.8 us); its fixed part is 0.8 us larger (16 x 1: 3.1
// against 2.3 us, also on the H100), about one such step. So a node of one row (B x T = 1) may run this kernel with
// 8 warps a block in 2-tile (32-key) steps: the same blocks, splits, pages and combine, each warp half the chain and
// two warps a scheduler. Its ring of 3 (4 from ORTKV_PAGED_U4_LONG_KEYS) 32-key steps a warp holds the same bytes a
// block as the 4-warp form's; the block's merge arrays (WarpMerge<8, 8>, 66 KB) outgrow that ring (55 KB at 3
// steps), so the failure keys sit past both (Ring::kKeyOff; the 4-warp layout is unchanged). 98-100 registers, no
// spills (sm_90, ptxas -v; the 4-warp INT4 kernel 127-128): 2 blocks an SM (one wave holds 88 splits of 3 KV
// heads, more than the 32 of 8K keys). Opt-in, ORTKV_PAGED_U4_ROW_WARPS=8 (PagedU4RowWarps8). The uniform INT8
// kernel's single rows (1.00x F16 at 8K x 1 on the H200, in 64-key steps) take the same form under
// ORTKV_PAGED_U8_ROW_WARPS=8 (PagedAttentionU4<kInt8F, ST, 2, ..., 8>, 96-102 registers, no spills, a 104 KB ring
// a block at 3 steps). Written without a GPU (thirty-second / thirty-third sessions); first run on an H100 in the
// thirty-fourth (benchmarks/results/paged_attention_cuda_h200.md): the CUDA tests pass with both knobs, but at 8K x 1,
// the cell they were for, both forms are slower (INT4 6.2-6.4 -> 6.5-6.6 us, INT8 6.2-6.3 -> 6.6-6.7; F16 6.9-7.0);
// they win INT4 at 16K x 1 (9.2-9.4 -> 8.6-8.7) and INT8 at 16 / 1K keys (3.2 -> 2.9, 5.0 -> 4.8), lose INT8 at 16K
// x 1 (7.9-8.0 -> 8.7-8.8). ncu at 8K x 1: the 8-warp INT4 grid takes the same cycles as the 4-warp one (15,736)
// with 62 % more instructions, so a warp's one step is not what bounds the node. Kept opt-in, for the A/B on an
// H200 (not run there yet). Where the single-row INT4 node's extra ~0.8 us over F16 goes (ncu's per-instruction
// counts, 16 keys x 1 row): after griddepcontrol.wait, RegQuery's 147 instructions a warp against F16's 45 and the
// transposed window's end (MergeWindowT, ~190 against ~50), both on the chain that follows the query's load.
// Note [Uniform transposed finish]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A warp of the uniform INT4 / INT8 kernel runs one window, transposed (keys in the mma's M dimension, query heads
// its columns: Note [Paged CUDA v3 transposed INT4]). It used to end it as the every-format kernel ends each of its
// windows, through MergeWindowT: the window's O^T, m and l stored to the warp's ring, __syncwarp, read back in
// layout 0 and merged into an empty (m, l, o) (two exp2, an FMA a value), the quad's l summed; then FinishUniform
// stored that (m, l, o) into the block's merge arrays for the cross-warp merge. ncu's per-instruction counts put
// ~190 instructions a warp there against F16's ~50, on the chain that follows the query's load, in every
// single-row node (16 keys x 1 row on an H100: INT4 3.1 us against F16's 2.3). Now, after the column sums, each
// lane stores its O^T values (+ sum p m_v of their column), and the g == 0 lanes the columns' m and l, straight
// into WarpMerge at MergeWindowT's map (head 2c + (e & 1), dim 8g + mt + 4 (e >> 1)); a column without keys or a
// failed block stores m = -inf, l = 0, o = 0, as the old path left them (FinishUniformAfter's merge functor; the
// cross-warp merge, emits and reports are FinishUniform's). The values are the same floats: the old merge
// multiplied them by exp2(0) = 1 and added 0. sm_90 SASS (cuobjdump): 144-184 instructions fewer in each INT4 /
// INT8 uniform kernel (e.g. <4, 3, 4, EARLY> 4,400 -> 4,224), the same registers (96-128), no spills. Written in
// the thirty-fourth session behind a compile-time switch; run in the thirty-fifth on an H100 (CUDA tests: 1245
// passed, the 20 failures the model's download, no network there) and measured against the MergeWindowT build,
// alternated twice (bench_paged_attention_cuda.py, us, MergeWindowT -> direct): INT4 8K x 1 6.2-6.3 -> 5.8,
// 16 x 1 3.1 -> 2.9-3.0, 4K x 1 7.1 -> 6.4-6.5, 16K x 1 9.1-9.2 -> 8.4, 32K x 1 11.1 -> 10.4-10.5, 2K x 8 7.3-7.4
// -> 6.7, 8K x 8 11.4 -> 10.8-11.1; INT8 8K x 1 6.2 -> 5.8-5.9, 16K x 1 8.1-8.2 -> 7.7, 2K x 8 8.8 -> 7.6; no cell
// slower (F16 7.0 at 8K x 1). The switch is gone: this is the only path.
// Note [Paged CUDA uniform INT8]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A node whose `page_format` attribute is INT8, under float16 queries at head size 64, may run the uniform INT4
// kernel's INT8 twin: PagedAttentionU4<kInt8F, ST> (the same resolution of a tile's page by one lane, the same
// prologue before griddepcontrol.wait, late-page checks, reports and merges) around the transposed INT8 step (Note
// [Paged CUDA v3 transposed INT8]). An INT8 tile is twice an INT4 tile's bytes (2,176-byte stages), so a step is
// ORTKV_PAGED_U8_NT = 2 tiles (32 keys, copied by groups of 16 lanes: Note [Uniform INT4 group copies]) and a
// batch of page resolutions covers 16 steps; the rings are INT4's rule (3 steps, 4 from 32K keys a row: 13 / 17
// KB a warp, about INT4's bytes in flight). 100-102 registers at sm_90, no spills. Its loop is 680 instructions
// a 32-key step as laid out (sass_loops.py), ~200 of them the page resolution that runs once every 16 steps; the
// every-format kernel's INT8 loop is 317 a 16-key step.
// A node of one row (B x T = 1) runs it in steps of ORTKV_PAGED_U8_ROW_NT = 4
// tiles (64 keys, groups of 8 lanes as INT4's; 1,005 instructions a step, 120-124 registers, a 104 / 139 KB ring a
// block at 3 / 4 steps: pu4::LaunchInt8). Measured on an H100 (harness, five alternated rounds, benchmarks/results/
// paged_attention_cuda_h200.md, twenty-third session), us, 32-key / 64-key steps: 8K keys x 1 row 7.45 / 6.43 (the
// uniform F16 kernel 7.01), 32K x 1 13.15 / 12.59; 8K x 8 rows 14.23 / 14.81, 32K x 8 40.63 / 44.73 (fewer
// blocks an SM for the larger ring), 16K x 8 24.82 / 23.98 (not taken: one rule, rows, measured at 1 and 8). The
// 64-key instances are the harness's, instruction for instruction (cuobjdump). They were opt-in until the CUDA tests
// ran them through ORT (twenty-fourth session, H100: tests/test_cuda_paged.py 610 passed with them on for every
// single row, test_paged_generate.py's CUDA cases 13 passed); through ORT (bench_paged_attention_cuda.py, 15
// rounds) 8K x 1 6.6 us against F16's 7.1 (0.93x; 32-key steps 1.07x), 16K x 1 0.84x, 32K x 1 0.84x. Now single
// rows' default; ORTKV_PAGED_INT8_ROW_STEP=32 keeps every node in 32-key steps (PagedInt8RowSteps64; the A/B).
// Why: INT8 pages promised ran the every-format kernel, 1.25x the uniform F16 kernel's time at 8K keys x 1 row on
// an H100 (a single-row node is latency: its page window, format switch and 16-key register-decode steps are what
// INT4's uniform kernel dropped to reach 0.89x there); this kernel takes 0.83-0.92x the every-format kernel's time
// in every cell measured, and with 64-key steps 0.92x F16's at 8K x 1 (32-key steps: 1.06x). It is the default
// for INT8 promises; ORTKV_PAGED_UNIFORM_INT8=0 keeps them on the every-format kernel (PagedUniformInt8; the
// benchmarks' A/B). Written in the twenty-second session without a GPU; first run in the twenty-third
// (tests/test_cuda_paged.py with 32-key steps: 482 passed on an H100).
namespace pu4 {

using pv3::FormatInfo;
using pv3::kInt4F;
using pv3::kInt8F;
using pv3::KeysInWindow;
using tile16::kTile;

#ifndef ORTKV_PAGED_U8_NT  // tiles per step of the uniform INT8 kernel (an A/B knob for paged_sweep.cu)
#define ORTKV_PAGED_U8_NT 2
#endif
#ifndef ORTKV_PAGED_U8_ROW_NT  // ... and of its single-row nodes (Note [Paged CUDA uniform INT8])
#define ORTKV_PAGED_U8_ROW_NT 4
#endif
constexpr int kD = 64;
// Format F's tiles per step (Note [Paged CUDA uniform INT8]: INT8's tiles are twice INT4's bytes).
template <int F>
__host__ __device__ constexpr int StepTiles() { return F == kInt4F ? ORTKV_PAGED_V3_INT4T_NT : ORTKV_PAGED_U8_NT; }
template <int F, int NT>  // one step's codes and scales
__host__ __device__ constexpr int StepBytes() { return NT * pv3::RegCfg<F, kD>::kStageBytes; }
#ifndef ORTKV_PAGED_U4_STAGES  // ring depth (an A/B knob for benchmarks/cuda/paged_sweep.cu)
#define ORTKV_PAGED_U4_STAGES 3
#endif
#ifndef ORTKV_PAGED_U4_LONG_STAGES  // the ring of long nodes (ORTKV_PAGED_U4_LONG_KEYS)
#define ORTKV_PAGED_U4_LONG_STAGES 4
#endif
// A ring of ST steps of NT tiles of format F per warp, NW warps; the block's merge arrays (FinishUniform) reuse it,
// and the block's first failure key, then the key it reports, follow both (kKeyOff).
template <int F, int ST, int NT, int NW = kWarps>
struct Ring {
  static constexpr int kWarpBytes = ST * StepBytes<F, NT>();
  static constexpr int kRingBytes = NW * kWarpBytes;
  static constexpr int kMergeBytes = static_cast<int>(sizeof(WarpMerge<NW, 8>));
  static constexpr int kKeyOff = ((kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes) + 15) / 16 * 16;
  static constexpr size_t kSmem = kKeyOff + 16;
  static_assert(ST >= 2 && 32 % NT == 0 && (ST - 1) * NT <= 32, "");
  static_assert(NW != kWarps || kKeyOff == kRingBytes, "the 4-warp blocks' layout is the one measured");
};

// F: kInt4F, or kInt8F (Note [Paged CUDA uniform INT8]); NT tiles a step. CLUSTER: Note [Paged CUDA cluster merge]
// (instantiated with EARLY only). NW_ warps a block (Note [Uniform INT4 single-row warps]: 8).
template <int F, int ST, int NT, bool EARLY = false, bool CLUSTER = false, int NW_ = kWarps>
__global__ void __launch_bounds__(NW_ * 32) PagedAttentionU4(const AttnArgs args) {
  using RG = Ring<F, ST, NT, NW_>;
  using R = pv3::RegCfg<F, kD>;
  constexpr int NW = NW_, kStep = StepBytes<F, NT>();
  constexpr int kBatchSteps = 32 / NT;  // a lane resolves one tile: 32 tiles per batch
  extern __shared__ __align__(128) unsigned char dsm[];
  unsigned long long& s_key = *reinterpret_cast<unsigned long long*>(dsm + RG::kKeyOff);
  unsigned long long& s_rep = *reinterpret_cast<unsigned long long*>(dsm + RG::kKeyOff + 8);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
  const PagedAttentionCudaView& a = args.v;
  const BlockUnit bu = BlockUnitOf(args);
  const int64_t S = a.splits, split = bu.split, t = bu.t, b = bu.b, G = bu.G, g0 = bu.g0;
  const int hk = bu.hk, gn = bu.gn;
  const int ps = a.p.shape.page_size;  // a multiple of kTile (the launch checks)
  const int ps_shift = (ps & (ps - 1)) == 0 ? __ffs(ps) - 1 : -1;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, c = lane & 3;
  const codecs::PageLayout& lay = a.p.layouts[F];
  FormatInfo fi;
  fi.v_payload = static_cast<uint32_t>(lay.v_payload);
  fi.k_scales = static_cast<uint32_t>(lay.k_scales);
  fi.v_scales = static_cast<uint32_t>(lay.v_scales);
  const uint64_t layer_off = static_cast<uint64_t>(a.p.layer) * lay.page_bytes;
  const uint32_t hrow = static_cast<uint32_t>(hk) * ps;
  if (tid == 0) s_key = kNoError;

  const __half* qrow = static_cast<const __half*>(a.q) + ((b * a.T + t) * a.Hq + hk * G + g0 + g) * a.D;
  uint32_t qc[kD / 8];  // this lane's quarter of its query row
  if constexpr (!EARLY) pv3::LoadQueryChunk<kD>(qrow, g, gn, c, qc);

  bool bad_start = false;
  int64_t st0 = ClampedStart(a, b, &bad_start), j0 = 0, j1 = 0;
  int mine = 0, n_tiles = 0, win = 0, next = 0, stage_in = 0;
  const auto setup = [&]() {  // this block's keys [j0, j1) of [0, st0 + t + 1) in whole tiles; this warp's steps
    const int64_t L = st0 + t + 1;
    SplitKeys<kTile>(L, S, split, &j0, &j1);
    win = static_cast<int>(j1 - j0);
    n_tiles = (win + kTile - 1) / kTile;
    const int n_steps = (n_tiles + NT - 1) / NT;
    mine = n_steps > warp ? (n_steps - warp + NW - 1) / NW : 0;
    next = 0, stage_in = 0;
  };
  // Step s of this warp holds its tiles (warp + s * NW) * NT + h, h < NT; lane i of batch k resolves tile h = i % NT
  // of step k * kBatchSteps + i / NT: `kp`, its page's layer bytes (nullptr: a bad page, recorded in s_key). EARLY:
  // what it read of its page (rpi, rid, rf, roff) for Note [Paged CUDA late pages].
  const uint8_t* kp = nullptr;
  uint32_t kr = 0;  // the tile's first row in its page's layer (hrow + the row of its first key in the page)
  bool res = false;
  int64_t rpi = -1, rid = -1, rf = -1, roff = 0;
  const auto resolve = [&](int batch) {
    const int step = batch * kBatchSteps + lane / NT;
    const int tile = (warp + step * NW) * NT + lane % NT;
    if (res || step >= mine || tile >= n_tiles) return;
    const int64_t k0 = j0 + static_cast<int64_t>(tile) * kTile;
    const int64_t pi = ps_shift >= 0 ? k0 >> ps_shift : k0 / ps;
    int64_t off;
    if (!pu::UniformPage<EARLY>(a, b, pi, F, &s_key, &rpi, &rid, &rf, &roff, &off, &res)) {
      kp = nullptr;
      return;
    }
    kp = a.p.pool + off + layer_off;
    kr = hrow + static_cast<uint32_t>(k0 - pi * ps);
  };
  uint8_t* wring = dsm + warp * RG::kWarpBytes;
  // Tile gt of a step is copied by lanes [gt * kLpt, (gt + 1) * kLpt) (Note [Uniform INT4 group copies]).
  constexpr int kLpt = 32 / NT;                  // lanes a tile
  const int gt = lane / kLpt, gj = lane % kLpt;  // this lane's tile of a step, its place in the tile's group
  // this group's tile of step s into stage `stage` (if `want`), from the page its lane resolved; every lane calls it
  const auto group_copy = [&](int stage, int s, bool want) {
    const int src = (s % kBatchSteps) * NT + gt;  // the lane that resolved this group's tile (resolve)
    const unsigned long long pv = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(kp), src & 31);
    const uint32_t r = __shfl_sync(0xffffffffu, kr, src & 31);
    const int tile = (warp + s * NW) * NT + gt;
    if (want && gt < NT && tile < n_tiles && pv != 0)
      pv3::IssueNarrow<F, kD, kLpt>(wring + stage * kStep + gt * R::kStageBytes,
                                    reinterpret_cast<const uint8_t*>(pv), fi, r, gj);
  };
  // step `next` into the ring (an empty group past the warp's steps), its tiles that end at or below `lim`: EARLY's
  // prologue (before the wait) stops at row st0, a tile with this step's rows is copied after the wait (`pending`)
  uint32_t pending = 0;
  int64_t lim = j1;
  const auto issue = [&]() {
    if (next < mine) {
      if (next % kBatchSteps == 0 && next > 0) {  // the next batch (every lane's tile of the last one was issued)
        res = false;
        resolve(next / kBatchSteps);
      }
      uint32_t defer = 0;  // warp-uniform: the step's tiles that end above lim
      if (lim < j1) {
#pragma unroll
        for (int h = 0; h < NT; ++h) {
          const int tile = (warp + next * NW) * NT + h;
          if (tile < n_tiles && j0 + static_cast<int64_t>(tile + 1) * kTile > lim) defer |= 1u << h;
        }
        pending |= defer << (next * NT);
      }
      group_copy(stage_in, next, ((defer >> gt) & 1u) == 0);
    }
    CpAsyncCommit();  // one group per step, empty ones included: the waits count groups
    ++next;
    stage_in = stage_in + 1 == ST ? 0 : stage_in + 1;
  };
  setup();
  __syncthreads();  // s_key is set before any atomicMin
  resolve(0);
  lim = EARLY && st0 < j1 ? st0 : j1;
  const bool recheck = EARLY && j1 > st0 && !a.static_tables;  // block-uniform (Note [Paged CUDA static tables])
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) issue();
  if constexpr (EARLY) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the previous kernel's writes are visible from here
#endif
    pv3::LoadQueryChunk<kD>(qrow, g, gn, c, qc);
    bool bad2 = false;
    const int64_t st2 = ClampedStart(a, b, &bad2);
    // Note [Paged CUDA late pages]: the pages that hold rows from st0 on, read again
    const bool stale = recheck && res && (rpi + 1) * ps > st0 && pu::SeenPageChanged(a, b, rpi, rid, rf, roff);
    lim = j1;
    if (pending != 0) {  // warp-uniform: the prologue's tiles with this step's rows, whole
#pragma unroll
      for (int s = 0; s < ST - 1; ++s)
        if ((pending >> (s * NT)) & ((1u << NT) - 1u)) group_copy(s, s, ((pending >> (s * NT + gt)) & 1u) != 0);
      CpAsyncCommit();
    }
    bool again = st2 != st0 || bad2 != bad_start;  // block-uniform
    if (recheck) again = __syncthreads_or(again || stale) != 0;
    if (again) {  // `start`, a table entry or a directory row was written by the previous kernel: start over
      pu::RestartKey(tid, s_key);
      st0 = st2, bad_start = bad2, res = false, kp = nullptr, pending = 0;
      setup();
      resolve(0);
#pragma unroll
      for (int s = 0; s < ST - 1; ++s) issue();
    } else if (pending != 0) {
      CpAsyncWait<0>();  // the extra group: the ring's waits count ST - 1 groups ahead
    }
  }

  // the query's fragments (Note [Paged CUDA v3 register decode]) and the transposed form's per-column sums
  uint32_t qa[kD / 16][2];
  float qs[2], kc[2];
  {
    float qsum, k0;
    pv3::RegQuery<F, kD>(qc, a.scale * 1.4426950408889634f, qa, &qsum, &k0);  // base-2 scores
    qs[0] = __shfl_sync(0xffffffffu, qsum, 8 * c), qs[1] = __shfl_sync(0xffffffffu, qsum, 8 * c + 4);
    kc[0] = __shfl_sync(0xffffffffu, k0, 8 * c), kc[1] = __shfl_sync(0xffffffffu, k0, 8 * c + 4);
  }
  float mw[2] = {-INFINITY, -INFINITY}, lw[2] = {0.0f, 0.0f}, mvw[2] = {0.0f, 0.0f};
  float ow[4][4] = {};
  int stage = 0;
  for (int it = 0; it < mine; ++it, stage = stage + 1 == ST ? 0 : stage + 1) {
    CpAsyncWait<ST - 2>();
    __syncwarp();  // this step's copies landed for the whole warp; the slot refilled next was read
    issue();
    const auto valid = KeysInWindow<NT * kTile>((warp + it * NW) * NT * kTile, 0, win);
    pv3::NarrowTilesT<F, NT>(wring + stage * kStep, qa, qs, kc, lane, valid, mw, lw, mvw, ow);
  }
  // Note [Uniform transposed finish]: the window's state goes straight into the block's merge arrays
  pv3::ColumnSumsT(lw, mvw);
  CpAsyncWait<0>();  // every copy landed before the ring becomes the merge arrays (the barrier below)
  __syncthreads();  // the ring becomes the merge arrays; s_key is final
  pu::FinishUniformAfter<__half, kD, NW, CLUSTER, false>(
      a, bu, dsm, s_rep, bad_start, CLUSTER ? reinterpret_cast<float*>(dsm + RG::kSmem) : nullptr, s_key,
      [&](WarpMerge<NW, 8>& mg, bool failed, auto emit) {
        // head column 2c + (e & 1), dim 8g + mt + 4 (e >> 1): MergeWindowT's map; a column without keys (m = -inf)
        // or a failed block stores nothing but m = -inf, l = 0, o = 0, as MergeWindowT leaves it
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool none = failed || mw[e] == -INFINITY;
          if (g == 0) {
            mg.m[warp][2 * c + e] = none ? -INFINITY : mw[e];
            mg.l[warp][2 * c + e] = none ? 0.0f : lw[e];
          }
#pragma unroll
          for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int hi = 0; hi < 2; ++hi)
              mg.acc[warp][2 * c + e][8 * g + mt + 4 * hi] = none ? 0.0f : ow[mt][e + 2 * hi] + mvw[e];
        }
        __syncthreads();
        tile16::MergeWarpStates<NW, kD>(mg, bu.gn, emit);
      });
}

#ifndef ORTKV_PAGED_U4_MAX_PER_SM  // the blocks per SM the splits assume (an A/B knob for paged_sweep.cu)
#define ORTKV_PAGED_U4_MAX_PER_SM 3
#endif
#ifndef ORTKV_PAGED_U4_LONG_KEYS  // the page table's keys (per row) from which a node takes the long ring
#define ORTKV_PAGED_U4_LONG_KEYS 32768
#endif
template <int F, int ST, int NT = StepTiles<F>(), int NW = kWarps>
const AttnKernels& KernelsOf() {
  static const AttnKernels k = [] {
    AttnKernels x = MakeKernels(PagedAttentionU4<F, ST, NT, false, false, NW>,
                                PagedAttentionU4<F, ST, NT, true, false, NW>,
                                PagedAttentionU4<F, ST, NT, true, true, NW>, Ring<F, ST, NT, NW>::kSmem,
                                Ring<F, ST, NT, NW>::kSmem + kFinBytes<kD>,
                                tile16::kMaxClusterRanks,  // Note [Paged CUDA cluster merge]
                                nullptr, NW * 32);
    x.per_sm = std::min(x.per_sm, ORTKV_PAGED_U4_MAX_PER_SM);
    return x;
  }();
  return k;
}
// F: kInt4F or kInt8F (the same ring rule: Note [Paged CUDA uniform INT8]), in NT-tile steps, NW warps a block.
template <int F, int NT = StepTiles<F>(), int NW = kWarps>
cudaError_t Launch(const AttnArgs& a, cudaStream_t stream) {
  const int64_t keys = a.v.p.max_pages * a.v.p.shape.page_size;  // Note [Paged CUDA uniform INT4]
  return keys >= ORTKV_PAGED_U4_LONG_KEYS
             ? LaunchOneWave<__half>(KernelsOf<F, ORTKV_PAGED_U4_LONG_STAGES, NT, NW>(), a, stream)
             : LaunchOneWave<__half>(KernelsOf<F, ORTKV_PAGED_U4_STAGES, NT, NW>(), a, stream);
}
// INT4; with `row_warps`, a node of one row (one sequence, one query) in 8 warps a block and 2-tile (32-key) steps
// (Note [Uniform INT4 single-row warps]).
cudaError_t LaunchInt4(const AttnArgs& a, bool row_warps, cudaStream_t stream) {
  return row_warps && a.v.B * a.v.T == 1 ? Launch<kInt4F, 2, 8>(a, stream) : Launch<kInt4F>(a, stream);
}
// INT8 in steps of ORTKV_PAGED_U8_NT tiles; with `row_steps`, a node of one row (one sequence, one query) in steps
// of ORTKV_PAGED_U8_ROW_NT (Note [Paged CUDA uniform INT8]); with `row_warps` (before `row_steps`), such a node in
// 8 warps a block and 2-tile (32-key) steps (Note [Uniform INT4 single-row warps]).
cudaError_t LaunchInt8(const AttnArgs& a, bool row_steps, bool row_warps, cudaStream_t stream) {
  if (a.v.B * a.v.T == 1 && row_warps) return Launch<kInt8F, 2, 8>(a, stream);
  return row_steps && a.v.B * a.v.T == 1 ? Launch<kInt8F, ORTKV_PAGED_U8_ROW_NT>(a, stream)
                                         : Launch<kInt8F>(a, stream);
}

}  // namespace pu4

Status LaunchError(const char* op, cudaError_t e) {
  return Status(Code::kRuntime, std::string(op) + " CUDA launch failed: " + cudaGetErrorName(e) + ": " +
                                    cudaGetErrorString(e));
}

// The A/B switches below are environment variables read at every launch (a captured CUDA graph keeps the kernel of
// its capture). EnvIs: the variable `name` is set and equals `value`.
bool EnvIs(const char* name, const char* value) {
  const char* e = std::getenv(name);
  return e != nullptr && std::strcmp(e, value) == 0;
}
// ORTKV_PAGED_UNIFORM_INT8: nodes that promise INT8 pages run the uniform INT8 kernel (Note [Paged CUDA uniform
// INT8]) unless it is "0", which keeps them on the every-format kernel (an A/B switch for the benchmarks and the
// tests).
bool PagedUniformInt8() { return !EnvIs("ORTKV_PAGED_UNIFORM_INT8", "0"); }
// ORTKV_PAGED_INT8_ROW_STEP: that kernel runs a node of one row in 64-key steps (Note [Paged CUDA uniform INT8])
// unless it is "32", which keeps every node in 32-key steps (the A/B).
bool PagedInt8RowSteps64() { return !EnvIs("ORTKV_PAGED_INT8_ROW_STEP", "32"); }
// ORTKV_PAGED_U4_ROW_WARPS=8: a node of one row that promises INT4 pages runs the uniform INT4 kernel with 8 warps a
// block in 32-key steps (Note [Uniform INT4 single-row warps]); unset or anything else keeps 4 warps in 64-key steps
// (the default: on an H100 the 8-warp form is slower at 8K keys x 1 row).
bool PagedU4RowWarps8() { return EnvIs("ORTKV_PAGED_U4_ROW_WARPS", "8"); }
// ORTKV_PAGED_U8_ROW_WARPS=8: the same for a node of one row that promises INT8 pages (the uniform INT8 kernel, 8
// warps, 32-key steps, in place of its 4 warps in 64-key steps).
bool PagedU8RowWarps8() { return EnvIs("ORTKV_PAGED_U8_ROW_WARPS", "8"); }

}  // namespace

size_t PagedUpdateOwnerBytes(const PagedUpdateCudaView& v) {
  return v.rows() == 0 || PathOf(v).blocks > 0 ? 0 : OwnerBytesOf(v);
}

Status PagedCacheUpdateCuda(const PagedUpdateCudaView& v, void* stream_ptr) {
  if (v.rows() == 0) return Status::Ok();
  if (v.flag == nullptr) return Status(Code::kRuntime, "PagedCacheUpdate CUDA: no flag workspace");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  UpdateArgs a{v};
  const UpdatePath path = PathOf(v);
  if (const int64_t blocks = path.blocks) {  // Note [Paged CUDA resolved update]
    if (!path.plain && pv2::CurrentMajor() >= 9 && CudaEarlyLaunch() &&
        LaunchProgrammatic(PagedUpdateResolvedKernel<true>, static_cast<unsigned>(blocks), kResolvedThreads, 0, stream,
                           a))
      return Status::Ok();
    PagedUpdateResolvedKernel<false><<<static_cast<unsigned>(blocks), kResolvedThreads, 0, stream>>>(a);
    const cudaError_t e1 = cudaGetLastError();
    return e1 == cudaSuccess ? Status::Ok() : LaunchError("PagedCacheUpdate", e1);
  }
  const size_t owners = OwnerBytesOf(v);
  if (v.owners == nullptr || reinterpret_cast<char*>(v.owners) != static_cast<char*>(v.flag) + 256)
    return Status(Code::kRuntime, "PagedCacheUpdate CUDA: no row-owner workspace after the flag");
  // the flag and the row owners (Note [Paged CUDA row owners]): every byte 0xFF
  cudaError_t e = cudaMemsetAsync(v.flag, 0xFF, 256 + owners, stream);
  if (e != cudaSuccess) return LaunchError("PagedCacheUpdate", e);
  if (v.p.page_fill != nullptr) {  // Note [Page fill] on CUDA: the prefix sums first
    if (v.fill_prefix == nullptr) return Status(Code::kRuntime, "PagedCacheUpdate CUDA: no page_fill workspace");
    a.v.p.fill_prefix = v.fill_prefix;
    FillPrefixKernel<<<static_cast<unsigned>(v.B), kFillThreads, 0, stream>>>(
        a.v.p, v.fill_prefix, static_cast<unsigned long long*>(v.flag), nullptr);
    e = cudaGetLastError();
    if (e != cudaSuccess) return LaunchError("PagedCacheUpdate", e);
  }
  const int64_t rows = v.rows();
  // the check: a warp a row job, 4 warps a block of 128 threads; the store: kStoreWarps a block, a warp a job
  const int64_t check_blocks = (rows + 3) / 4, store_blocks = (rows + v.q_jobs() + kStoreWarps - 1) / kStoreWarps;
  if (store_blocks > 0x7fffffff) return Status(Code::kInvalidArgument, "PagedCacheUpdate CUDA: too many rows for one launch; split the batch");
  const int64_t units = v.B * v.T;
  if (units > 0xFFFFFFFEll) return Status(Code::kInvalidArgument, "PagedCacheUpdate CUDA: too many tokens for one launch; split the batch");
  PagedUpdateClaimKernel<<<static_cast<unsigned>((units + 255) / 256), 256, 0, stream>>>(a);
  e = cudaGetLastError();
  if (e != cudaSuccess) return LaunchError("PagedCacheUpdate", e);
  PagedUpdateCheckKernel<<<static_cast<unsigned>(check_blocks), 128, 0, stream>>>(a);
  e = cudaGetLastError();
  if (e != cudaSuccess) return LaunchError("PagedCacheUpdate", e);
  PagedUpdateStoreKernel<<<static_cast<unsigned>(store_blocks), kStoreWarps * 32, 0, stream>>>(a);
  e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : LaunchError("PagedCacheUpdate", e);
}

Status PagedCacheAttentionCuda(const PagedAttentionCudaView& v, void* stream_ptr) {
  if (v.units() == 0) return Status::Ok();
  if (v.flag == nullptr || (v.splits > 1 && v.partial == nullptr))
    return Status(Code::kRuntime, "PagedCacheAttention CUDA: no workspace");
  const int64_t G = v.group();
  const int gm = G <= 4 ? static_cast<int>(G) : 8;
  AttnArgs a;
  a.v = v;
  a.head_blocks = (G + gm - 1) / gm;
  const bool fill = v.p.page_fill != nullptr;
  if (fill && (v.fill_prefix == nullptr || v.row_flags == nullptr))
    return Status(Code::kRuntime, "PagedCacheAttention CUDA: no page_fill workspace");
  if (fill) a.v.p.fill_prefix = v.fill_prefix;
  int tpk = 1;
  while (tpk * kEPT < v.D) tpk *= 2;
  a.tpk = tpk;
  const int64_t blocks = v.units() * a.head_blocks * v.splits;
  if (blocks > 0x7fffffff)
    return Status(Code::kInvalidArgument, "PagedCacheAttention CUDA: " + std::to_string(blocks) +
                                              " blocks exceed the grid limit; split the batch");
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  int level = 0;
  ORTKV_RETURN_IF_ERR(CudaAttentionKernelChoice(&level));
  const bool v2 = level != 1 && !fill && v.vec && v.D <= kAttnCudaMaxHeadSize && v.p.shape.page_size % pv2::kU == 0 &&
                  v.block_flags != nullptr;  // Note [Paged CUDA v2]; page_fill: Note [Page fill] on CUDA
  const bool v3 = v2 && level != 2 && PagedV3Shape(v);  // Note [Paged CUDA v3]
  // Note [Paged CUDA uniform 16-bit]: the node promises pages of the queries' own 16-bit format
  const bool u16 = v3 && v.page_format == static_cast<int32_t>(v.elem_type == kFloat16 ? PageFormat::kF16 : PageFormat::kBF16);
  // Note [Paged CUDA uniform INT4]: INT4 pages promised under float16 queries at head size 64
  const bool u4 = v3 && v.elem_type == kFloat16 && v.D == 64 && v.page_format == static_cast<int32_t>(PageFormat::kInt4);
  // Note [Paged CUDA uniform INT8]: INT8 pages promised likewise (unless ORTKV_PAGED_UNIFORM_INT8=0)
  const bool u8 = v3 && v.elem_type == kFloat16 && v.D == 64 &&
                  v.page_format == static_cast<int32_t>(PageFormat::kInt8) && PagedUniformInt8();
  cudaError_t e = cudaSuccess;
  if (!v2) {  // the first kernel's blocks atomicMin into one flag: cleared first
    e = cudaMemsetAsync(v.flag, 0xFF, sizeof(unsigned long long), stream);
    if (e != cudaSuccess) return LaunchError("PagedCacheAttention", e);
  }
  if (fill) {
    FillPrefixKernel<<<static_cast<unsigned>(v.B), kFillThreads, 0, stream>>>(a.v.p, v.fill_prefix, nullptr,
                                                                               v.row_flags);
    e = cudaGetLastError();
    if (e != cudaSuccess) return LaunchError("PagedCacheAttention", e);
  }
  switch (v.elem_type) {
    case kFloat16:
      e = u16  ? pu::Launch<__half>(a, stream)
          : u4 ? pu4::LaunchInt4(a, PagedU4RowWarps8(), stream)
          : u8 ? pu4::LaunchInt8(a, PagedInt8RowSteps64(), PagedU8RowWarps8(), stream)
          : v3 ? pv3::Launch<__half>(a, stream)
          : v2 ? pv2::Launch<__half>(a, gm, stream)
               : LaunchAttn<__half>(a, gm, blocks, stream);
      break;
    case kBFloat16:
      e = u16  ? pu::Launch<__nv_bfloat16>(a, stream)
          : v3 ? pv3::Launch<__nv_bfloat16>(a, stream)
          : v2 ? pv2::Launch<__nv_bfloat16>(a, gm, stream)
               : LaunchAttn<__nv_bfloat16>(a, gm, blocks, stream);
      break;
    default: e = v2 ? pv2::Launch<float>(a, gm, stream) : LaunchAttn<float>(a, gm, blocks, stream); break;
  }
  return e == cudaSuccess ? Status::Ok() : LaunchError("PagedCacheAttention", e);
}

// Note [Paged CUDA last block reports]: the node's pair of words on `stream`.
static Status WordsFail(const char* what, cudaError_t e) {
  return Status(Code::kRuntime, std::string("PagedCacheAttention CUDA: ") + what + " failed: " + cudaGetErrorName(e) +
                                    ": " + cudaGetErrorString(e));
}
PagedReportWords::~PagedReportWords() {
  int current = -1;
  const bool known = cudaGetDevice(&current) == cudaSuccess;
  for (const Pair& p : pairs_) {
    if (cudaSetDevice(p.device) == cudaSuccess) (void)cudaFree(p.words);
  }
  if (known) (void)cudaSetDevice(current);
  (void)cudaGetLastError();
}

Status PagedReportWords::For(void* stream_ptr, unsigned long long** words) {
  *words = nullptr;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return WordsFail("cudaGetDevice", e);
  std::lock_guard<std::mutex> lock(mu_);
  for (const Pair& p : pairs_) {
    if (p.device == device && p.stream == stream_ptr) {
      *words = p.words;
      return Status::Ok();
    }
  }
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  e = cudaStreamIsCapturing(stream, &capture);
  if (e != cudaSuccess) return WordsFail("cudaStreamIsCapturing", e);
  if (capture != cudaStreamCaptureStatusNone) return Status::Ok();  // no pair: the combine's scan block reports
  unsigned long long* w = nullptr;
  e = cudaMalloc(&w, 2 * sizeof(unsigned long long));
  if (e != cudaSuccess) return WordsFail("cudaMalloc of the node's 16 bytes of report words", e);
  e = cudaMemsetAsync(w, 0, sizeof(unsigned long long), stream);  // arrivals
  if (e == cudaSuccess) e = cudaMemsetAsync(w + 1, 0xFF, sizeof(unsigned long long), stream);  // kNoError
  if (e != cudaSuccess) {
    (void)cudaFree(w);
    return WordsFail("cudaMemsetAsync of the node's report words", e);
  }
  pairs_.push_back(Pair{device, stream_ptr, w});
  *words = w;
  return Status::Ok();
}

}  // namespace ortkv
