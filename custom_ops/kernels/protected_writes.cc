// Note [Write-protection check] in ortkv/protected_writes.h.
#include "ortkv/protected_writes.h"

#include <sstream>

#include "ortkv/core.h"

namespace ortkv {
namespace {
std::string Hex(uintptr_t p) {
  std::ostringstream s;
  s << "0x" << std::hex << p;
  return s.str();
}
}  // namespace

Status CheckProtectedWrites(int device_type, int device_id, int64_t n, FnRef<void(int64_t, uintptr_t*, uintptr_t*)> span,
                            FnRef<std::pair<std::string, std::string>(int64_t)> words, const char* uncommitted_remedy,
                            const char* readonly_remedy, int32_t kind_mask) {
  if (ortkv_core_protected_count() == 0) return Status::Ok();  // the common case: one atomic read
  for (int64_t i = 0; i < n; ++i) {
    uintptr_t first = 0, last = 0;
    span(i, &first, &last);
    uintptr_t hit = 0;
    uint64_t hit_len = 0;
    char label[128];
    const int kind = ortkv_core_find_protected(device_type, device_id, first, last - first, kind_mask, &hit, &hit_len,
                                               label, sizeof(label));
    if (kind == 0) continue;
    const bool uncommitted = kind == ORTKV_RANGE_UNCOMMITTED;
    const auto [before, after] = words(i);
    std::ostringstream m;
    m << before << " [" << Hex(first) << ", " << Hex(last) << ")" << after << " which overlaps the "
      << (uncommitted ? "uncommitted" : "write-protected") << " range [" << Hex(hit) << ", +" << hit_len << " bytes) '"
      << label << "'. Nothing was written. Remedy: " << (uncommitted ? uncommitted_remedy : readonly_remedy);
    return Status(uncommitted ? Code::kUncommitted : Code::kReadOnly, m.str());
  }
  return Status::Ok();
}

}  // namespace ortkv
