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

// Note [Arena lease]
// ~~~~~~~~~~~~~~~~~~
// A protected-range lookup is only a snapshot: without more, an arena's release() or close() could
// unmap the range between a kernel's check and its store (SIGSEGV on the host, an illegal address
// on CUDA). So the check and the write form one critical section under a process-wide
// reader-writer lease: a kernel takes it SHARED around "check protected ranges, then write or
// launch" (kernels never wait for each other: one uncontended atomic on the hot path), and
// Arena::Release / Arena::Close take it EXCLUSIVE around "synchronize, unmap, update the
// protected ranges, free". Hence a kernel either finishes its check and its launch before the
// unmap starts (and the device synchronization inside Release/Close then waits for a CUDA launch to
// complete), or it starts after the protected ranges were updated and refuses with E_UNCOMMITTED.
// The lease is global, not per arena: unmaps are rare next to kernel launches, and a kernel then
// needs no lookup to find its arena. Lock order: the arena lock, then the lease, then the
// protected-range registry; a lease holder never takes the arena lock.
ORTKV_CORE_API void ortkv_core_lease_acquire(int exclusive);
ORTKV_CORE_API void ortkv_core_lease_release(int exclusive);

#ifdef __cplusplus
namespace ortkv {
// RAII form of the lease (Note [Arena lease]): `CoreLease lease;` in a kernel, `CoreLease lease(true);`
// around an unmap.
class CoreLease {
 public:
  explicit CoreLease(bool exclusive = false) : exclusive_(exclusive) { ortkv_core_lease_acquire(exclusive_ ? 1 : 0); }
  ~CoreLease() { ortkv_core_lease_release(exclusive_ ? 1 : 0); }
  CoreLease(const CoreLease&) = delete;
  CoreLease& operator=(const CoreLease&) = delete;

 private:
  bool exclusive_;
};
}  // namespace ortkv
#endif

// Note [CUDA deferred errors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The CUDA kernels of CacheUpdate and CacheAttention read `position` / `start` from device memory so
// that a decode step can be captured as a CUDA graph: no host copy, no host sync, no allocation
// inside the step. The checks that need those values (position >= 0, position + n <= capacity, the
// write-protected and uncommitted ranges) therefore run on the device, in every block BEFORE any
// store: a block that finds any bad row writes nothing (CacheUpdate) or clamps (CacheAttention
// never reads outside [0, capacity)). The report cannot be a return status (the kernel finishes after
// Compute returned, or in a later graph replay), so it goes into ONE process-wide error word in
// mapped, portable page-locked host memory, allocated by the op library at its first CUDA
// launch (Note [CUDA error word lifetime] in kernels/cuda/device.cu) and registered here: two words, [0] for CacheUpdate and [1] for CacheAttention. One thread
// per launch reports (block 0's thread 0, which scans the rows for the first bad one): it writes the
// numbers, fences (__threadfence_system) and then sets `code`. The device never reads the word: reads
// of mapped host memory may be served from a stale device-side copy after the host cleared it (seen
// on the H200: only the first report of a process arrived when the kernel skipped a set word), and
// atomics on it are not supported over PCIe. So a later report of the same op overwrites an earlier
// one not taken yet (e.g. the value cache's update after the key cache's, same row); the host takes
// the CacheUpdate word first (a refused write is the cause; CacheAttention's clamp of the same row is
// its consequence) and clears both. The host turns it into the usual
// error message (the same text and tag as the CPU check, plus where it was found) in two places:
//   * the next Compute of any ortkv CUDA op (an ORT-only application sees the error on its next run);
//     when a code is set there, that Compute first waits for its stream (Note [Settled reports]),
//   * ortkv.MutableCacheSession after every run (ORT synchronizes the stream at the end of a run, so
//     the word is final there): the run that failed raises.
// Cost: one host read of pinned memory per Compute and per session run; no synchronization unless a
// report is there. What it does not give: the failing run itself does not fail when run through a bare
// InferenceSession (use ortkv.take_cuda_error() after the run, or MutableCacheSession). Only the first
// error is kept until it is taken; sessions running concurrently on other streams share the word (best
// effort: two reports at the same instant may mix their numbers).
enum { ORTKV_DERR_NONE = 0, ORTKV_DERR_NEGATIVE = 1, ORTKV_DERR_CAPACITY = 2, ORTKV_DERR_READONLY = 3,
       ORTKV_DERR_UNCOMMITTED = 4,
       // the paged ops only (fields: Note [Paged CUDA] in ortkv/paged_cuda.h)
       ORTKV_DERR_PAGE = 5, ORTKV_DERR_SHARED_ROW = 6, ORTKV_DERR_ENCODE = 7 };
typedef struct ortkv_device_error {
  int32_t claim;      // reserved (0)
  int32_t code;       // ORTKV_DERR_*, written last (after a system fence); 0 while nothing is reported
  int32_t label;      // ortkv_core_register_label id: op, node and tensor names
  int32_t row;        // the batch row
  int64_t position;   // the row's position / start
  int64_t n;          // tokens written / query tokens
  int64_t capacity;   // the cache's capacity
  uint64_t hit_addr;  // READONLY / UNCOMMITTED: first address of the protected range hit
  uint64_t first;     // READONLY / UNCOMMITTED: the write's first address
  uint64_t last;      // ... and one past its last
} ortkv_device_error;
// Note [Settled reports]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A Compute runs on the host while the kernels launched before it on its stream may still run. Taking
// the word then raced with a second report of the same step (seen on an H100 in the full CUDA test run:
// CacheUpdate's key and value kernels both refused row 17; a later node's Compute took the key's report
// and cleared the word while the value kernel's thread was between its numbers and its code, so the
// word was left holding code NEGATIVE over zeroed numbers: "position 0 for row 0 of 'cache' is
// negative", label 0, raised by the next, unrelated take). So a Compute that finds a code set
// (ortkv_core_device_error_pending: one read per pair, the only cost when nothing is wrong)
// synchronizes its stream before it takes the word: every kernel launched before it on that stream has
// finished, and the report it takes is final. Only the error path waits; a stream being captured into a
// CUDA graph is not synchronized (not allowed there, and no kernel of the capture runs). Sessions on
// other streams can still race (see above: best effort).
// Note [Reports taken by their codes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A take clears the two words' codes and nothing else. It used to zero the numbers as well, and that
// is what made the report above garbage: a kernel whose numbers landed before the clear and whose code
// landed after it left a code over zeros. Every writer writes all the fields its code's message reads
// before it sets the code (WriteReport writes them all; the dense kernels' NEGATIVE / CAPACITY reports
// write label, row, position, n and capacity, the only fields those messages read), so a code set
// after a clear always sits over its own kernel's numbers. This holds wherever no stream is settled
// first: ortkv.take_cuda_error() after a FAILED run (ORT did not reach the end of the run, where it
// synchronizes, so that run's kernels may still write), and sessions on other streams. What is still
// best effort: two reports landing between a take's read of the code and of the numbers may give
// one's code with the other's numbers (both real reports of that step).
// Nonzero when some error word holds a report (a code is set); reads the codes only, clears nothing.
ORTKV_CORE_API int ortkv_core_device_error_pending(void);
// Adds a pair of error words ([0] CacheUpdate, [1] CacheAttention; one pair per CUDA context); `host`
// must stay valid for the process lifetime. At most 1024 pairs.
ORTKV_CORE_API void ortkv_core_add_device_error(ortkv_device_error* host);
// The first pair added, or NULL when none was (no CUDA launch yet).
ORTKV_CORE_API ortkv_device_error* ortkv_core_device_error(void);
// op: "CacheUpdate" / "CacheAttention" / "PagedCacheUpdate" / "PagedCacheAttention"; node: the node name;
// tensor: the cache input's name (the paged ops: "pool\ndirectory\npage_table" names). Returns
// an id for ortkv_device_error.label (equal strings give equal ids).
ORTKV_CORE_API int32_t ortkv_core_register_label(const char* op, const char* node, const char* tensor);
// If an error was reported: formats "[ortkv:E_...] message" into msg (at most cap - 1 characters and a
// zero), clears the word and returns its ORTKV_DERR_* code; else returns 0.
ORTKV_CORE_API int ortkv_core_take_device_error(char* msg, size_t cap);
