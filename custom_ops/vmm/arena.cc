// See Note [Arena transactions] in arena.h.
#include "arena.h"

#include <algorithm>
#include <atomic>
#include <sstream>

#include "ortkv/core.h"

namespace ortkv {
namespace vmm {

struct Phys {
  std::shared_ptr<Backend> backend;
  std::shared_ptr<Governor> governor;  // billed once, by the owner's commit
  uint64_t handle = 0;
  uint64_t size = 0;
  int mappings = 0;  // live mappings of this handle, in every arena
};

namespace {

// One lock for every arena: commits, shares and teardown are rare next to kernel launches, and a
// physical allocation's mapping count spans arenas.
std::mutex& Mu() {
  static std::mutex* mu = new std::mutex();
  return *mu;
}

std::atomic<uint64_t> g_live_mappings[2];

uint64_t RoundUp(uint64_t x, uint64_t g) { return (x + g - 1) / g * g; }

std::string Bytes(uint64_t n) { return std::to_string(n) + " bytes"; }

// The backend refused to reserve address space (mmap ENOMEM under ulimit -v, a size beyond the
// address space, cuMemAddressReserve out of memory or invalid value): a capacity problem with numbers.
Status ReservationRefused(const std::string& who, uint64_t bytes, uint64_t granule, const Status& why) {
  std::ostringstream m;
  m << who << ": the reservation of " << bytes << " bytes of address space was refused (" << why.message()
    << "). Reserve less (only what the longest sequence needs), or raise the address-space limit (ulimit -v) "
    << "[requested=" << bytes << " granule=" << granule << "]";
  return Status(Code::kCapacity, m.str());
}

// "[offset, offset + nbytes)" without wrapping past 2**64.
std::string EndOf(uint64_t offset, uint64_t nbytes) {
  unsigned __int128 end = static_cast<unsigned __int128>(offset) + nbytes;
  std::string e;
  do {
    e.insert(e.begin(), static_cast<char>('0' + static_cast<int>(end % 10)));
    end /= 10;
  } while (end != 0);
  return e;
}

}  // namespace

// --- Governor ---------------------------------------------------------------------------------
Status Governor::Grant(uint64_t bytes, const std::string& who) {
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes > budget_ - std::min(budget_, in_use_)) {
    std::ostringstream m;
    m << who << ": the governor refused " << bytes << " bytes: budget " << budget_ << ", in use " << in_use_
      << ", free " << (budget_ - std::min(budget_, in_use_))
      << ". Retry once other caches release memory (release() or close() an arena), or ask for less "
      << "[requested=" << bytes << " budget=" << budget_ << " in_use=" << in_use_ << "]";
    return Status(Code::kCapacity, m.str());
  }
  in_use_ += bytes;
  return Status::Ok();
}

void Governor::Return(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  in_use_ -= std::min(in_use_, bytes);
}

void Governor::Quarantine(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  quarantined_ += bytes;
}

uint64_t Governor::budget() const {
  std::lock_guard<std::mutex> lock(mu_);
  return budget_;
}
uint64_t Governor::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}
uint64_t Governor::quarantined() const {
  std::lock_guard<std::mutex> lock(mu_);
  return quarantined_;
}

// --- Arena ------------------------------------------------------------------------------------
Status Arena::Create(std::shared_ptr<Backend> backend, uint64_t reserve_bytes, std::shared_ptr<Governor> governor,
                     std::unique_ptr<Arena>* out) {
  if (reserve_bytes == 0) return Status(Code::kInvalidArgument, "Arena: reserve_bytes must be > 0, got 0");
  std::unique_ptr<Arena> a(new Arena(std::move(backend), std::move(governor)));
  // Nothing to tear down until the reservation exists: a half-built arena must not run Close() from
  // its destructor (see Note [Arena teardown]).
  a->closed_ = true;
  ORTKV_RETURN_IF_ERR(a->backend_->Granularity(&a->granule_));
  const std::string who = std::string("Arena(") + a->backend_->name() + ")";
  if (reserve_bytes > UINT64_MAX - (a->granule_ - 1)) {
    std::ostringstream m;
    m << who << ": reserve_bytes " << reserve_bytes << " cannot be rounded up to the " << a->granule_
      << "-byte granule within 64 bits; reserve less [requested=" << reserve_bytes << " granule=" << a->granule_ << "]";
    return Status(Code::kCapacity, m.str());
  }
  a->reserved_ = RoundUp(reserve_bytes, a->granule_);
  // The backend call needs no lock: it touches no shared state.
  Status s = a->backend_->Reserve(a->reserved_, &a->base_);
  if (!s.ok()) return ReservationRefused(who, a->reserved_, a->granule_, s);
  std::lock_guard<std::mutex> lock(Mu());
  a->closed_ = false;
  a->SyncProtection();
  *out = std::move(a);
  return Status::Ok();
}

// Note [Arena teardown]
// ~~~~~~~~~~~~~~~~~~~~~
// The destructor closes an arena that is still open, and Close() takes the global lock. So every
// path that may destroy an Arena while holding that lock (a failed Create or MapSharedPrefix) marks
// it closed first: the destructor then does nothing, instead of locking the held mutex again (that
// self-deadlock once made Arena(2**63) hang instead of raising).
Arena::~Arena() {
  if (!closed_) {
    bool q = false;
    Close(&q);  // best effort; Python closes explicitly and reports errors
  }
}

void Arena::InjectFault(const std::string& op, int64_t countdown) {
  std::lock_guard<std::mutex> lock(Mu());
  faults_.emplace_back(op, countdown);
}

Status Arena::Step(const char* op) {
  for (auto it = faults_.begin(); it != faults_.end(); ++it) {
    if (it->first == op && it->second-- == 0) {
      faults_.erase(it);
      return Status(Code::kRuntime, std::string("injected failure at ") + op);
    }
  }
  return Status::Ok();
}

uint64_t Arena::committed_bytes() const {
  std::lock_guard<std::mutex> lock(Mu());
  uint64_t total = 0;
  for (const Mapping& m : maps_) total += m.size;
  return total;
}

uint64_t Arena::billed_bytes() const { return read_only_ ? 0 : committed_bytes(); }

size_t Arena::live_mappings() const {
  std::lock_guard<std::mutex> lock(Mu());
  return maps_.size();
}

uint64_t Arena::TotalLiveMappings(int device_type) { return g_live_mappings[device_type == ORTKV_DEVICE_CUDA].load(); }

bool Arena::IsCommitted(uint64_t offset, uint64_t nbytes) const {
  std::lock_guard<std::mutex> lock(Mu());
  if (offset > reserved_ || nbytes > reserved_ - offset) return false;  // beyond the reservation (no wrap)
  uint64_t cur = offset / granule_ * granule_;
  const uint64_t end = offset + nbytes;
  for (const Mapping& m : maps_) {
    if (m.offset + m.size <= cur) continue;
    if (m.offset > cur) return false;
    cur = m.offset + m.size;
    if (cur >= end) return true;
  }
  return cur >= end;
}

void Arena::ClearProtection() {
  for (int64_t id : protection_ids_) ortkv_core_unprotect_range(id);
  protection_ids_.clear();
}

void Arena::SyncProtection() {
  ClearProtection();
  if (closed_) return;
  const int dt = backend_->device_type(), di = backend_->device_id();
  if (read_only_) {
    protection_ids_.push_back(
        ortkv_core_protect_range(dt, di, base_, reserved_, "read-only shared prefix", ORTKV_RANGE_READONLY));
    return;
  }
  uint64_t cur = 0;
  for (const Mapping& m : maps_) {
    if (m.offset > cur)
      protection_ids_.push_back(ortkv_core_protect_range(dt, di, base_ + cur, m.offset - cur,
                                                         "uncommitted arena granules", ORTKV_RANGE_UNCOMMITTED));
    cur = m.offset + m.size;
  }
  if (cur < reserved_)
    protection_ids_.push_back(ortkv_core_protect_range(dt, di, base_ + cur, reserved_ - cur,
                                                       "uncommitted arena granules", ORTKV_RANGE_UNCOMMITTED));
}

void Arena::DropPhys(const std::shared_ptr<Phys>& phys) {
  if (--phys->mappings > 0) return;
  if (!Step("release").ok() || !phys->backend->Release(phys->handle).ok()) {
    // The handle could not be released: its bytes are lost to this process, never reused.
    if (phys->governor) phys->governor->Quarantine(phys->size);
    return;
  }
  if (phys->governor) phys->governor->Return(phys->size);
}

Status Arena::UnmapOne(const Mapping& m, bool* unmapped) {
  *unmapped = false;
  Status s = Step("unmap");
  if (s.ok()) s = backend_->Unmap(base_ + m.offset, m.size);
  if (!s.ok()) return s;
  *unmapped = true;
  g_live_mappings[backend_->device_type() == ORTKV_DEVICE_CUDA]--;
  DropPhys(m.phys);
  return Status::Ok();
}

Status Arena::Commit(uint64_t nbytes, uint64_t offset, uint64_t* newly) {
  return CommitRanges({{offset, nbytes}}, newly);
}

Status Arena::CommitRanges(const std::vector<std::pair<uint64_t, uint64_t>>& ranges, uint64_t* newly) {
  std::lock_guard<std::mutex> lock(Mu());
  *newly = 0;
  if (closed_) return Status(Code::kInvalidArgument, "Arena.commit: the arena is closed; create a new Arena");
  if (read_only_)
    return Status(Code::kInvalidArgument, "Arena.commit: a read-only shared prefix cannot commit memory; "
                                          "commit in the owner's arena");
  // Granule-aligned windows of the requested ranges, sorted and merged.
  std::vector<std::pair<uint64_t, uint64_t>> windows;  // [first, last)
  for (const auto& [offset, nbytes] : ranges) {
    if (nbytes == 0) continue;
    if (offset > reserved_ || nbytes > reserved_ - offset) {
      std::ostringstream m;
      const std::string end = EndOf(offset, nbytes);
      m << "Arena.commit: [" << offset << ", " << end << ") exceeds the " << Bytes(reserved_)
        << " reserved; reserve a larger arena (the reservation costs address space only) "
        << "[requested=" << end << " capacity=" << reserved_ << "]";
      return Status(Code::kCapacity, m.str());
    }
    windows.emplace_back(offset / granule_ * granule_, RoundUp(offset + nbytes, granule_));
  }
  std::sort(windows.begin(), windows.end());
  std::vector<std::pair<uint64_t, uint64_t>> merged;
  for (const auto& w : windows) {
    if (!merged.empty() && w.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, w.second);
    else
      merged.push_back(w);
  }
  // Missing runs: the windows minus what is mapped (both sorted: one merge walk).
  std::vector<std::pair<uint64_t, uint64_t>> runs;  // (offset, size)
  size_t mi = 0;
  for (const auto& [first, last] : merged) {
    uint64_t cur = first;
    while (mi < maps_.size() && maps_[mi].offset + maps_[mi].size <= cur) ++mi;
    for (size_t j = mi; j < maps_.size() && maps_[j].offset < last; ++j) {
      if (maps_[j].offset > cur) runs.emplace_back(cur, maps_[j].offset - cur);
      cur = std::max(cur, maps_[j].offset + maps_[j].size);
    }
    if (cur < last) runs.emplace_back(cur, last - cur);
  }
  if (!backend_->SupportsPartialMap()) {  // one handle per granule (see Backend::SupportsPartialMap)
    std::vector<std::pair<uint64_t, uint64_t>> granules;
    for (auto& r : runs)
      for (uint64_t o = r.first; o < r.first + r.second; o += granule_) granules.emplace_back(o, granule_);
    runs.swap(granules);
  }
  const uint64_t offset = merged.empty() ? 0 : merged.front().first;
  const uint64_t nbytes = merged.empty() ? 0 : merged.back().second - offset;
  uint64_t total = 0;
  for (auto& r : runs) total += r.second;
  if (total == 0) return Status::Ok();

  const std::string who = std::string("Arena(") + backend_->name() + ").commit";
  Status s = Step("grant");
  if (s.ok() && governor_) s = governor_->Grant(total, who);
  if (!s.ok()) return s;

  std::vector<Mapping> done;
  std::shared_ptr<Phys> pending;  // created, not mapped yet
  for (auto& r : runs) {
    auto phys = std::make_shared<Phys>();
    phys->backend = backend_;
    phys->governor = governor_;
    phys->size = r.second;
    s = Step("create");
    if (s.ok()) s = backend_->Create(r.second, &phys->handle);
    if (!s.ok()) break;
    pending = phys;
    s = Step("map");
    if (s.ok()) s = backend_->Map(base_ + r.first, r.second, phys->handle, 0);
    if (!s.ok()) break;
    pending.reset();
    phys->mappings = 1;
    g_live_mappings[backend_->device_type() == ORTKV_DEVICE_CUDA]++;
    done.push_back(Mapping{r.first, r.second, phys, 0});
    s = Step("set_access");
    if (s.ok()) s = backend_->SetAccess(base_ + r.first, r.second, true);
    if (!s.ok()) break;
  }
  if (s.ok()) {
    maps_.insert(maps_.end(), done.begin(), done.end());
    std::sort(maps_.begin(), maps_.end(), [](const Mapping& a, const Mapping& b) { return a.offset < b.offset; });
    *newly = total;
    SyncProtection();
    return Status::Ok();
  }
  // Roll back in reverse. The grant covered `total`; each Phys returns its own size when released,
  // so first give back what was never turned into a Phys.
  uint64_t materialized = 0;
  for (auto& m : done) materialized += m.size;
  if (pending) materialized += pending->size;
  if (governor_) governor_->Return(total - materialized);
  if (pending) {  // created but never mapped
    pending->mappings = 1;
    DropPhys(pending);
  }
  bool stuck = false;
  for (auto it = done.rbegin(); it != done.rend(); ++it) {
    bool unmapped = false;
    if (!UnmapOne(*it, &unmapped).ok()) {
      maps_.push_back(*it);  // recorded as still mapped (and billed), never as freed
      stuck = true;
    }
  }
  if (stuck) {
    std::sort(maps_.begin(), maps_.end(), [](const Mapping& a, const Mapping& b) { return a.offset < b.offset; });
    SyncProtection();
  }
  return Status(s.code(), who + " of [" + std::to_string(offset) + ", " + std::to_string(offset + nbytes) +
                              ") failed and was rolled back" + (stuck ? " (an unmap failed: that run stays mapped)" : "") +
                              ": " + s.message());
}

Status Arena::ReleaseLocked() {
  Status first_error;
  std::vector<Mapping> kept;
  for (auto it = maps_.rbegin(); it != maps_.rend(); ++it) {
    bool unmapped = false;
    Status s = UnmapOne(*it, &unmapped);
    if (!s.ok()) {
      kept.push_back(*it);
      if (first_error.ok()) first_error = s;
    }
  }
  std::reverse(kept.begin(), kept.end());
  maps_ = std::move(kept);
  SyncProtection();
  return first_error;
}

Status Arena::Release() {
  std::lock_guard<std::mutex> lock(Mu());
  if (closed_) return Status(Code::kInvalidArgument, "Arena.release: the arena is closed; create a new Arena");
  CoreLease lease(true);  // no kernel between its check and its write (Note [Arena lease])
  Status s = Step("synchronize");
  if (s.ok()) s = backend_->Synchronize();
  if (!s.ok()) return Status(s.code(), "Arena.release: device synchronization failed, nothing was unmapped: " + s.message());
  return ReleaseLocked();
}

Status Arena::Close(bool* quarantined) {
  std::lock_guard<std::mutex> lock(Mu());
  *quarantined = false;
  if (closed_) return Status::Ok();
  CoreLease lease(true);  // no kernel between its check and its write (Note [Arena lease])
  Status s = Step("synchronize");
  if (s.ok()) s = backend_->Synchronize();
  if (!s.ok()) {
    // Work may still touch the range: keep range and handles forever (Note [Arena transactions]).
    closed_ = quarantined_ = true;
    *quarantined = true;
    if (governor_) {
      uint64_t held = 0;
      for (const Mapping& m : maps_) held += m.size;
      if (!read_only_) governor_->Quarantine(held);
    }
    return Status(s.code(), "Arena.close: device synchronization failed; the arena's " + Bytes(reserved_) +
                                " range and its handles are quarantined (leaked on purpose): " + s.message());
  }
  Status r = ReleaseLocked();
  if (!r.ok()) return r;  // some runs are still mapped: keep the range, stay open
  Status f = Step("free");
  if (f.ok()) f = backend_->Free(base_, reserved_);
  closed_ = true;
  ClearProtection();
  return f;
}

Status Arena::MapSharedPrefix(uint64_t nbytes, std::unique_ptr<Arena>* out) {
  std::lock_guard<std::mutex> lock(Mu());
  if (closed_ || read_only_)
    return Status(Code::kInvalidArgument, std::string("map_shared_prefix: only an open owner arena can share its prefix; "
                                          "this one is ") + (closed_ ? "closed" : "a read-only shared prefix"));
  if (nbytes == 0 || nbytes > reserved_)
    return Status(Code::kInvalidArgument, "map_shared_prefix: nbytes must be in [1, " + std::to_string(reserved_) + "]");
  const uint64_t n = RoundUp(nbytes, granule_);
  // Every granule of [0, n) must be committed.
  uint64_t cur = 0;
  for (const Mapping& m : maps_) {
    if (m.offset > cur || cur >= n) break;
    cur = m.offset + m.size;
  }
  if (cur < n) {
    return Status(Code::kInvalidArgument, "map_shared_prefix: the prefix [0, " + std::to_string(n) +
                                              ") is not fully committed (committed up to " + std::to_string(cur) +
                                              "); commit it in the owner first");
  }
  std::unique_ptr<Arena> sharer(new Arena(backend_, nullptr));
  sharer->granule_ = granule_;
  sharer->reserved_ = n;
  sharer->read_only_ = true;
  sharer->faults_.swap(faults_);  // injected faults apply to the whole operation
  sharer->closed_ = true;  // until the range exists (Note [Arena teardown]: we hold the lock)
  Status reserved = backend_->Reserve(n, &sharer->base_);
  if (!reserved.ok()) {
    faults_.swap(sharer->faults_);
    return ReservationRefused("map_shared_prefix", n, granule_, reserved);
  }
  sharer->closed_ = false;
  Status s;
  for (const Mapping& m : maps_) {
    if (m.offset >= n) break;
    const uint64_t size = std::min(m.offset + m.size, n) - m.offset;
    s = sharer->Step("map");
    if (s.ok()) s = backend_->Map(sharer->base_ + m.offset, size, m.phys->handle, m.phys_offset);
    if (!s.ok()) break;
    Mapping mine{m.offset, size, m.phys, m.phys_offset};
    m.phys->mappings++;
    g_live_mappings[backend_->device_type() == ORTKV_DEVICE_CUDA]++;
    s = sharer->Step("set_access");
    if (s.ok()) s = backend_->SetAccess(sharer->base_ + m.offset, size, false);
    if (!s.ok()) {
      bool unmapped = false;  // undo this mapping alone; the owner's handles stay
      if (!sharer->UnmapOne(mine, &unmapped).ok()) sharer->maps_.push_back(mine);
      break;
    }
    sharer->maps_.push_back(mine);
  }
  faults_.swap(sharer->faults_);
  if (!s.ok()) {
    Status r = sharer->ReleaseLocked();
    if (r.ok() && sharer->maps_.empty()) backend_->Free(sharer->base_, sharer->reserved_);
    sharer->closed_ = true;
    sharer->ClearProtection();
    return Status(s.code(), "map_shared_prefix failed and was undone: " + s.message());
  }
  sharer->SyncProtection();
  *out = std::move(sharer);
  return Status::Ok();
}

}  // namespace vmm
}  // namespace ortkv
