// The write-protection check shared by the op library's writers and the pool manager's requantize (both link
// custom_ops/kernels/protected_writes.cc); framework-free: ortkv_core's range registry and Status only.
#pragma once
#include <cstdint>
#include <string>
#include <utility>

#include "ortkv/status.h"

namespace ortkv {

// A non-owning reference to a callable (it must outlive the call that takes it): unlike std::function, making
// one never allocates. CheckProtectedWrites runs on every CacheUpdate / RotaryCacheUpdate call and the KV arena's
// uncommitted tail is a registered range, so its two std::function arguments were two allocations per run.
template <typename Sig>
class FnRef;
template <typename R, typename... A>
class FnRef<R(A...)> {
 public:
  template <typename F>
  FnRef(const F& f) : obj_(&f), call_([](const void* o, A... a) -> R { return (*static_cast<const F*>(o))(a...); }) {}
  R operator()(A... a) const { return call_(obj_, a...); }

 private:
  const void* obj_;
  R (*call_)(const void*, A...);
};

// Note [Write-protection check]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// CacheUpdate, PagedCacheUpdate and paged_requantize refuse, before any store, a write span [first, last) that
// overlaps a range registered in ortkv_core as write-protected (a read-only shared prefix) or uncommitted (arena
// space not yet backed). CheckProtectedWrites walks the op's spans, `span(i, &first, &last)` for i in [0, n), and on
// the first hit builds the op's message: `before(i)` + " [first, last)" + `after(i)` + " which overlaps the <kind>
// range [hit, +len bytes) '<label>'. Nothing was written. Remedy: " + the remedy for that kind, with the code
// E_UNCOMMITTED or E_READONLY. `kind_mask` (bit 1 << ORTKV_RANGE_*; 0 = both kinds) narrows the check: a span that
// is only read (a requantize's source) is checked for uncommitted ranges alone. The common case (no range
// registered) is one atomic read.
Status CheckProtectedWrites(int device_type, int device_id, int64_t n, FnRef<void(int64_t, uintptr_t*, uintptr_t*)> span,
                            FnRef<std::pair<std::string, std::string>(int64_t)> words, const char* uncommitted_remedy,
                            const char* readonly_remedy, int32_t kind_mask = 0);

}  // namespace ortkv
