// Host twin of CUDA VMM (docs/DESIGN_FACTS.md): a memfd is the physical handle, an mmap(PROT_NONE)
// reservation the address range, MAP_FIXED | MAP_SHARED maps of the memfd the mappings and mprotect
// the access. Unmapping maps PROT_NONE anonymous memory back over the range, so it stays reserved.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iterator>
#include <map>
#include <sstream>

#include "backend.h"
#include "ortkv/core.h"

namespace ortkv {
namespace vmm {
namespace {

Status Errno(const char* what, uint64_t size) {
  std::ostringstream m;
  m << "host VMM: " << what << " of " << size << " bytes failed: " << std::strerror(errno) << " (errno " << errno << ")";
  return Status(errno == ENOMEM || errno == ENOSPC ? Code::kCapacity : Code::kRuntime, m.str());
}

// Physical memory is ONE memfd per backend (one backend per arena, shared with its sharers): a handle
// is an offset into it. One file descriptor per arena, however many commits: a cache that grows a
// granule at a time must not run the process out of descriptors, and adjacent mappings of adjacent
// offsets merge into one kernel VMA.
//
// Note [memfd free list]
// ~~~~~~~~~~~~~~~~~~~~~~
// Release punches the handle's range out (its pages go back to the system) and files the range in a
// free list (coalesced with its neighbours); Create takes the first free range that fits before it
// grows the file, and a free range that reaches the end of the file is cut off (ftruncate). So the
// file never holds more than the arena's peak of live handles plus fragmentation, however many
// commit/release cycles run: appending forever would grow it until ftruncate fails. A file range is
// only reused once its handle was released, i.e. once no arena (owner or sharer) maps it any more.
class HostBackend final : public Backend {
 public:
  ~HostBackend() override {
    if (fd_ >= 0) close(fd_);
  }
  const char* name() const override { return "cpu"; }
  int device_type() const override { return ORTKV_DEVICE_CPU; }
  int device_id() const override { return 0; }

  Status Granularity(uint64_t* out) override {
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) return Errno("sysconf(_SC_PAGESIZE)", 0);
    *out = static_cast<uint64_t>(page);
    return Status::Ok();
  }
  Status Reserve(uint64_t size, uintptr_t* base) override {
    void* p = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return Errno("mmap(PROT_NONE) reservation", size);
    *base = reinterpret_cast<uintptr_t>(p);
    return Status::Ok();
  }
  Status Free(uintptr_t base, uint64_t size) override {
    if (munmap(reinterpret_cast<void*>(base), size) != 0) return Errno("munmap of the reservation", size);
    return Status::Ok();
  }
  Status Create(uint64_t size, uint64_t* handle) override {
    if (fd_ < 0) {
      fd_ = memfd_create("ortkv-vmm", MFD_CLOEXEC);
      if (fd_ < 0) return Errno("memfd_create", size);
    }
    auto fit = free_.begin();
    while (fit != free_.end() && fit->second < size) ++fit;
    const bool reuse = fit != free_.end();
    const uint64_t offset = reuse ? fit->first : end_;
    if (!reuse && ftruncate(fd_, static_cast<off_t>(offset + size)) != 0) return Errno("ftruncate(memfd)", size);
    // Back the pages now, so a commit that succeeds cannot fault later (SIGBUS on a full tmpfs).
    if (fallocate(fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(size)) != 0 && errno != EOPNOTSUPP) {
      Status s = Errno("fallocate(memfd)", size);
      if (reuse) {
        fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset), static_cast<off_t>(size));
      } else {
        ftruncate(fd_, static_cast<off_t>(offset));
      }
      return s;
    }
    if (reuse) {
      const uint64_t rest = fit->second - size;
      free_.erase(fit);
      if (rest > 0) free_[offset + size] = rest;
    } else {
      end_ = offset + size;
    }
    sizes_[offset] = size;
    *handle = offset;
    return Status::Ok();
  }
  Status Release(uint64_t handle) override {
    auto it = sizes_.find(handle);
    if (it == sizes_.end()) return Status(Code::kRuntime, "host VMM: release of an unknown handle");
    const uint64_t size = it->second;
    if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(handle),
                  static_cast<off_t>(size)) != 0)
      return Errno("fallocate(PUNCH_HOLE)", size);
    sizes_.erase(it);
    AddFree(handle, size);
    return Status::Ok();
  }
  Status Map(uintptr_t addr, uint64_t size, uint64_t handle, uint64_t offset) override {
    void* p = mmap(reinterpret_cast<void*>(addr), size, PROT_NONE, MAP_FIXED | MAP_SHARED, fd_,
                   static_cast<off_t>(handle + offset));
    if (p == MAP_FAILED) return Errno("mmap(MAP_FIXED | MAP_SHARED)", size);
    return Status::Ok();
  }
  Status SetAccess(uintptr_t addr, uint64_t size, bool writable) override {
    if (mprotect(reinterpret_cast<void*>(addr), size, writable ? PROT_READ | PROT_WRITE : PROT_READ) != 0)
      return Errno("mprotect", size);
    return Status::Ok();
  }
  Status Unmap(uintptr_t addr, uint64_t size) override {
    void* p = mmap(reinterpret_cast<void*>(addr), size, PROT_NONE,
                   MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return Errno("mmap(PROT_NONE) over a mapping", size);
    return Status::Ok();
  }
  bool SupportsPartialMap() const override { return true; }
  Status Synchronize() override { return Status::Ok(); }

 private:
  // Files [offset, offset + size) as free, merged with adjacent free ranges; a free tail is cut off.
  void AddFree(uint64_t offset, uint64_t size) {
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && offset + size == next->first) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        offset = prev->first;
        size += prev->second;
        free_.erase(prev);
      }
    }
    if (offset + size == end_ && ftruncate(fd_, static_cast<off_t>(offset)) == 0) {
      end_ = offset;
      return;
    }
    free_[offset] = size;
  }

  int fd_ = -1;
  uint64_t end_ = 0;                     // file size: the next appended handle's offset
  std::map<uint64_t, uint64_t> sizes_;   // live handle (offset) -> size
  std::map<uint64_t, uint64_t> free_;    // released ranges (offset -> size), coalesced; all below end_
};

}  // namespace

std::shared_ptr<Backend> MakeHostBackend() { return std::make_shared<HostBackend>(); }

}  // namespace vmm
}  // namespace ortkv
