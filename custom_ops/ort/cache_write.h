// What the ops that write a dense cache in place share (CacheUpdate, RotaryCacheUpdate; defined in
// cache_update_op.cc): the alias pointer check of Note [Aliasing CacheUpdate output], the host-side
// write-protection check (Note [Write-protection check]) and the protected ranges a CUDA kernel checks on
// the device (Note [CUDA deferred errors]). `op` names the op in every message.
#pragma once
#include <string>

#include "ort_util.h"
#include "ortkv/cache_update.h"

namespace ortkv_ort {

// An E_ALIAS error naming the output, the input and the remedy when the output's storage is not the
// input's; nullptr when it is.
OrtStatus* CheckCacheAlias(const char* op, const std::string& node, const std::string& out_name,
                           const std::string& in_name, const void* out_data, const void* in_data);

// CPU: refuses (E_READONLY / E_UNCOMMITTED) a write of `v` into a protected range, before any store.
ortkv::Status CheckCacheWriteProtection(const char* op, const std::string& node, const std::string& cache_name,
                                        const ortkv::CacheUpdateView& v, int device_type, int device_id);

// CUDA: the protected ranges overlapping the whole cache of `v`, for the kernel to check on the device.
ortkv::Status CollectCacheDeviceRanges(const char* op, const std::string& node, const std::string& cache_name,
                                       const ortkv::CacheUpdateView& v, int device_id, ortkv::DeviceRangeCheck* out);

}  // namespace ortkv_ort
