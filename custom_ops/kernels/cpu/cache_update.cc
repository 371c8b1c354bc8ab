// CPU CacheUpdate: rows * outer contiguous copies (Note [CacheUpdate layout] in ortkv/cache_update.h).
#include <cstring>

#include "ortkv/cache_update.h"

namespace ortkv {

void CacheUpdateCpu(const CacheUpdateView& v, int64_t begin_pair, int64_t end_pair) {
  const size_t run = static_cast<size_t>(v.n * v.token_bytes);
  auto* cache = static_cast<unsigned char*>(v.cache);
  const auto* values = static_cast<const unsigned char*>(v.values);
  if (v.token_major) {  // Note [CacheUpdate SBNH]: pair = (token t, row r)
    for (int64_t pair = begin_pair; pair < end_pair; ++pair) {
      const int64_t r = pair % v.rows, t = pair / v.rows;
      std::memcpy(cache + ((v.position(r) + t) * v.rows + r) * v.token_bytes, values + pair * v.token_bytes,
                  static_cast<size_t>(v.token_bytes));
    }
    return;
  }
  for (int64_t pair = begin_pair; pair < end_pair; ++pair) {
    const int64_t r = pair / v.outer;
    unsigned char* dst = cache + (pair * v.capacity + v.position(r)) * v.token_bytes;
    const unsigned char* src = values + pair * v.n * v.token_bytes;
    std::memcpy(dst, src, run);
  }
}

}  // namespace ortkv
