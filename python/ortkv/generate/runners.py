"""One decoder run per step, three ways, behind one small interface:

    runner = XRunner(path, cfg)          # loads the model
    runner.start(batch, max_length)      # allocates the generation state (caches, generator)
    runner.prefill(ids [B, T] right-padded, lengths [B]) -> logits of each row's last prompt token [B, V]
    runner.step(next_ids [B]) -> logits [B, V]
    runner.kv_bytes() -> KV cache bytes resident now (committed, for an arena)
    runner.kv_live_bytes() -> KV cache bytes the tokens so far fill

On CUDA (cfg.device "cuda:N", Note [Provider options] in config.py) every runner keeps its caches on the
GPU: ortkv's in CUDA arenas (Note [Committed bytes on CUDA]), the copy model's as device OrtValues fed back
through IOBinding, onnxruntime-genai's in its own CUDA buffers; only the last token's logits come back.

* OrtkvRunner : MutableCacheSession; caches are arena views (bytes follow the tokens) or dense arrays.
* CopyRunner  : plain InferenceSession; present = Concat(past, new) is fed back as the next past.
* GenAIRunner : onnxruntime-genai's Generator on the GenAI-format model, with or without
                past_present_share_buffer; ortkv samples from its logits like from the others.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from .. import get_library_path
from .._memory import HugePageWeights, huge_page_weights_enabled, populate_file_mappings
from ..errors import OrtkvError
from ..vmm import ArenaKVCache, CacheGeometry, Governor, live_bytes
from .builder import LOGITS_START, genai_names, ortkv_names
from .config import GenAIConfig

NP_FLOAT = {"float32": np.float32, "float16": np.float16}


def weights_resident(cfg: GenAIConfig, path) -> None:
    """On the CPU, fault in the weights of the model at `path` that its session has mapped (Note [Weights resident at
    load] in ortkv/_memory.py); every CPU runner calls this right after making its session."""
    if cfg.device == "cpu":
        populate_file_mappings(os.path.dirname(os.path.abspath(str(path))))
_INT64 = np.dtype(np.int64)


def _session_options(cfg: GenAIConfig, path=None, owner=None):
    """The runners' SessionOptions. With `path` (the model) and `owner` (the runner, which keeps them alive) on the
    CPU: the weights that ortkv's ops read in place come from huge pages (Note [Weights on huge pages] in
    ortkv/_memory.py), owner._huge_weights."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = cfg.ortkv.intra_op_num_threads
    so.log_severity_level = 3
    if path is not None and owner is not None and cfg.device == "cpu" and huge_page_weights_enabled():
        owner._huge_weights = HugePageWeights(str(path))
        owner._huge_weights.attach(so)
    return so


def providers_for(cfg: GenAIConfig, cuda_graph: bool = False) -> list:
    """ONNX Runtime providers for cfg.device: the CPU, or CUDA with the config's CUDA options (strings, as
    onnxruntime-genai writes them) and enable_cuda_graph only where asked (the ortkv runner), then the CPU
    for shape computations."""
    if cfg.device == "cpu":
        return ["CPUExecutionProvider"]
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise OrtkvError(f"{cfg.device} asked for (provider_options / --device) but onnxruntime "
                         f"{ort.__version__} has no CUDAExecutionProvider ({ort.get_available_providers()}); "
                         "pip uninstall -y onnxruntime && pip install onnxruntime-gpu")
    opts = dict(cfg.cuda_options)
    opts["device_id"] = cfg.device.split(":")[1]
    opts["enable_cuda_graph"] = "1" if cuda_graph else "0"
    return [("CUDAExecutionProvider", opts), "CPUExecutionProvider"]


def head_start(lengths: np.ndarray) -> int:
    """Note [Logits from logits_start] in builder.py: the first position whose logits a prefill of right-padded rows
    of these lengths needs, min(lengths) - 1 (0 at least); row b's logits are then at lengths[b] - 1 - that."""
    return max(int(np.min(lengths)) - 1, 0) if len(lengths) else 0


def head_feed(takes: bool, lengths: np.ndarray) -> tuple[dict, int]:
    """A prefill's logits_start feed and value: ({logits_start: [head_start(lengths)]}, that) for a model that takes
    it (takes_logits_start), else ({}, 0): every position computed."""
    if not takes:
        return {}, 0
    start = head_start(lengths)
    return {LOGITS_START: np.array([start], np.int64)}, start


def takes_logits_start(sess) -> bool:
    """Whether an onnxruntime.InferenceSession's model has the logits_start input (Note [Logits from logits_start] in
    builder.py; a decoder built before it, or the genai variant, has not)."""
    names = [i.name for i in sess.get_inputs()] + [i.name for i in sess.get_overridable_initializers()]
    return LOGITS_START in names


def _device_id(cfg: GenAIConfig) -> int:
    return int(cfg.device.split(":")[1])


def _last_token_model(greedy: bool = False):
    """[B, T, V] logits + [B] row index -> [B, V]: the rows' last tokens, gathered where the logits are.
    greedy: outputs instead next [B] int64 (ArgMax of that row: the lowest id among ties, as numpy's) and
    nan [B] int64 (the first NaN's token id in that row, whose ArgMax would mean nothing; V where none).
    No Reduce* node: ORT's CUDA ReduceMax over [B, V] went through cuDNN's reduce_tensor_kernel_free at ~3 ms
    per call for B >= 8 on the H200 (ArgMax has its own kernel: 4 us), so the NaN flag is an ArgMax too, of
    IsNaN padded with a 0.5 column: 1.0 at the first NaN wins, else the pad at index V."""
    from onnx import TensorProto as TP
    from onnx import helper

    nodes = [helper.make_node("Shape", ["logits"], ["shape"]),
             helper.make_node("Gather", ["shape", "i0"], ["b"], axis=0),
             helper.make_node("Gather", ["shape", "i1"], ["t"], axis=0),
             helper.make_node("Gather", ["shape", "i2"], ["v"], axis=0),
             helper.make_node("Concat", ["minus1", "v"], ["flat_shape"], axis=0),
             helper.make_node("Reshape", ["logits", "flat_shape"], ["flat"]),
             helper.make_node("Range", ["zero", "b", "one"], ["rows"]),
             helper.make_node("Mul", ["rows", "t"], ["row_start"]),
             helper.make_node("Add", ["row_start", "index"], ["flat_index"]),
             helper.make_node("Gather", ["flat", "flat_index"], ["last"], axis=0)]
    inits = [helper.make_tensor("i0", TP.INT64, [], [0]), helper.make_tensor("i1", TP.INT64, [], [1]),
             helper.make_tensor("i2", TP.INT64, [1], [2]), helper.make_tensor("minus1", TP.INT64, [1], [-1]),
             helper.make_tensor("zero", TP.INT64, [], [0]), helper.make_tensor("one", TP.INT64, [], [1])]
    outputs = [helper.make_tensor_value_info("last", TP.FLOAT, ["B", "V"])]
    if greedy:
        nodes += [helper.make_node("ArgMax", ["last"], ["next"], axis=1, keepdims=0, select_last_index=0),
                  helper.make_node("IsNaN", ["last"], ["isnan"]),
                  helper.make_node("Cast", ["isnan"], ["isnan_f"], to=TP.FLOAT),
                  helper.make_node("Pad", ["isnan_f", "nan_pads", "half"], ["isnan_padded"], mode="constant"),
                  helper.make_node("ArgMax", ["isnan_padded"], ["nan"], axis=1, keepdims=0, select_last_index=0)]
        inits += [helper.make_tensor("nan_pads", TP.INT64, [4], [0, 0, 0, 1]),
                  helper.make_tensor("half", TP.FLOAT, [], [0.5])]
        outputs = [helper.make_tensor_value_info("next", TP.INT64, ["B"]),
                   helper.make_tensor_value_info("nan", TP.INT64, ["B"])]
    graph = helper.make_graph(nodes, "last_token", [helper.make_tensor_value_info("logits", TP.FLOAT, ["B", "T", "V"]),
                                                    helper.make_tensor_value_info("index", TP.INT64, ["B"])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


class LastToken:
    """Gathers each row's last-token logits on the device, so that only [B, V] floats cross to the host
    after a prefill (its logits are [B, T - logits_start, V]: Note [Logits from logits_start] in builder.py; all T
    positions were 6.4 GB at batch 32 x 1024 tokens)."""

    def __init__(self, cfg: GenAIConfig):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        self.sess = ort.InferenceSession(_last_token_model().SerializeToString(), so, providers=providers_for(cfg))

    def __call__(self, logits_value, index: np.ndarray) -> np.ndarray:
        io = self.sess.io_binding()
        io.bind_ortvalue_input("logits", logits_value)
        io.bind_cpu_input("index", np.ascontiguousarray(index, np.int64))
        io.bind_output("last", "cpu")
        self.sess.run_with_iobinding(io)
        return io.get_outputs()[0].numpy()


# Note [Greedy on the device]
# With greedy search (do_sample false; Note [Sampling semantics]) a CUDA runner returns the next token ids, not
# logits: ortkv and the copy model run GreedyToken (each row's last position gathered, ArgMax with the lowest
# id among ties, as numpy's argmax, and an IsNaN flag per row) on the logits where the decoder left them, so
# 16 bytes a row reach the host instead of [B, V] float32 (V = 49,152: 6.3 MB at batch 32) and the host runs
# no argmax; onnxruntime-genai runs its own loop (generate_next_token: its model run and its greedy pick on
# its device), as its users would. Sampling still brings [B, V] logits to the host, where Sampler keeps
# onnxruntime-genai's semantics. On the CPU every runner returns logits: a host argmax is what a device pick
# would be there. (Measured per step on the H200 host before this: the [B, V] copy + numpy argmax, and a
# ctypes.util.find_library lookup of libcudart for the device-memory sample, 2.9 ms each time: a
# subprocess. _cuda_library is cached now.)
class GreedyToken:
    """Greedy search on the device (Note [Greedy on the device]): [B, T, V] logits + [B] row index -> the
    ArgMax of each row's last-token logits, [B] int64; only 16 bytes a row cross to the host, not [B, V]
    float32 (6.3 MB at batch 32), and the host does no argmax."""

    def __init__(self, cfg: GenAIConfig):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        self.sess = ort.InferenceSession(_last_token_model(greedy=True).SerializeToString(), so,
                                         providers=providers_for(cfg))
        self.io = self.sess.io_binding()

    def __call__(self, logits_value, index: np.ndarray) -> np.ndarray:
        io = self.io
        io.bind_ortvalue_input("logits", logits_value)
        io.bind_cpu_input("index", np.ascontiguousarray(index, np.int64))
        io.bind_output("next", "cpu")
        io.bind_output("nan", "cpu")
        self.sess.run_with_iobinding(io)
        nxt, nan = (v.numpy() for v in io.get_outputs())
        return checked_greedy(nxt, nan, logits_value.shape()[-1])


def checked_greedy(nxt: np.ndarray, nan: np.ndarray, vocab: int) -> np.ndarray:
    """The greedy picks [B] int64, unless a row's logits hold NaN (nan[b] != vocab: that token's id)."""
    if (nan != vocab).any():
        b = int(np.flatnonzero(nan != vocab)[0])
        raise OrtkvError(f"the logits of row {b} hold NaN at token {int(nan[b])}: the model produced no usable "
                         "distribution")
    return nxt.astype(np.int64)


def has_greedy_output(sess) -> bool:
    """Whether a decoder session picks its decode step's greedy token itself (Note [Greedy in the decoder] in
    builder.py: the float16 decoders, dense and paged)."""
    return any(o.name == "greedy" for o in sess.session.get_outputs())


def decoder_greedy(value, vocab: int) -> np.ndarray:
    """The picks [B] of a decoder's bound greedy output [B, 2] (the pick, the first NaN's id, vocab if none)."""
    picked = value.numpy()
    return checked_greedy(picked[:, 0], picked[:, 1], vocab)


@functools.cache
def _cuda_library():
    """ctypes handle of the CUDA runtime (or None): for cudaMemGetInfo; torch and pynvml are not needed."""
    import ctypes
    import ctypes.util
    import glob
    import os
    import sys

    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    for base in sys.path:  # the nvidia-cuda-runtime wheels onnxruntime-gpu installs
        names += sorted(glob.glob(os.path.join(base, "nvidia", "cu*", "lib", "libcudart.so*")))
        names += sorted(glob.glob(os.path.join(base, "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def device_memory_used(device: int) -> int | None:
    """Bytes in use on the device now (total - free, cudaMemGetInfo; every process's), or None if unknown."""
    import ctypes

    lib = _cuda_library()
    if lib is None:
        return None
    if lib.cudaSetDevice(ctypes.c_int(device)) != 0:
        return None
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
        return None
    return total.value - free.value


class DeviceMemory:
    """Peak of device_memory_used over the samples taken (prefill and every step), above a baseline."""

    def __init__(self, cfg: GenAIConfig):
        self.device = None if cfg.device == "cpu" else _device_id(cfg)
        self.baseline = self.peak = None
        self.reset()

    def reset(self) -> None:
        if self.device is not None:
            self.baseline = device_memory_used(self.device)
            self.peak = self.baseline

    def sample(self) -> None:
        if self.device is not None and self.peak is not None:
            used = device_memory_used(self.device)
            if used is not None:
                self.peak = max(self.peak, used)

    @property
    def peak_above_baseline(self) -> int | None:
        return None if self.peak is None or self.baseline is None else self.peak - self.baseline


def _check_layers(cfg: GenAIConfig, path, layers: int) -> None:
    """The config's decoder must describe the model it runs: a layer count that differs would leave caches
    unbound or feed names the graph does not have (head counts and sizes are checked when caches bind)."""
    want = cfg.model.decoder.num_hidden_layers
    if layers != want:
        raise OrtkvError(f"model.decoder.num_hidden_layers = {want} but {path} has {layers} layers of KV caches; "
                         "take the decoder's numbers from the model (or remove them from the config)")


# Note [Committed bytes on CUDA]
# A CUDA arena commits 2 MiB granules. With BNSH or BSNH in one arena, every (tensor, row[, head]) is its own
# run of live bytes, each rounded up to a granule: SmolLM2 at batch 32 would commit 60 x 32 granules (3.75 GiB)
# for its first token. On CUDA the ortkv runner therefore uses SBNH [capacity, batch, kv_heads, head_size]
# (seq_axis 0; cache_layout "auto") with one arena per tensor (Note [One arena per tensor] in vmm.py): every
# arena's live bytes are one prefix, so committed KV <= live KV + one granule per arena (60 arenas). At
# max_length 8192, batch 32, 1024 + 256 tokens that is 900 MiB live, at most 120 MiB more committed.
# (BNSH/BSNH still run on CUDA when set explicitly; ArenaKVCache reports what they commit.)

# Note [CUDA graph decode]
# With enable_cuda_graph ("1" in the CUDA provider options, --cuda-graph) ORT captures a run as a CUDA graph
# and replays it: no kernel launches from the host, but every input and output must sit at the address it
# had at capture and every op must read what changes (positions) from device memory. The runner keeps
#   * the caches: arena views, bound once per generation (their pointers never change: the arena's point);
#   * input_ids [B, 1], positions [B] and logits [B, 1, V]: device OrtValues allocated at start(), written
#     in place with OrtValue.update_inplace before each step (a host-to-device copy, outside the graph);
# and runs the prefill (another shape) with run option gpu_graph_id = -1, which ORT never captures. Decode
# runs carry a graph id of their own per generation (new caches are new pointers, so a new graph): ORT runs
# it normally twice (its allocations settle), captures it on the third run and replays it from then on.
# Inside a step nothing allocates and nothing waits on the host but ORT's end-of-run stream synchronize and
# the copy of the [B, V] logits. Arena commits (a granule, now and then) happen before the step, on the host;
# they map memory at addresses the graph already holds, but the CUDA CacheUpdate checks each row's write
# against the uncommitted ranges passed at capture (Note [CUDA deferred errors]), so a captured graph would
# refuse tokens past the commit of its capture (seen on the H200 at batch 32: a row crossed a 2 MiB granule
# at position 170). Each commit therefore moves decode to a fresh graph id: one capture per commit
# (ArenaKVCache commits in chunks of 128 tokens), not per step. A model or kernel that reads a position on the host
# cannot be captured: ORT refuses the session (a Memcpy node), reported with the remedy --no-cuda-graph.
_graph_ids = iter(range(1, 1 << 30))


class OrtkvRunner:
    name = "ortkv"

    def __init__(self, path, cfg: GenAIConfig):
        from ..session import MutableCacheSession

        self.cfg = cfg
        self.device = cfg.device
        self.dtype = NP_FLOAT[cfg.dtype]
        self.cuda_graph = self.device != "cpu" and cfg.cuda_graph
        self.layers = cfg.model.decoder.num_hidden_layers
        try:
            self.sess = MutableCacheSession(str(path), sess_options=_session_options(cfg, path, self),
                                            providers=providers_for(cfg, cuda_graph=self.cuda_graph))
        except OrtkvError:
            raise
        except Exception as exc:  # ORT's own errors (e.g. a node it cannot capture in a CUDA graph)
            if self.cuda_graph:
                raise OrtkvError(f"onnxruntime cannot run the ortkv decoder as a CUDA graph on {self.device}: "
                                 f"{str(exc).splitlines()[0][:400]}; every node must run on CUDA reading device "
                                 "memory (CacheUpdate / CacheAttention with device positions). Run with "
                                 "--no-cuda-graph (enable_cuda_graph \"0\")") from None
            raise
        weights_resident(cfg, path)
        self.arena_cache = None
        self._io = None
        self._cpu_step = None  # Note [CPU decode feeds]
        self.last_token = LastToken(cfg) if self.device != "cpu" else None
        self.greedy_token = GreedyToken(cfg) if self.device != "cpu" else None
        # Note [Greedy in the decoder] (builder.py): the float16 decoders pick the decode step's token themselves
        self._greedy_out = self.device != "cpu" and has_greedy_output(self.sess)
        self._head_from = takes_logits_start(self.sess.session)  # Note [Logits from logits_start] in builder.py
        _check_layers(cfg, path, len(self.sess.caches) // 2)

    @property
    def greedy_on_device(self) -> bool:  # Note [Greedy on the device]
        return self.device != "cpu"

    def start(self, batch: int, max_length: int) -> None:
        cfg, d = self.cfg, self.cfg.model.decoder
        if self.arena_cache is not None or self._io is not None:  # a new generation: give the previous caches back
            for i in range(self.layers):
                for name in ortkv_names(i)[:2]:
                    self.sess.unbind_cache(name)
        if self.arena_cache is not None:
            self.arena_cache.close_when_unused()  # frees now, or once stray views are gone
            self.arena_cache = None
        self._io = None
        layout = cfg.cache_layout
        geom = CacheGeometry(layers=self.layers, kv_heads=d.num_key_value_heads, head_size=d.head_size,
                             capacity=max_length, batch=batch, dtype_bytes=np.dtype(self.dtype).itemsize)
        self.geometry = geom
        arena_device = "cpu" if self.device == "cpu" else self.device
        if cfg.ortkv.cache == "arena":
            self.arena_cache = ArenaKVCache(geom, layout, arena_device, Governor(cfg.ortkv.arena_budget_bytes),
                                            self.dtype)
            views = self.arena_cache.views
        elif self.device == "cpu":  # dense: the whole max_length, resident up front (a preallocated buffer's cost)
            shape = geom.tensor_shape(layout)
            views = [np.zeros(shape, self.dtype) for _ in range(geom.tensors)]
            for v in views:
                v.fill(0)
        else:
            raise OrtkvError(f"ortkv.cache = 'dense' runs on the CPU only; on {self.device} the caches come from the "
                             "CUDA arena (ortkv.cache 'arena')")
        self._dense_bytes = sum(v.nbytes for v in views) if self.arena_cache is None else 0
        for i in range(self.layers):
            past_k, past_v, _, _ = ortkv_names(i)
            self.sess.bind_cache(past_k, views[2 * i])
            self.sess.bind_cache(past_v, views[2 * i + 1])
        self.lengths = np.zeros(batch, np.int64)
        if self.device != "cpu":  # Note [CUDA graph decode]: fixed device buffers for the decode step
            import onnxruntime as ort

            dev = _device_id(cfg)
            new = lambda shape, t: ort.OrtValue.ortvalue_from_shape_and_type(shape, t, "cuda", dev)  # noqa: E731
            self._io = {"input_ids": new([batch, 1], np.int64), "positions": new([batch], np.int64),
                        "logits": new([batch, 1, cfg.model.vocab_size], np.float32)}
            if self._greedy_out:  # Note [Greedy in the decoder] in builder.py
                self._io["greedy"] = new([batch, 2], np.int64)
            self._decode_ro = ort.RunOptions()
            self._prefill_ro = ort.RunOptions()
            if self.cuda_graph:
                self._decode_ro.add_run_config_entry("gpu_graph_id", str(next(_graph_ids)))
                self._prefill_ro.add_run_config_entry("gpu_graph_id", "-1")

    def _ensure(self, tokens: int) -> None:
        if self.arena_cache is not None and self.arena_cache.ensure(tokens) and self.cuda_graph:
            # Note [CUDA graph decode]: a captured CacheUpdate keeps the committed ranges of its capture;
            # the arena just grew, so the next decode step runs under a new graph id (captured afresh)
            import onnxruntime as ort

            self._decode_ro = ort.RunOptions()
            self._decode_ro.add_run_config_entry("gpu_graph_id", str(next(_graph_ids)))

    def logits_all(self, ids: np.ndarray) -> np.ndarray:
        """Run right-padded prompts from position 0; logits of every position [B, T, V] (CPU)."""
        if self.device != "cpu":
            raise OrtkvError("logits_all copies [B, T, V] logits to the host: CPU runs only; on CUDA use prefill")
        self._ensure(ids.shape[1])
        (logits,) = self.sess.run(["logits"], {"input_ids": ids, "positions": np.zeros(len(ids), np.int64)})
        return logits

    def _prefill_feeds(self, ids, lengths: np.ndarray) -> tuple[dict, int]:
        """A prefill's feeds from position 0 and the first position whose logits it computes, head_start(lengths)
        where the model takes logits_start (Note [Logits from logits_start] in builder.py), else 0."""
        head, start = head_feed(self._head_from, lengths)
        return {"input_ids": ids, "positions": np.zeros(len(ids), np.int64), **head}, start

    def prefill(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        if self.device == "cpu":
            self._ensure(ids.shape[1])
            feeds, start = self._prefill_feeds(ids, lengths)
            (logits,) = self.sess.run(["logits"], feeds)  # [B, T - start, V]
            self.lengths = lengths.astype(np.int64).copy()
            return logits[np.arange(len(ids)), lengths - 1 - start]
        return self.last_token(*self._prefill_device(ids, lengths))

    def _prefill_device(self, ids: np.ndarray, lengths: np.ndarray):
        """CUDA: the prompt's run; (its logits [B, T - start, V] in a bound device OrtValue, each row's index in
        them: lengths - 1 - start; Note [Logits from logits_start] in builder.py)."""
        import onnxruntime as ort

        self._ensure(ids.shape[1])
        feeds, start = self._prefill_feeds(np.ascontiguousarray(ids, np.int64), lengths)
        out = ort.OrtValue.ortvalue_from_shape_and_type([ids.shape[0], ids.shape[1] - start, self.cfg.model.vocab_size],
                                                        np.float32, "cuda", _device_id(self.cfg))
        self.sess.run(["logits"], feeds, run_options=self._prefill_ro, bound_outputs={"logits": out})
        self.lengths = lengths.astype(np.int64).copy()
        return out, lengths - 1 - start

    def prefill_tokens(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Greedy: each row's next token [B] from the prompt, chosen on the device."""
        return self.greedy_token(*self._prefill_device(ids, lengths))

    def step(self, next_ids: np.ndarray) -> np.ndarray:
        if self.device == "cpu":
            return self._step_cpu(next_ids)[:, -1]
        return self._step_device(next_ids).numpy()[:, -1]

    # Note [CPU decode feeds]
    # A CPU decode step feeds input_ids [B, 1] and positions [B] as two OrtValues made once per generation over
    # numpy buffers (ortvalue_from_numpy: no copy) that the step overwrites in place, so that the session binds
    # them once (MutableCacheSession skips the type / overlap checks and the rebinding of an OrtValue it holds
    # bound already) instead of converting two new arrays every step. The positions buffer IS self.lengths
    # during decode, advanced after each run. The writes go through memoryviews, not numpy: right after a run
    # that streamed ~540 MB of weights the interpreter's and numpy's code and data are out of the CPU caches,
    # and one numpy ufunc (self.lengths += 1) then cost ~70 us, a memoryview store ~1 us. The logits stay a
    # fresh output per step (a caller may keep an earlier step's logits). With Note [Alias check without
    # wrappers] (session.py) the Python around ORT's run went from ~0.6 to ~0.2 ms per step (2-core VM).
    def _step_cpu(self, next_ids: np.ndarray) -> np.ndarray:
        """One decode step on the CPU: [B, 1, V] logits."""
        st = self._cpu_step
        if st is None or self.lengths is not st[0] or getattr(next_ids, "dtype", None) is not _INT64 \
                or len(next_ids) != len(st[0]):
            if getattr(next_ids, "dtype", None) != np.int64:  # as given: refused by name (InputTypeError)
                self._ensure(int(self.lengths.max()) + 1)
                (logits,) = self.sess.run(["logits"], {"input_ids": next_ids.reshape(-1, 1), "positions": self.lengths})
                self.lengths += 1
                return logits
            st = self._cpu_step_state(len(next_ids))
        pos, pos_mv, ids_mv, feeds = st
        self._ensure(max(pos_mv) + 1)
        for i, t in enumerate(next_ids.tolist()):
            ids_mv[i] = t
        (logits,) = self.sess.run(["logits"], feeds)
        for i in range(len(pos_mv)):
            pos_mv[i] += 1
        return logits

    def _cpu_step_state(self, batch: int):
        """(positions buffer, its memoryview, input_ids' memoryview, feeds) for Note [CPU decode feeds]; the
        positions buffer takes over self.lengths' values and becomes self.lengths."""
        import onnxruntime as ort

        st = self._cpu_step
        if st is None or len(st[0]) != batch:
            pos = np.zeros(batch, np.int64)
            ids = np.zeros((batch, 1), np.int64)
            feeds = {"input_ids": ort.OrtValue.ortvalue_from_numpy(ids),
                     "positions": ort.OrtValue.ortvalue_from_numpy(pos)}
            st = (pos, memoryview(pos), memoryview(ids.reshape(-1)), feeds)
        st[0][:] = self.lengths
        self.lengths = st[0]
        self._cpu_step = st
        return st

    def _step_device(self, next_ids: np.ndarray):
        self._ensure(int(self.lengths.max()) + 1)
        io = self._io
        io["input_ids"].update_inplace(np.ascontiguousarray(next_ids.reshape(-1, 1), np.int64))
        io["positions"].update_inplace(self.lengths)
        bound = {"logits": io["logits"]}
        if self._greedy_out:
            bound["greedy"] = io["greedy"]
        self.sess.run(list(bound), {"input_ids": io["input_ids"], "positions": io["positions"]},
                      run_options=self._decode_ro, bound_outputs=bound)
        self.lengths += 1
        return io["logits"]

    def step_tokens(self, next_ids: np.ndarray) -> np.ndarray:
        """Greedy: one decode step, then each row's next token [B], chosen on the device (by the decoder
        itself when it has the greedy output: Note [Greedy in the decoder] in builder.py)."""
        if not self._greedy_out:
            return self.greedy_token(self._step_device(next_ids), self._zero_index(len(next_ids)))
        self._step_device(next_ids)
        return decoder_greedy(self._io["greedy"], self.cfg.model.vocab_size)

    def _zero_index(self, batch: int) -> np.ndarray:
        if getattr(self, "_zeros", None) is None or len(self._zeros) != batch:
            self._zeros = np.zeros(batch, np.int64)
        return self._zeros

    def kv_bytes(self) -> int:
        return self.arena_cache.committed_bytes if self.arena_cache is not None else self._dense_bytes

    def kv_live_bytes(self) -> int:
        return live_bytes(self.geometry, int(self.lengths.max())) if hasattr(self, "geometry") else 0

    def close(self) -> None:
        self._io = None
        self.sess.close()
        if self.arena_cache is not None:
            # Never raises in cleanup: on Ctrl-C the traceback's frames may still hold a view, so the
            # free is deferred until it is gone (Note [Arena exports]), instead of ArenaBusyError.
            self.arena_cache.close_when_unused()
            self.arena_cache = None


def _left_pad(ids: np.ndarray, lengths: np.ndarray, pad: int):
    """Right-padded rows -> left-padded rows, attention mask and position ids (GenAI's convention)."""
    B, T = ids.shape
    out = np.full_like(ids, pad)
    mask = np.zeros((B, T), np.int64)
    for b, n in enumerate(lengths):
        out[b, T - n:] = ids[b, :n]
        mask[b, T - n:] = 1
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return out, mask, pos


class CopyRunner:
    name = "copy"

    def __init__(self, path, cfg: GenAIConfig):
        import onnxruntime as ort

        self.cfg = cfg
        self.device = cfg.device
        self.dtype = NP_FLOAT[cfg.dtype]
        self.layers, self.pad = cfg.model.decoder.num_hidden_layers, cfg.model.pad_token_id
        so = _session_options(cfg, path, self)
        # the copy baseline shares ortkv's weight ops (MatMulQ4 for q4, Linear for float16; Note [Linear
        # projections] in builder.py): only its cache differs from the ortkv decoder's
        so.register_custom_ops_library(get_library_path())
        self.sess = ort.InferenceSession(str(path), so, providers=providers_for(cfg))
        weights_resident(cfg, path)
        self.out_names = [o.name for o in self.sess.get_outputs()]
        self._head_from = takes_logits_start(self.sess)  # Note [Logits from logits_start] in builder.py
        self.last_token = LastToken(cfg) if self.device != "cpu" else None
        self.greedy_token = GreedyToken(cfg) if self.device != "cpu" else None
        _check_layers(cfg, path, sum(i.name.startswith("past_key_values.") for i in self.sess.get_inputs()) // 2)

    def start(self, batch: int, max_length: int) -> None:
        d = self.cfg.model.decoder
        empty = np.zeros((batch, d.num_key_value_heads, 0, d.head_size), self.dtype)
        self.past = {n: empty for i in range(self.layers) for n in genai_names(i)[:2]}
        self.mask = None
        self.lengths = None

    @property
    def greedy_on_device(self) -> bool:  # Note [Greedy on the device]
        return self.device != "cpu"

    def _run(self, feeds, greedy: bool = False):
        if self.device != "cpu":
            logits = self._run_device(feeds)
            B, T = logits.shape()[:2]
            pick = self.greedy_token if greedy else self.last_token
            return pick(logits, np.full(B, T - 1, np.int64))
        results = dict(zip(self.out_names, self.sess.run(None, {**feeds, **self.past})))
        for i in range(self.layers):
            pk, pv, ok, ov = genai_names(i)
            self.past[pk], self.past[pv] = results[ok], results[ov]
        return results["logits"][:, -1]

    def _run_device(self, feeds):
        """CUDA: the presents stay on the device (ORT allocates them: that IS the copy model's second cache)
        and come back as the next run's past through IOBinding; only the last token's logits reach the host."""
        io = self.sess.io_binding()
        for name, value in {**feeds, **self.past}.items():
            if isinstance(value, np.ndarray):
                io.bind_cpu_input(name, np.ascontiguousarray(value))
            else:
                io.bind_ortvalue_input(name, value)
        dev = int(self.device.split(":")[1])
        for name in self.out_names:
            io.bind_output(name, "cuda", dev)
        self.sess.run_with_iobinding(io)
        results = dict(zip(self.out_names, io.get_outputs()))
        for i in range(self.layers):
            pk, pv, ok, ov = genai_names(i)
            self.past[pk], self.past[pv] = results[ok], results[ov]
        return results["logits"]

    def prefill(self, ids, lengths, greedy: bool = False):
        ids, self.mask, pos = _left_pad(ids, lengths, self.pad)
        self.lengths = lengths.astype(np.int64).copy()
        feeds = {"input_ids": ids, "attention_mask": self.mask, "position_ids": pos}
        if self._head_from:  # left-padded: every row ends at T - 1, the one position computed (_run reads the last)
            # (an OrtValue: IOBinding binds a numpy array only to a required input, not to an initializer's name)
            import onnxruntime as ort

            feeds[LOGITS_START] = ort.OrtValue.ortvalue_from_numpy(np.array([ids.shape[1] - 1], np.int64))
        return self._run(feeds, greedy)

    def step(self, next_ids, greedy: bool = False):
        self.mask = np.concatenate([self.mask, np.ones((len(next_ids), 1), np.int64)], axis=1)
        pos = self.lengths.reshape(-1, 1)
        self.lengths = self.lengths + 1
        return self._run({"input_ids": next_ids.reshape(-1, 1), "attention_mask": self.mask, "position_ids": pos},
                         greedy)

    def prefill_tokens(self, ids, lengths):
        return self.prefill(ids, lengths, greedy=True)

    def step_tokens(self, next_ids):
        return self.step(next_ids, greedy=True)

    def kv_bytes(self) -> int:
        item = np.dtype(self.dtype).itemsize
        return sum(int(np.prod(v.shape() if callable(v.shape) else v.shape)) * item for v in self.past.values())

    def kv_live_bytes(self) -> int:
        return self.kv_bytes()

    def close(self) -> None:
        self.sess = None
        self.past = {}


# Note [GenAI on CUDA]
# The GenAI baselines run onnxruntime-genai's own CUDA path (its "cuda" provider with the config's device_id
# and options) on the same float16 weights as ortkv. enable_cuda_graph is not passed on: onnxruntime-genai
# captures graphs only with its static-shape buffers and max_batch_size settings, a different feature than
# the ortkv runner's (Note [CUDA graph decode]); the GenAI figures are without it.
class GenAIRunner:
    def __init__(self, path, cfg: GenAIConfig, share: bool):
        import onnxruntime_genai as og

        self.name = "genai-share" if share else "genai"
        self.cfg = cfg
        self.share, self.pad = share, cfg.model.pad_token_id
        self.greedy = not cfg.search.do_sample
        d = cfg.model.decoder
        item = np.dtype(NP_FLOAT[cfg.dtype]).itemsize
        self._per_token = 2 * d.num_hidden_layers * d.num_key_value_heads * d.head_size * item
        config = og.Config(str(path.parent))
        config.overlay(json.dumps({"search": {"past_present_share_buffer": share, "num_beams": 1,
                                              "do_sample": False}}))
        # onnxruntime-genai's own provider handling on the same weights: its CUDA path for cuda:N (device_id
        # and the config's CUDA options, except enable_cuda_graph: Note [GenAI on CUDA]), the CPU otherwise
        config.clear_providers()
        if cfg.device != "cpu":
            config.append_provider("cuda")
            for key, value in cfg.cuda_options.items():
                if key != "enable_cuda_graph":
                    config.set_provider_option("cuda", key, value)
            config.set_provider_option("cuda", "device_id", cfg.device.split(":")[1])
        self.model = og.Model(config)
        self.gen = None

    def start(self, batch: int, max_length: int) -> None:
        import onnxruntime_genai as og

        if batch > 1 and not self.greedy:
            raise OrtkvError("the onnxruntime-genai baseline samples only at batch 1 (its generator takes tokens "
                             "from outside once per batch); use greedy search for batch > 1")
        self.max_length, self.batch = max_length, batch
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length, batch_size=batch)
        self.gen = og.Generator(self.model, params)
        self.tokens = 0

    def prefill(self, ids, lengths):
        if (lengths != lengths[0]).any():
            ids, _, _ = _left_pad(ids, lengths, self.pad)  # GenAI masks its pad token itself
        self.gen.append_tokens(ids.astype(np.int32))
        self.tokens = ids.shape[1]
        return np.asarray(self.gen.get_logits()).reshape(self.batch, -1)

    def step(self, next_ids):
        if self.batch > 1:
            # GenAI's own greedy step (its generator accepts outside tokens only once when batch > 1);
            # it must pick what ortkv's sampler picked from the same logits.
            self.gen.generate_next_token()
            chosen = np.asarray(self.gen.get_next_tokens()).reshape(-1)
            live = next_ids != self.pad
            if (chosen[live] != next_ids[live]).any():
                raise OrtkvError(f"onnxruntime-genai chose {chosen.tolist()} where ortkv's greedy sampler chose "
                                 f"{next_ids.tolist()} from the same logits")
        else:
            self.gen.append_tokens(next_ids.reshape(-1, 1).astype(np.int32))
        self.tokens += 1
        return np.asarray(self.gen.get_logits()).reshape(self.batch, -1)

    @property
    def greedy_on_device(self) -> bool:  # Note [Greedy on the device]: GenAI's own loop on CUDA
        return self.cfg.device != "cpu" and self.greedy

    def prefill_tokens(self, ids, lengths):
        if (lengths != lengths[0]).any():
            ids, _, _ = _left_pad(ids, lengths, self.pad)
        self.gen.append_tokens(ids.astype(np.int32))
        self.tokens = ids.shape[1]
        self.gen.generate_next_token()  # picks from the prompt's logits (already computed): no model run
        return np.asarray(self.gen.get_next_tokens(), np.int64).reshape(-1)

    def step_tokens(self, next_ids):
        # next_ids are the tokens this generator chose last (the loop pads rows that are done, as GenAI does)
        self.gen.generate_next_token()  # one model run on them, then GenAI's own greedy pick on the device
        self.tokens += 1
        return np.asarray(self.gen.get_next_tokens(), np.int64).reshape(-1)

    def kv_bytes(self) -> int:
        held = self.max_length if self.share else self.tokens
        return self.batch * held * self._per_token

    def kv_live_bytes(self) -> int:
        return self.batch * self.tokens * self._per_token

    def close(self) -> None:
        self.gen = None
        self.model = None


def make_runner(variant: str, cfg: GenAIConfig, log=print):
    """Load the variant's model (building it on first use); call start() before generating."""
    from .models import model_path

    if variant == "ortkv" and cfg.ortkv.cache == "paged":  # Note [Paged decoder] in generate/paged.py
        from .paged import PagedRunner, paged_model_path

        return PagedRunner(paged_model_path(cfg, log), cfg)
    if variant == "ortkv":
        return OrtkvRunner(model_path(cfg, "ortkv", log), cfg)
    if variant == "copy":
        return CopyRunner(model_path(cfg, "copy", log), cfg)
    if variant in ("genai-share", "genai"):
        return GenAIRunner(model_path(cfg, "genai", log), cfg, share=variant == "genai-share")
    raise OrtkvError(f"unknown variant {variant!r}: ortkv, genai-share, genai or copy")


RUNNERS = ("ortkv", "genai-share", "genai", "copy")
