// One small interface for reserving address ranges and mapping physical memory into them, with two
// backends: the CUDA driver's virtual memory management (cuMem*) and a host twin built on
// memfd_create + mmap + mprotect. Backends do the raw operation and return a Status; the Arena
// (arena.h) validates, orders the steps, keeps the books and words the errors.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "ortkv/status.h"

// The VMM's C++ interface is shared by libortkv_core.so (which owns it) and the Python extension
// (which links it); these classes and functions are exported from the core, everything else hidden.
#define ORTKV_VMM_API __attribute__((visibility("default")))

namespace ortkv {
namespace vmm {

class ORTKV_VMM_API Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;  // "cpu" or "cuda:N"
  virtual int device_type() const = 0;   // ORTKV_DEVICE_CPU / ORTKV_DEVICE_CUDA
  virtual int device_id() const = 0;
  // Allocation granularity in bytes (queried, never assumed).
  virtual Status Granularity(uint64_t* out) = 0;
  virtual Status Reserve(uint64_t size, uintptr_t* base) = 0;
  virtual Status Free(uintptr_t base, uint64_t size) = 0;
  // Physical memory of `size` bytes; `handle` is opaque to the arena.
  virtual Status Create(uint64_t size, uint64_t* handle) = 0;
  virtual Status Release(uint64_t handle) = 0;
  // Maps [offset, offset + size) of the handle at addr, with no access yet.
  virtual Status Map(uintptr_t addr, uint64_t size, uint64_t handle, uint64_t offset) = 0;
  virtual Status SetAccess(uintptr_t addr, uint64_t size, bool writable) = 0;
  // Unmaps [addr, addr + size); the address range stays reserved.
  virtual Status Unmap(uintptr_t addr, uint64_t size) = 0;
  // Whether Map may take part of a handle (offset > 0 or size < the handle's size). The CUDA driver
  // maps whole handles only, so a CUDA arena creates one handle per granule; then any granule-aligned
  // prefix can be shared.
  virtual bool SupportsPartialMap() const = 0;
  // Waits for all work that may touch mapped memory (CUDA: the context); host: nothing to wait for.
  virtual Status Synchronize() = 0;
};

ORTKV_VMM_API std::shared_ptr<Backend> MakeHostBackend();
// Resolves libcuda.so.1 at run time; fails with a clear Status where there is no driver or device.
ORTKV_VMM_API Status MakeCudaBackend(int device, std::shared_ptr<Backend>* out);
// "cuda driver available and at least one device": for tests and for choosing a default.
ORTKV_VMM_API bool CudaDriverAvailable(std::string* why);

}  // namespace vmm
}  // namespace ortkv
