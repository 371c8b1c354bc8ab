"""Shared fixtures: CacheUpdate models, bound runs through plain ORT, GPU detection."""

from __future__ import annotations

import functools
import hashlib

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

import ortkv
from ortkv.graph import make_cache_attention, make_cache_update, mark_mutable, set_alias_of

DTYPES = {"float32": (np.float32, TP.FLOAT), "float16": (np.float16, TP.FLOAT16),
          "bfloat16": (ml_dtypes.bfloat16, TP.BFLOAT16)}


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_isas() -> list[str]:
    """The ORTKV_CPU_ISA copies this CPU can run, narrowest first (Note [CPU attention ISA dispatch])."""
    flags = cpu_flags()
    isas = ["baseline"]
    if {"avx2", "fma", "f16c"} <= flags:
        isas.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
            isas.append("avx512")
    return isas


def cuda_available() -> str | None:
    """None when CUDA tests can run, else the reason they cannot."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (the CPU wheel); install onnxruntime-gpu, see docs/GPU.md"
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device visible to torch"
    except ImportError:
        return "torch (used to hold CUDA buffers in the tests) is not installed"
    from ortkv import _ortkv

    if not _ortkv.CUDA_BUILD:
        return "ortkv was built without CUDA kernels (ORTKV_CUDA=OFF or no nvcc)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = cuda_available()
    if reason:
        skip = pytest.mark.skip(reason=f"CUDA test skipped: {reason}")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


def digest(arr) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).view(np.uint8).tobytes()).hexdigest()


def cache_update_model(onnx_type: int = TP.FLOAT, rank: int = 4, seq_axis: int = -2, *, vector_position=False,
                       annotate=True, consumer: bool = False) -> onnx.ModelProto:
    """cache [symbolic dims] -> CacheUpdate -> updated_cache (graph output), or with consumer=True
    -> ReduceSum over the updated cache (updated_cache stays inside the graph)."""
    dims = [f"d{i}" for i in range(rank)]
    vdims = list(dims)
    vdims[seq_axis] = "n"
    node = make_cache_update("cache", "values", "position", "updated_cache", name="cache_update", seq_axis=seq_axis)
    nodes = [node]
    outputs = [helper.make_tensor_value_info("updated_cache", onnx_type, dims)]
    if consumer:
        nodes.append(helper.make_node("ReduceSum", ["updated_cache"], ["total"], keepdims=0))
        outputs = [helper.make_tensor_value_info("total", onnx_type, [])]
    graph = helper.make_graph(
        nodes, "cache_update",
        [helper.make_tensor_value_info("cache", onnx_type, dims),
         helper.make_tensor_value_info("values", onnx_type, vdims),
         helper.make_tensor_value_info("position", TP.INT64, ["d0"] if vector_position else [])],
        outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                              ir_version=10)
    if annotate:
        mark_mutable(model, "cache")
        if not consumer:
            set_alias_of(model, "updated_cache", "cache")
    return model


def cache_attention_model(num_heads: int, kv_heads: int, seq_axis: int = 1, onnx_type: int = TP.FLOAT, *,
                          vector: bool = True) -> onnx.ModelProto:
    """One CacheAttention node: q [B, T, W], caches in the layout of seq_axis (1: BSNH, 2 or -2: BNSH,
    0: SBNH), start [B] (or a scalar with vector=False) -> out [B, T, W]."""
    node = make_cache_attention("q", "k", "v", "start", "out", name="attn", num_heads=num_heads,
                                kv_num_heads=kv_heads, seq_axis=seq_axis)
    kv = {1: ["B", "C", "H", "D"], 2: ["B", "H", "C", "D"], -2: ["B", "H", "C", "D"], 0: ["C", "B", "H", "D"]}[seq_axis]
    g = helper.make_graph([node], "attn", [helper.make_tensor_value_info("q", onnx_type, ["B", "T", "W"]),
                                           helper.make_tensor_value_info("k", onnx_type, kv),
                                           helper.make_tensor_value_info("v", onnx_type, kv),
                                           helper.make_tensor_value_info("start", TP.INT64, ["B"] if vector else [])],
                          [helper.make_tensor_value_info("out", onnx_type, ["B", "T", "W"])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ortkv", 1)],
                             ir_version=10)


def start_from_add(model: onnx.ModelProto, name: str = "start") -> onnx.ModelProto:
    """`model` with its input `name` computed by Add(`name`_in, 1) as the graph's first node: on the GPU, the
    kernel launched right before an attention that reads it (Note [CUDA attention early start])."""
    return input_from_add(model, name, TP.INT64, 1)


def input_from_add(model: onnx.ModelProto, name: str, onnx_type: int, addend: int) -> onnx.ModelProto:
    """`model` with its input `name` computed by Add(`name`_in, addend) (a scalar of onnx_type) as the graph's
    first node."""
    g = model.graph
    next(i for i in g.input if i.name == name).name = f"{name}_in"
    g.node.insert(0, helper.make_node("Add", [f"{name}_in", f"{name}_addend"], [name], name=f"add_{name}"))
    g.initializer.append(helper.make_tensor(f"{name}_addend", onnx_type, [1], [addend]))
    return model


def ort_session(model: onnx.ModelProto, providers=("CPUExecutionProvider",), threads: int | None = None
                ) -> ort.InferenceSession:
    """A session of `model` with ortkv's op library; threads: ORT's intra-op threads (None: ORT's default)."""
    so = ort.SessionOptions()
    so.log_severity_level = 4  # the tests assert on the errors; keep ORT's own log quiet
    so.register_custom_ops_library(ortkv.get_library_path())
    if threads is not None:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=list(providers))


@functools.lru_cache(maxsize=None)
def cached_session(onnx_type: int, rank: int, seq_axis: int, vector_position: bool) -> ort.InferenceSession:
    return ort_session(cache_update_model(onnx_type, rank, seq_axis, vector_position=vector_position))


def run_bound(sess: ort.InferenceSession, cache: np.ndarray, values: np.ndarray, position, onnx_type: int) -> int:
    """One CacheUpdate run with ONE buffer bound as cache and updated_cache; returns the output's pointer."""
    io = sess.io_binding()
    io.bind_input("cache", "cpu", 0, onnx_type, list(cache.shape), cache.ctypes.data)
    io.bind_output("updated_cache", "cpu", 0, onnx_type, list(cache.shape), cache.ctypes.data)
    values = np.ascontiguousarray(values)
    io.bind_input("values", "cpu", 0, onnx_type, list(values.shape), values.ctypes.data)
    io.bind_cpu_input("position", np.asarray(position, dtype=np.int64, order="C"))
    sess.run_with_iobinding(io)
    return io.get_outputs()[0].data_ptr()


def random_case(rng, shape, axis: int, n: int, vector: bool, np_type):
    """A cache, n new values along `axis` and a valid position (per row, or the last slot for all)."""
    cache = rng.standard_normal(shape).astype(np.float32).astype(np_type)
    vshape = list(shape)
    vshape[axis] = n
    values = rng.standard_normal(vshape).astype(np.float32).astype(np_type)
    cap = shape[axis]
    position = rng.integers(0, cap - n + 1, size=shape[0]) if vector else np.int64(cap - n)
    return cache, values, position


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
