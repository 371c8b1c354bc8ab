// Registry of the library's ops: each op file defines its OrtCustomOp objects and lists them here.
#pragma once
#include <vector>

#include "onnxruntime_c_api.h"

namespace ortkv_ort {

// CacheUpdate for the CPU EP, and for the CUDA EP in CUDA builds.
void AppendCacheUpdateOps(std::vector<const OrtCustomOp*>* ops);
// CacheAttention for the CPU EP (its CUDA kernel belongs to a later issue).
void AppendCacheAttentionOps(std::vector<const OrtCustomOp*>* ops);
// PagedCacheUpdate and PagedCacheAttention for the CPU EP, and the CUDA EP in CUDA builds (paged_ops.cc).
void AppendPagedOps(std::vector<const OrtCustomOp*>* ops);
// MatMulQ4 (Q4_1 weights kept exactly) for the CPU EP (matmul_q4_op.cc).
void AppendMatMulQ4Ops(std::vector<const OrtCustomOp*>* ops);
// Linear (Y = X W^T) for the CPU EP, and the CUDA EP in CUDA builds (linear_op.cc).
void AppendLinearOps(std::vector<const OrtCustomOp*>* ops);

// RotaryCacheUpdate and SwiGLU for the CPU EP, and the CUDA EP in CUDA builds (rotary_cache_update_op.cc).
void AppendFusedOps(std::vector<const OrtCustomOp*>* ops);

inline std::vector<const OrtCustomOp*> AllOps() {
  std::vector<const OrtCustomOp*> ops;
  AppendCacheUpdateOps(&ops);
  AppendCacheAttentionOps(&ops);
  AppendPagedOps(&ops);
  AppendFusedOps(&ops);
  AppendMatMulQ4Ops(&ops);
  AppendLinearOps(&ops);
  return ops;
}

}  // namespace ortkv_ort
