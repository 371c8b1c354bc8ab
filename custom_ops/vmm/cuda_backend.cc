// CUDA driver VMM backend. Every cuMem* symbol comes from ONE table resolved at run time with
// dlopen("libcuda.so.1"), so the library loads on machines with no NVIDIA driver; only creating a
// CUDA arena fails there, with a Status that says why. The table is process-global (it lives in
// libortkv_core.so, see Note [One core per process]). All calls run in the device's primary context,
// the one ONNX Runtime, PyTorch and CuPy use, so pointers from an arena are valid for all of them.
#include "backend.h"

#if defined(ORTKV_CORE_HAS_CUDA_H)
#include <cuda.h>
#include <dlfcn.h>

#include <mutex>
#include <sstream>

#include "ortkv/core.h"

namespace ortkv {
namespace vmm {
namespace {

struct DriverTable {
  bool ok = false;
  std::string why;
#define ORTKV_CU_FN(name) decltype(&::name) name = nullptr;
  ORTKV_CU_FN(cuInit)
  ORTKV_CU_FN(cuDeviceGetCount)
  ORTKV_CU_FN(cuDeviceGet)
  ORTKV_CU_FN(cuDevicePrimaryCtxRetain)
  ORTKV_CU_FN(cuCtxSetCurrent)
  ORTKV_CU_FN(cuCtxSynchronize)
  ORTKV_CU_FN(cuMemGetAllocationGranularity)
  ORTKV_CU_FN(cuMemAddressReserve)
  ORTKV_CU_FN(cuMemAddressFree)
  ORTKV_CU_FN(cuMemCreate)
  ORTKV_CU_FN(cuMemRelease)
  ORTKV_CU_FN(cuMemMap)
  ORTKV_CU_FN(cuMemUnmap)
  ORTKV_CU_FN(cuMemSetAccess)
  ORTKV_CU_FN(cuGetErrorName)
  ORTKV_CU_FN(cuGetErrorString)
#undef ORTKV_CU_FN
};

const DriverTable& Driver() {
  static DriverTable table;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      table.why = std::string("libcuda.so.1 (the NVIDIA driver) is not loadable: ") + dlerror();
      return;
    }
#define ORTKV_CU_LOAD(name)                                                        \
  table.name = reinterpret_cast<decltype(table.name)>(dlsym(lib, #name));         \
  if (table.name == nullptr) {                                                     \
    table.why = "the CUDA driver has no symbol " #name " (driver too old for VMM)"; \
    return;                                                                        \
  }
    ORTKV_CU_LOAD(cuInit)
    ORTKV_CU_LOAD(cuDeviceGetCount)
    ORTKV_CU_LOAD(cuDeviceGet)
    ORTKV_CU_LOAD(cuDevicePrimaryCtxRetain)
    ORTKV_CU_LOAD(cuCtxSetCurrent)
    ORTKV_CU_LOAD(cuCtxSynchronize)
    ORTKV_CU_LOAD(cuMemGetAllocationGranularity)
    ORTKV_CU_LOAD(cuMemAddressReserve)
    ORTKV_CU_LOAD(cuMemAddressFree)
    ORTKV_CU_LOAD(cuMemCreate)
    ORTKV_CU_LOAD(cuMemRelease)
    ORTKV_CU_LOAD(cuMemMap)
    ORTKV_CU_LOAD(cuMemUnmap)
    ORTKV_CU_LOAD(cuMemSetAccess)
    ORTKV_CU_LOAD(cuGetErrorName)
    ORTKV_CU_LOAD(cuGetErrorString)
#undef ORTKV_CU_LOAD
    CUresult rc = table.cuInit(0);
    if (rc != CUDA_SUCCESS) {
      table.why = "cuInit failed with error " + std::to_string(static_cast<int>(rc));
      return;
    }
    table.ok = true;
  });
  return table;
}

Status Cu(CUresult rc, const char* what, uint64_t size) {
  if (rc == CUDA_SUCCESS) return Status::Ok();
  const char* name = nullptr;
  const char* text = nullptr;
  Driver().cuGetErrorName(rc, &name);
  Driver().cuGetErrorString(rc, &text);
  std::ostringstream m;
  m << "CUDA VMM: " << what << " of " << size << " bytes failed: " << (name ? name : "?") << " ("
    << (text ? text : "?") << ")";
  return Status(rc == CUDA_ERROR_OUT_OF_MEMORY ? Code::kCapacity : Code::kRuntime, m.str());
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, CUdevice dev, CUcontext ctx) : device_(device), dev_(dev), ctx_(ctx) {
    name_ = "cuda:" + std::to_string(device);
  }
  const char* name() const override { return name_.c_str(); }
  int device_type() const override { return ORTKV_DEVICE_CUDA; }
  int device_id() const override { return device_; }

  Status Granularity(uint64_t* out) override {
    ORTKV_RETURN_IF_ERR(Bind());
    CUmemAllocationProp prop = Prop();
    size_t g = 0;
    ORTKV_RETURN_IF_ERR(Cu(Driver().cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                           "cuMemGetAllocationGranularity", 0));
    *out = g;
    return Status::Ok();
  }
  Status Reserve(uint64_t size, uintptr_t* base) override {
    ORTKV_RETURN_IF_ERR(Bind());
    CUdeviceptr p = 0;
    ORTKV_RETURN_IF_ERR(Cu(Driver().cuMemAddressReserve(&p, size, 0, 0, 0), "cuMemAddressReserve", size));
    *base = static_cast<uintptr_t>(p);
    return Status::Ok();
  }
  Status Free(uintptr_t base, uint64_t size) override {
    ORTKV_RETURN_IF_ERR(Bind());
    return Cu(Driver().cuMemAddressFree(static_cast<CUdeviceptr>(base), size), "cuMemAddressFree", size);
  }
  Status Create(uint64_t size, uint64_t* handle) override {
    ORTKV_RETURN_IF_ERR(Bind());
    CUmemAllocationProp prop = Prop();
    CUmemGenericAllocationHandle h = 0;
    ORTKV_RETURN_IF_ERR(Cu(Driver().cuMemCreate(&h, size, &prop, 0), "cuMemCreate", size));
    *handle = static_cast<uint64_t>(h);
    return Status::Ok();
  }
  Status Release(uint64_t handle) override {
    ORTKV_RETURN_IF_ERR(Bind());
    return Cu(Driver().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(handle)), "cuMemRelease", 0);
  }
  Status Map(uintptr_t addr, uint64_t size, uint64_t handle, uint64_t offset) override {
    ORTKV_RETURN_IF_ERR(Bind());
    return Cu(Driver().cuMemMap(static_cast<CUdeviceptr>(addr), size, offset,
                                static_cast<CUmemGenericAllocationHandle>(handle), 0),
              "cuMemMap", size);
  }
  Status SetAccess(uintptr_t addr, uint64_t size, bool writable) override {
    ORTKV_RETURN_IF_ERR(Bind());
    CUmemAccessDesc desc = {};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = dev_;
    desc.flags = writable ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ;
    return Cu(Driver().cuMemSetAccess(static_cast<CUdeviceptr>(addr), size, &desc, 1), "cuMemSetAccess", size);
  }
  Status Unmap(uintptr_t addr, uint64_t size) override {
    ORTKV_RETURN_IF_ERR(Bind());
    return Cu(Driver().cuMemUnmap(static_cast<CUdeviceptr>(addr), size), "cuMemUnmap", size);
  }
  bool SupportsPartialMap() const override { return false; }
  Status Synchronize() override {
    ORTKV_RETURN_IF_ERR(Bind());
    return Cu(Driver().cuCtxSynchronize(), "cuCtxSynchronize", 0);
  }

 private:
  Status Bind() { return Cu(Driver().cuCtxSetCurrent(ctx_), "cuCtxSetCurrent", 0); }
  CUmemAllocationProp Prop() const {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev_;
    return prop;
  }
  int device_;
  CUdevice dev_;
  CUcontext ctx_;
  std::string name_;
};

}  // namespace

bool CudaDriverAvailable(std::string* why) {
  const DriverTable& d = Driver();
  if (!d.ok) {
    if (why) *why = d.why;
    return false;
  }
  int count = 0;
  if (d.cuDeviceGetCount(&count) != CUDA_SUCCESS || count == 0) {
    if (why) *why = "the CUDA driver reports no device";
    return false;
  }
  return true;
}

Status MakeCudaBackend(int device, std::shared_ptr<Backend>* out) {
  std::string why;
  if (!CudaDriverAvailable(&why)) return Status(Code::kRuntime, "no CUDA VMM backend: " + why);
  const DriverTable& d = Driver();
  int count = 0;
  d.cuDeviceGetCount(&count);
  if (device < 0 || device >= count) {
    return Status(Code::kInvalidArgument,
                  "cuda:" + std::to_string(device) + " does not exist (" + std::to_string(count) + " device(s))");
  }
  CUdevice dev = 0;
  ORTKV_RETURN_IF_ERR(Cu(d.cuDeviceGet(&dev, device), "cuDeviceGet", 0));
  CUcontext ctx = nullptr;
  ORTKV_RETURN_IF_ERR(Cu(d.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain", 0));
  *out = std::make_shared<CudaBackend>(device, dev, ctx);
  return Status::Ok();
}

}  // namespace vmm
}  // namespace ortkv

#else  // no cuda.h at build time

namespace ortkv {
namespace vmm {
bool CudaDriverAvailable(std::string* why) {
  if (why) *why = "this build of ortkv has no CUDA support (built without the CUDA toolkit)";
  return false;
}
Status MakeCudaBackend(int, std::shared_ptr<Backend>*) {
  return Status(Code::kRuntime, "no CUDA VMM backend: this build of ortkv has no CUDA support");
}
}  // namespace vmm
}  // namespace ortkv

#endif
