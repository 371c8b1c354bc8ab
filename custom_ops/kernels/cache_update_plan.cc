// Validation of CacheUpdate's inputs (user-input tier of checks: every message names the node, the
// tensor and the numbers). Runs before any byte is written, so every refusal leaves the cache as it was.
#include <sstream>

#include "ortkv/cache_update.h"

namespace ortkv {

const char* ElemTypeName(int32_t t) {
  switch (t) {
    case 1: return "float32";
    case 2: return "uint8";
    case 3: return "int8";
    case 4: return "uint16";
    case 5: return "int16";
    case 6: return "int32";
    case 7: return "int64";
    case 9: return "bool";
    case 10: return "float16";
    case 11: return "float64";
    case 16: return "bfloat16";
    default: return "an unsupported type";
  }
}

size_t ElemSize(int32_t t) {
  switch (t) {
    case kFloat32: return 4;
    case kFloat16:
    case kBFloat16: return 2;
    default: return 0;
  }
}

namespace {

Status Bad(const char* op, const std::string& node, const std::string& what) {
  return Status(Code::kInvalidArgument, std::string(op) + " node '" + node + "': " + what);
}

}  // namespace

namespace {

Status Plan(const char* op, const std::string& node, const TensorArg& cache, const TensorArg& values, const TensorArg& position,
            int64_t seq_axis, bool read_positions, CacheUpdateView* view) {
  const int64_t rank = static_cast<int64_t>(cache.dims.size());
  Message m;  // Note [Messages on the error path only]
  if (rank < 3) {
    m << "input '" << cache.name << "' has rank " << rank << " (shape " << ShapeText(cache.dims)
      << "); a cache needs rank >= 3, e.g. BNSH [batch, heads, capacity, head_size]";
    return Bad(op, node, m.str());
  }
  for (int64_t i = 0; i < rank; ++i) {
    if (cache.dims[i] == 0) {
      m << "input '" << cache.name << "' has shape " << ShapeText(cache.dims) << " with no elements (dim " << i
        << " is 0); a cache holds at least one slot in every dim, so allocate it with every dim >= 1";
      return Bad(op, node, m.str());
    }
  }
  const size_t esize = ElemSize(cache.elem_type);
  if (esize == 0) {
    m << "input '" << cache.name << "' is " << ElemTypeName(cache.elem_type) << " (type "
      << cache.elem_type << "); " << op << " takes float32, float16 or bfloat16";
    return Bad(op, node, m.str());
  }
  if (values.elem_type != cache.elem_type) {
    m << "input '" << values.name << "' is " << ElemTypeName(values.elem_type) << " but '" << cache.name
      << "' is " << ElemTypeName(cache.elem_type) << "; the new values must have the cache's element type";
    return Bad(op, node, m.str());
  }
  // seq_axis 0 (exactly; -rank is not accepted) is SBNH, the batch then on axis 1 (Note [CacheUpdate SBNH])
  const bool token_major = seq_axis == 0;
  const int64_t axis = seq_axis < 0 ? seq_axis + rank : seq_axis;
  if (!token_major && (axis < 1 || axis >= rank)) {
    m << "attribute seq_axis=" << seq_axis << " resolves to axis " << axis << " of the rank-" << rank
      << " '" << cache.name << "'; the sequence axis must be 0 (SBNH: [capacity, batch, ...]) or in [1, " << rank - 1
      << "] (axis 0 is the batch): -2 for BNSH, 1 for BSNH";
    return Bad(op, node, m.str());
  }
  const int64_t batch_axis = token_major ? 1 : 0;
  if (values.dims.size() != cache.dims.size()) {
    m << "input '" << values.name << "' has shape " << ShapeText(values.dims) << " (rank " << values.dims.size()
      << ") but '" << cache.name << "' has shape " << ShapeText(cache.dims) << " (rank " << rank
      << "); they must differ only along the sequence axis " << axis;
    return Bad(op, node, m.str());
  }
  for (int64_t i = 0; i < rank; ++i) {
    if (i != axis && values.dims[i] != cache.dims[i]) {
      m << "input '" << values.name << "' has shape " << ShapeText(values.dims) << " but '" << cache.name
        << "' has shape " << ShapeText(cache.dims) << ": dim " << i << " is " << values.dims[i] << ", expected "
        << cache.dims[i] << " (only the sequence axis " << axis << " may differ)";
      return Bad(op, node, m.str());
    }
  }
  const int64_t n = values.dims[axis];
  const int64_t capacity = cache.dims[axis];
  if (n < 1) {
    m << "input '" << values.name << "' (shape " << ShapeText(values.dims) << ") holds " << n
      << " tokens along the sequence axis " << axis << "; n must be >= 1";
    return Bad(op, node, m.str());
  }
  if (position.elem_type != kInt64) {
    m << "input '" << position.name << "' is " << ElemTypeName(position.elem_type) << "; position must be int64";
    return Bad(op, node, m.str());
  }
  const int64_t rows = cache.dims[batch_axis];
  int64_t stride = 0;
  if (position.dims.size() == 1) {
    if (position.dims[0] != rows) {
      m << "input '" << position.name << "' has " << position.dims[0] << " entries but '" << cache.name
        << "' has batch size " << rows << " (axis " << batch_axis << " of shape " << ShapeText(cache.dims)
        << "); pass a scalar for every row or one position per row";
      return Bad(op, node, m.str());
    }
    stride = 1;
  } else if (!position.dims.empty()) {
    m << "input '" << position.name << "' has shape " << ShapeText(position.dims)
      << "; position must be a scalar or a vector of length batch (" << rows << ")";
    return Bad(op, node, m.str());
  }
  const int64_t* pos = static_cast<const int64_t*>(position.data);
  for (int64_t r = 0; read_positions && r < rows; ++r) {
    const int64_t p = pos[r * stride];
    if (p < 0) {
      m << "position " << p << " for row " << r << " of '" << cache.name << "' is negative; positions start at 0";
      return Bad(op, node, m.str());
    }
    if (p > capacity - n) {
      // p >= 0 and n >= 1 here, so their sum fits in uint64 even at p = INT64_MAX (as int64 it overflows).
      const uint64_t end = static_cast<uint64_t>(p) + static_cast<uint64_t>(n);
      m << op << " node '" << node << "': row " << r << ": position " << p << " + n " << n << " = "
        << end << " exceeds capacity " << capacity << " of '" << cache.name << "' (shape "
        << ShapeText(cache.dims) << ", sequence axis " << axis
        << "). Nothing was written. Remedy: evict or start a new sequence, or allocate a cache with capacity >= "
        << end;
      return Status(Code::kCapacity, m.str());
    }
  }

  int64_t outer = 1, token = 1;
  for (int64_t i = 1; i < axis; ++i) outer *= cache.dims[i];
  for (int64_t i = token_major ? 2 : axis + 1; i < rank; ++i) token *= cache.dims[i];
  view->cache = const_cast<void*>(cache.data);
  view->values = values.data;
  view->positions = pos;
  view->position_stride = stride;
  view->rows = rows;
  view->outer = outer;
  view->capacity = capacity;
  view->n = n;
  view->token_bytes = token * static_cast<int64_t>(esize);
  view->token_major = token_major;

  // Note [CacheUpdate values must not overlap the cache]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // The copies are memcpy (CPU) and unordered vector stores (CUDA), split over threads / blocks.
  // If `values` shares bytes with `cache`, a copy reads bytes another copy (or itself) has already
  // overwritten: undefined for memcpy, and different from run to run on the thread pool. The
  // update has no sensible meaning then (which token wins?), so it is refused before any write;
  // values sliced out of the cache must be copied by the caller first. Both inputs are on the
  // op's device (CPU, or CUDA memory for the CUDA op), so their addresses are comparable.
  const uintptr_t cache_lo = reinterpret_cast<uintptr_t>(cache.data);
  const uintptr_t cache_hi = cache_lo + static_cast<uintptr_t>(rows * outer * capacity * view->token_bytes);
  const uintptr_t values_lo = reinterpret_cast<uintptr_t>(values.data);
  const uintptr_t values_hi = values_lo + static_cast<uintptr_t>(view->bytes_written());
  if (values_lo < cache_hi && cache_lo < values_hi) {
    m << "input '" << values.name << "' [0x" << std::hex << values_lo << ", 0x" << values_hi
      << ") overlaps the cache '" << cache.name << "' [0x" << cache_lo << ", 0x" << cache_hi << std::dec
      << ") (" << view->bytes_written() << " and " << cache_hi - cache_lo
      << " bytes); the new values must not share memory with the cache they are written into. Nothing was "
         "written. Remedy: copy the values into their own buffer first (e.g. np.array(values, copy=True))";
    return Bad(op, node, m.str());
  }
  return Status::Ok();
}

}  // namespace

Status PlanCacheUpdate(const std::string& node, const TensorArg& cache, const TensorArg& values,
                       const TensorArg& position, int64_t seq_axis, CacheUpdateView* view) {
  return Plan("CacheUpdate", node, cache, values, position, seq_axis, true, view);
}

Status PlanCacheUpdateDevice(const std::string& node, const TensorArg& cache, const TensorArg& values,
                             const TensorArg& position, int64_t seq_axis, CacheUpdateView* view) {
  return Plan("CacheUpdate", node, cache, values, position, seq_axis, false, view);
}

Status PlanCacheWrite(const char* op, const std::string& node, const TensorArg& cache, const TensorArg& values,
                      const TensorArg& position, int64_t seq_axis, bool read_positions, CacheUpdateView* view) {
  return Plan(op, node, cache, values, position, seq_axis, read_positions, view);
}

void CacheUpdatePairSpan(const CacheUpdateView& v, int64_t pair, uintptr_t* first, uintptr_t* last) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(v.cache);
  if (v.token_major) {  // Note [CacheUpdate SBNH]: one token of one row
    const int64_t r = pair % v.rows, t = pair / v.rows;
    *first = base + static_cast<uintptr_t>(((v.position(r) + t) * v.rows + r) * v.token_bytes);
    *last = *first + static_cast<uintptr_t>(v.token_bytes);
    return;
  }
  *first = base + static_cast<uintptr_t>((pair * v.capacity + v.position(pair / v.outer)) * v.token_bytes);
  *last = *first + static_cast<uintptr_t>(v.n * v.token_bytes);
}

}  // namespace ortkv
