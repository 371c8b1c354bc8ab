// The process-global registry of write-protected ranges. See Note [One core per process] in
// ortkv/core.h. Lookups happen once per kernel launch (not per element); a mutex and a small vector
// are enough at the sizes involved (a few ranges per shared prefix).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "ortkv/core.h"

namespace {

struct Range {
  int64_t id;
  int32_t device_type;
  int32_t device_id;
  uintptr_t addr;
  uint64_t nbytes;
  std::string label;
  int32_t kind;
};

struct Registry {
  std::mutex mu;
  std::vector<Range> ranges;
  int64_t next_id = 1;
  std::atomic<uint64_t> count{0};  // read without the lock by the kernels' fast path
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: kernels may run during teardown
  return *r;
}

}  // namespace

int64_t ortkv_core_protect_range(int32_t device_type, int32_t device_id, uintptr_t addr,
                                 uint64_t nbytes, const char* label, int32_t kind) {
  if (nbytes == 0) return -1;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  int64_t id = r.next_id++;
  r.ranges.push_back(Range{id, device_type, device_id, addr, nbytes, label ? label : "", kind});
  r.count.store(r.ranges.size(), std::memory_order_release);
  return id;
}

int ortkv_core_unprotect_range(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = std::find_if(r.ranges.begin(), r.ranges.end(), [id](const Range& x) { return x.id == id; });
  if (it == r.ranges.end()) return 0;
  r.ranges.erase(it);
  r.count.store(r.ranges.size(), std::memory_order_release);
  return 1;
}

int ortkv_core_find_protected(int32_t device_type, int32_t device_id, uintptr_t addr, uint64_t nbytes,
                              int32_t kind_mask, uintptr_t* hit_addr, uint64_t* hit_nbytes, char* label_out,
                              size_t label_cap) {
  if (nbytes == 0) return 0;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const Range& x : r.ranges) {
    if (x.device_type != device_type || x.device_id != device_id) continue;
    if (kind_mask != 0 && (kind_mask & (1 << x.kind)) == 0) continue;
    if (addr < x.addr + x.nbytes && x.addr < addr + nbytes) {
      if (hit_addr) *hit_addr = x.addr;
      if (hit_nbytes) *hit_nbytes = x.nbytes;
      if (label_out && label_cap > 0) {
        size_t k = std::min(label_cap - 1, x.label.size());
        std::memcpy(label_out, x.label.data(), k);
        label_out[k] = '\0';
      }
      return x.kind;
    }
  }
  return 0;
}

uint64_t ortkv_core_protected_count(void) { return registry().count.load(std::memory_order_acquire); }

uintptr_t ortkv_core_instance(void) { return reinterpret_cast<uintptr_t>(&registry()); }

// --- the arena lease (Note [Arena lease] in ortkv/core.h) ------------------------------------------
namespace {
std::shared_mutex& Lease() {
  static std::shared_mutex* m = new std::shared_mutex();  // never destroyed, like the registry
  return *m;
}
}  // namespace

void ortkv_core_lease_acquire(int exclusive) {
  if (exclusive)
    Lease().lock();
  else
    Lease().lock_shared();
}

void ortkv_core_lease_release(int exclusive) {
  if (exclusive)
    Lease().unlock();
  else
    Lease().unlock_shared();
}
