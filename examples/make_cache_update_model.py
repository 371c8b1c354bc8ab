"""Build model_with_cacheupdate.onnx, the model the README's examples run.

    python examples/make_cache_update_model.py [OUT_DIR]

One node, `updated_cache = ortkv.CacheUpdate(cache, values, position)`, over a BNSH cache
[batch, heads, capacity, head_size] (float32, dims symbolic so any size binds). The cache input is
marked access=READ_WRITE and `updated_cache` is annotated alias_of=cache, which is what
MutableCacheSession reads to bind one buffer as both.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from ortkv.graph import make_cache_update, mark_mutable, set_alias_of


def build() -> onnx.ModelProto:
    dims = ["batch", "heads", "capacity", "head_size"]
    new_dims = ["batch", "heads", "new_tokens", "head_size"]
    node = make_cache_update("cache", "values", "position", "updated_cache", name="cache_update", seq_axis=-2)
    graph = helper.make_graph(
        [node], "cache_update",
        inputs=[helper.make_tensor_value_info("cache", TensorProto.FLOAT, dims),
                helper.make_tensor_value_info("values", TensorProto.FLOAT, new_dims),
                helper.make_tensor_value_info("position", TensorProto.INT64, [])],
        outputs=[helper.make_tensor_value_info("updated_cache", TensorProto.FLOAT, dims)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                              ir_version=10)  # ONNX Runtime 1.31 reads IR <= 13; metadata_props need >= 10
    mark_mutable(model, "cache")
    set_alias_of(model, "updated_cache", "cache")
    onnx.checker.check_model(model)
    return model


def main(argv: list[str]) -> int:
    out_dir = Path(argv[1]) if len(argv) > 1 else Path(".")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model_with_cacheupdate.onnx"
    onnx.save(build(), str(path))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
