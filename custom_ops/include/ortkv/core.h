// ortkv_core: the process-global state shared by the op library (loaded by ONNX Runtime) and the
// Python extension (loaded by Python).
//
// Note [One core per process]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ORT dlopens libortkv.so (register_custom_ops_library) and Python imports _ortkv; both must see
// the same registries (today the write-protected ranges, later the VMM arenas and the CUDA driver
// symbol table). Two options were open: one object that is both the op library and the extension,
// or a third shared object that both link. We chose the third object, libortkv_core.so, because
//   * the op library must export only RegisterCustomOps, while an extension must export PyInit_*;
//   * the op library must load in a process with no Python (a C++ ORT application);
//   * the dynamic loader maps a shared object once per process whatever the number of dependants
//     (same path, same SONAME), so the state exists exactly once. Both dependants find it through
//     RPATH=$ORIGIN in the installed package folder.
// The core's interface is plain C so that it is stable across compilers and free of any framework.
#pragma once
#include <stddef.h>
#include <stdint.h>

#if defined(ORTKV_CORE_BUILD)
#define ORTKV_CORE_API extern "C" __attribute__((visibility("default")))
#else
#define ORTKV_CORE_API extern "C"
#endif

enum { ORTKV_DEVICE_CPU = 0, ORTKV_DEVICE_CUDA = 1 };
// Why a range must not be written: a read-only mapping (a shared prefix), or reserved address space
// with no memory behind it yet (an arena's uncommitted granules).
enum { ORTKV_RANGE_READONLY = 1, ORTKV_RANGE_UNCOMMITTED = 2 };

// Marks [addr, addr + nbytes) on (device_type, device_id) as never to be written by an ortkv
// kernel. Returns an id > 0, or -1 if nbytes == 0.
ORTKV_CORE_API int64_t ortkv_core_protect_range(int32_t device_type, int32_t device_id, uintptr_t addr,
                                                uint64_t nbytes, const char* label, int32_t kind);
// Removes a range; returns 1 if it existed, 0 otherwise.
ORTKV_CORE_API int ortkv_core_unprotect_range(int64_t id);
// Returns the kind (> 0) of the first protected range of a kind in kind_mask (bit 1 << kind; 0 = any)
// overlapping [addr, addr + nbytes) and fills its bounds and label, or 0 when there is none.
// label_out (may be NULL) receives at most label_cap - 1 characters and a terminating zero.
ORTKV_CORE_API int ortkv_core_find_protected(int32_t device_type, int32_t device_id, uintptr_t addr,
                                             uint64_t nbytes, int32_t kind_mask, uintptr_t* hit_addr,
                                             uint64_t* hit_nbytes, char* label_out, size_t label_cap);
ORTKV_CORE_API uint64_t ortkv_core_protected_count(void);
// The address of the registry object: equal in every dependant iff the state exists once.
ORTKV_CORE_API uintptr_t ortkv_core_instance(void);
