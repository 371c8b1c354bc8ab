// Helpers shared by the paged ops' CPU files (not a public header).
#pragma once
#include <cstdint>
#include <string>

#include "ortkv/paged.h"

namespace ortkv {
namespace paged {

Status Bad(const std::string& op, const std::string& node, const std::string& what);
// Element i of a float32 / float16 / bfloat16 tensor as float; n elements from `first`.
float ToFloat(int32_t elem, const void* base, int64_t i);
void LoadRow(int32_t elem, const void* base, int64_t first, int64_t n, float* out);
void StoreRow(int32_t elem, void* base, int64_t first, int64_t n, const float* in);
// The attributes, pool, directory and page table shared by both ops (not the pages themselves: CheckPage).
Status ResolvePool(const std::string& op, const std::string& node, const TensorArg& pool, const TensorArg& directory,
                   const TensorArg& table, const PagedAttrs& a, int64_t batch, int64_t head_size, PagedPool* p);

}  // namespace paged
}  // namespace ortkv
