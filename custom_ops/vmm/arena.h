// Arena: one reserved virtual range whose granules are committed on demand; the base never moves.
//
// Note [Arena transactions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Commit(nbytes, offset) backs every granule overlapping [offset, offset + nbytes) that is not
// backed yet. It is a transaction:
//   1. grant   : the Governor grants the missing bytes (or refuses: E_CAPACITY with the numbers);
//   2. for each missing run of granules: create (physical memory), map (at base + run offset),
//      set access (read-write);
//   3. on any failure, everything THIS call mapped is unmapped in reverse order, its handles are
//      released and the grant is returned, so committed bytes, budget in use and live mappings are
//      exactly as before. If an unmap itself fails, that run stays recorded as mapped (and billed):
//      never as freed, because memory that may still be mapped must not be handed out again.
// Sharing: MapSharedPrefix maps the owner's physical handles again, read-only, at a new range. A
// physical allocation counts its live mappings (owner and sharers); it is released, and its bytes
// returned to the governor, when the last one goes. Sharers are billed nothing.
// Teardown: Close synchronizes the device before unmapping. If that fails, work may still be reading
// or writing the range, so the arena deliberately leaks: range and handles are kept, counted as
// quarantined (neither free nor reusable), and the caller is told once.
// The arena keeps ortkv_core's write-protected ranges in step: a sharer's whole range is READONLY,
// an owner's uncommitted granules are UNCOMMITTED, so an ortkv kernel refuses to write there before
// launching (a store into an unmapped or read-only page would kill the process or the context).
// Release and Close hold the kernels' lease exclusively while they synchronize, unmap and update
// those ranges, so no kernel sits between its check and its write meanwhile (Note [Arena lease] in
// ortkv/core.h). A reservation the backend refuses is E_CAPACITY with the numbers, and a failed
// Create or MapSharedPrefix never closes from its destructor under the held lock (Note [Arena
// teardown] in arena.cc). Python refuses close/release while views or bindings exist (Note [Arena
// exports] in python/ortkv/vmm.py).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend.h"

namespace ortkv {
namespace vmm {

class ORTKV_VMM_API Governor {
 public:
  explicit Governor(uint64_t budget) : budget_(budget) {}
  // E_CAPACITY "... requested=R budget=B in_use=U ..." when R does not fit.
  Status Grant(uint64_t bytes, const std::string& who);
  void Return(uint64_t bytes);
  void Quarantine(uint64_t bytes);  // granted bytes that will never come back
  uint64_t budget() const;
  uint64_t in_use() const;
  uint64_t quarantined() const;

 private:
  mutable std::mutex mu_;
  uint64_t budget_;
  uint64_t in_use_ = 0;
  uint64_t quarantined_ = 0;
};

struct Phys;  // a physical allocation, possibly mapped by several arenas

struct Mapping {
  uint64_t offset = 0;  // in the arena, granule aligned
  uint64_t size = 0;
  std::shared_ptr<Phys> phys;
  uint64_t phys_offset = 0;
};

class ORTKV_VMM_API Arena {
 public:
  static Status Create(std::shared_ptr<Backend> backend, uint64_t reserve_bytes, std::shared_ptr<Governor> governor,
                       std::unique_ptr<Arena>* out);
  ~Arena();

  Status Commit(uint64_t nbytes, uint64_t offset, uint64_t* newly_committed);
  // Several [offset, offset + nbytes) ranges in ONE transaction (one grant, all or nothing): what a
  // decode step needs across every layer's K and V.
  Status CommitRanges(const std::vector<std::pair<uint64_t, uint64_t>>& ranges, uint64_t* newly_committed);
  Status Release();
  Status Close(bool* quarantined);
  Status MapSharedPrefix(uint64_t nbytes, std::unique_ptr<Arena>* out);

  uintptr_t base() const { return base_; }
  uint64_t granule() const { return granule_; }
  uint64_t reserved_bytes() const { return reserved_; }
  uint64_t committed_bytes() const;  // bytes mapped in this arena
  uint64_t billed_bytes() const;     // bytes this arena's grants hold (0 for a sharer)
  bool read_only() const { return read_only_; }
  bool closed() const { return closed_; }
  bool quarantined() const { return quarantined_; }
  size_t live_mappings() const;
  bool IsCommitted(uint64_t offset, uint64_t nbytes) const;
  const Backend& backend() const { return *backend_; }
  // Test hook: make the `countdown`-th next call (0 = the next) of `op` fail, once. Several faults
  // may be armed at a time. ops: grant, create, map, set_access, unmap, release, synchronize, free.
  // Reachable from Python only through the private ortkv._ortkv._testing module.
  void InjectFault(const std::string& op, int64_t countdown);

  // Process-wide count of live mappings made by arenas, per backend kind (0 cpu, 1 cuda).
  static uint64_t TotalLiveMappings(int device_type);

 private:
  Arena(std::shared_ptr<Backend> backend, std::shared_ptr<Governor> governor) : backend_(std::move(backend)),
                                                                                 governor_(std::move(governor)) {}
  Status Step(const char* op);
  Status UnmapOne(const Mapping& m, bool* unmapped);
  void DropPhys(const std::shared_ptr<Phys>& phys);
  void SyncProtection();
  void ClearProtection();
  Status ReleaseLocked();

  std::shared_ptr<Backend> backend_;
  std::shared_ptr<Governor> governor_;
  uintptr_t base_ = 0;
  uint64_t granule_ = 0;
  uint64_t reserved_ = 0;
  bool read_only_ = false;
  bool closed_ = false;
  bool quarantined_ = false;
  std::vector<Mapping> maps_;  // sorted by offset, disjoint
  std::vector<int64_t> protection_ids_;
  std::vector<std::pair<std::string, int64_t>> faults_;  // (op, countdown)
};

}  // namespace vmm
}  // namespace ortkv
