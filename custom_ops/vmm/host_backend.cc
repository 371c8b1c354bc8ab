// Host twin of CUDA VMM (shared/facts/VMM.md): a memfd is the physical handle, an mmap(PROT_NONE)
// reservation the address range, MAP_FIXED | MAP_SHARED maps of the memfd the mappings and mprotect
// the access. Unmapping maps PROT_NONE anonymous memory back over the range, so it stays reserved.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
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

class HostBackend final : public Backend {
 public:
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
    int fd = memfd_create("ortkv-vmm", MFD_CLOEXEC);
    if (fd < 0) return Errno("memfd_create", size);
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
      Status s = Errno("ftruncate(memfd)", size);
      close(fd);
      return s;
    }
    // Back the pages now, so a commit that succeeds cannot fault later (SIGBUS on a full tmpfs).
    int rc = fallocate(fd, 0, 0, static_cast<off_t>(size));
    if (rc != 0 && errno != EOPNOTSUPP) {
      Status s = Errno("fallocate(memfd)", size);
      close(fd);
      return s;
    }
    *handle = static_cast<uint64_t>(fd);
    return Status::Ok();
  }
  Status Release(uint64_t handle) override {
    if (close(static_cast<int>(handle)) != 0) return Errno("close(memfd)", 0);
    return Status::Ok();
  }
  Status Map(uintptr_t addr, uint64_t size, uint64_t handle, uint64_t offset) override {
    void* p = mmap(reinterpret_cast<void*>(addr), size, PROT_NONE, MAP_FIXED | MAP_SHARED, static_cast<int>(handle),
                   static_cast<off_t>(offset));
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
};

}  // namespace

std::shared_ptr<Backend> MakeHostBackend() { return std::make_shared<HostBackend>(); }

}  // namespace vmm
}  // namespace ortkv
