// PagedRequantize: one page slot from one format into another, every layer (ortkv/paged.h). Compiled
// into the Python extension (_ortkv.paged_requantize, the pool manager's host function); it needs only
// the codecs, no framework.
#include <cstring>
#include <sstream>
#include <vector>

#include "ortkv/core.h"
#include "ortkv/paged.h"
#include "ortkv/protected_writes.h"

namespace ortkv {

using codecs::PageFormat;
using codecs::PageView;

Status CheckPagedRequantize(uint64_t pool_bytes, uint64_t src_offset, int32_t src_format, uint64_t dst_offset,
                            int32_t dst_format, int32_t num_layers, codecs::PageShape shape, int32_t logical) {
  const std::string what = "paged_requantize: ";
  ORTKV_RETURN_IF_ERR(codecs::ValidateShape(src_format, shape));
  ORTKV_RETURN_IF_ERR(codecs::ValidateShape(dst_format, shape));
  if (num_layers < 1) return Status(Code::kInvalidArgument, what + "num_layers must be >= 1, got " + std::to_string(num_layers));
  if (!(logical == kFloat32 || logical == kFloat16 || logical == kBFloat16)) {
    return Status(Code::kInvalidArgument, what + "logical type " + std::to_string(logical) +
                                              " must be float32 (1), float16 (10) or bfloat16 (16)");
  }
  const auto sf = static_cast<PageFormat>(src_format), df = static_cast<PageFormat>(dst_format);
  const codecs::PageLayout sl = codecs::LayoutOf(sf, shape), dl = codecs::LayoutOf(df, shape);
  const uint64_t ss = sl.page_bytes * num_layers, ds = dl.page_bytes * num_layers;
  std::ostringstream m;
  if (src_offset % codecs::kSectionAlign || dst_offset % codecs::kSectionAlign || src_offset > pool_bytes ||
      ss > pool_bytes - src_offset || dst_offset > pool_bytes || ds > pool_bytes - dst_offset) {
    m << what << "source slot [" << src_offset << ", +" << ss << ") (" << codecs::FormatName(sf) << ") or destination slot ["
      << dst_offset << ", +" << ds << ") (" << codecs::FormatName(df) << ") is not 16-byte aligned or not inside the pool of "
      << pool_bytes << " bytes; nothing was written";
    return Status(Code::kInvalidArgument, m.str());
  }
  if (src_offset < dst_offset + ds && dst_offset < src_offset + ss) {
    m << what << "source slot [" << src_offset << ", +" << ss << ") and destination slot [" << dst_offset << ", +" << ds
      << ") overlap; requantize into a free slot; nothing was written";
    return Status(Code::kInvalidArgument, m.str());
  }
  return Status::Ok();
}

static_assert(kFloat16 == 10 && kBFloat16 == 16, "codecs::RoundToLogical takes ONNX's type numbers");

Status CheckRequantizeSlots(int device_type, int32_t device, const uint8_t* pool, uint64_t src_offset,
                            uint64_t src_bytes, uint64_t dst_offset, uint64_t dst_bytes, const std::string& what) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(pool);
  const auto slot = [&](uint64_t at, uint64_t n) {
    return [base, at, n](int64_t, uintptr_t* first, uintptr_t* last) {
      *first = base + at;
      *last = base + at + n;
    };
  };
  const auto words = [&](const char* name) {
    return [&what, name](int64_t) { return std::make_pair(what + name, std::string(",")); };
  };
  ORTKV_RETURN_IF_ERR(CheckProtectedWrites(device_type, device, 1, slot(src_offset, src_bytes), words("the source slot"),
                                           "requantize only a page whose slot is committed (a page of this pool).", "",
                                           1 << ORTKV_RANGE_UNCOMMITTED));
  return CheckProtectedWrites(device_type, device, 1, slot(dst_offset, dst_bytes), words("the destination slot"),
                              "requantize into a committed free slot (PagePool takes one from a committed granule).",
                              "requantize into a slot of the pool's own writable memory, not a read-only mapping.");
}

Status PagedRequantize(uint8_t* pool, uint64_t pool_bytes, uint64_t src_offset, int32_t src_format,
                       uint64_t dst_offset, int32_t dst_format, int32_t num_layers, codecs::PageShape shape,
                       int32_t logical) {
  const std::string what = "paged_requantize: ";
  ORTKV_RETURN_IF_ERR(
      CheckPagedRequantize(pool_bytes, src_offset, src_format, dst_offset, dst_format, num_layers, shape, logical));
  const auto sf = static_cast<PageFormat>(src_format), df = static_cast<PageFormat>(dst_format);
  const codecs::PageLayout sl = codecs::LayoutOf(sf, shape), dl = codecs::LayoutOf(df, shape);
  const uint64_t ds = dl.page_bytes * num_layers;
  ORTKV_RETURN_IF_ERR(CheckRequantizeSlots(ORTKV_DEVICE_CPU, 0, pool, src_offset, sl.page_bytes * num_layers, dst_offset,
                                           ds, what));
  const uint64_t vals = 2ull * shape.kv_heads * shape.page_size * shape.head_size;
  std::vector<float> values(vals);
  std::vector<uint8_t> staged(ds);  // one slot: every layer is encoded before the destination changes
  for (int32_t l = 0; l < num_layers; ++l) {
    const PageView src = PageView::Make(pool + src_offset + l * sl.page_bytes, sf, shape);
    ORTKV_RETURN_IF_ERR(codecs::DecodePage(src, values.data()));
    codecs::RoundToLogical(values.data(), static_cast<int64_t>(vals), logical);
    const PageView dst = PageView::Make(staged.data() + l * dl.page_bytes, df, shape);
    const Status s = codecs::EncodePage(dst, values.data());
    if (!s.ok()) return Status(s.code(), what + "layer " + std::to_string(l) + ": " + s.message() + "; nothing was written");
  }
  memcpy(pool + dst_offset, staged.data(), ds);
  return Status::Ok();
}

}  // namespace ortkv
