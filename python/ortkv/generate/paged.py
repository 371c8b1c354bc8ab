"""``--cache paged``: the ortkv decoder on a paged KV cache (PagedCacheUpdate / PagedCacheAttention over one
page pool, ortkv.paged), and its runner.

Note [Paged decoder]
~~~~~~~~~~~~~~~~~~~~
The paged decoder is the ortkv decoder (builder.build(..., "ortkv", cache_layout="BSNH")) with each layer's
CacheUpdate x 2 + CacheAttention replaced by one PagedCacheUpdate(pool, directory, page_table, k, v,
positions) and one PagedCacheAttention(q, pool_l, directory, page_table, positions), k and v taken
before the reshape the dense cache needed ([B, T, kv_heads * head_size], the ops' form). Every layer's
pages live in the same pool, so the updates are chained: layer l's update reads layer l-1's updated pool
(``present_pool.{l-1}``) and its attention reads its own (``present_pool.l``). The kernel declares
output 0 <- input 0 through GetAliasMap (Note [Aliasing CacheUpdate output]), so ORT hands each in-graph
``present_pool.l`` the pool's own buffer; only the last layer's is a graph output, annotated ``alias_of
pool``, which MutableCacheSession binds to the same buffer (and the kernel's pointer check enforces).
Layer l's attention is ordered before layer l+1's update by data (the update's k and v come from the
attention's output), as the checker's alias-hazard rule requires. Inputs: input_ids [B, T], positions [B], the
optional logits_start [1] (kept from the base: Note [Logits from logits_start] in builder.py), pool uint8
[pool_bytes] (READ_WRITE), directory int64 [num_pages, 2], page_table int32 [B, max_pages], and with
``page_fill=True`` page_fill int32 [B, max_pages]
(the ops' optional last input, Note [Page fill]: what the many-sequence path binds so that forks and beam
reorders copy nothing; that model is saved apart, ``paged4-fill-ps{N}``). Rewriting the built graph (instead of a
second builder) keeps the weights, rotary and MLP code in one place. The base is built as the dense ortkv
decoder's projections and MLP are (its Linear choice, models.linear_projections: ortkv.Linear for float32 on the
CPU; the MLP as one SwiGLU, build(fused_mlp=True), on the CPU the Linear's SwiGLU epilogue) and, since "paged3",
with its RotaryCacheUpdate (build(fused=True)): each layer's RotaryCacheUpdate + CacheAttention becomes ONE
PagedRotaryCacheUpdate(pool, directory, page_table, qkv, positions, cos, sin) -> (present_pool.l, q_rot) and the
PagedCacheAttention (Note [PagedRotaryCacheUpdate] in custom_ops/include/ortkv/paged.h), where the unfused base took
Split + 2 RotaryEmbedding + PagedCacheUpdate (on CUDA three ORT kernels and the update's memset + check + store per
layer). The rotary tables hold MAX_POSITIONS rows (whole pages); the op checks each row's positions against them
(a row per position written), so the many-sequence model (page_fill, "paged4-fill-"), whose page tables are wider
than max_length (forks, partial pages), takes the same fused layer. Since "paged4" every PagedCacheAttention node
sets static_tables = 1 (the directory, page table and page_fill are graph inputs that no node writes: Note [Paged
CUDA static tables] in custom_ops/kernels/cuda/paged_cuda.cu). "paged4" / "paged2s" name the models since those
changes (an older build is not reused).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper

from ..errors import OrtkvError
from ..graph import mark_mutable, set_alias_of
from ..graph.annotations import declare_output_alias
from ..paged import PagedKVCache, PagePool, UniformPolicy, policy_from_config
from ..reference.codecs import PageFormat
from ..vmm import Governor
from .builder import ortkv_names
from .config import GenAIConfig

POOL = "pool"


def pool_output(i: int) -> str:
    return f"present_pool.{i}"


def to_paged(model: onnx.ModelProto, num_heads: int, kv_heads: int, page_size: int,
             page_fill: bool = False, page_format: str | None = None) -> onnx.ModelProto:
    """The ortkv decoder (BSNH) rewritten onto the paged ops (Note [Paged decoder]), in place; with
    ``page_fill`` both ops of every layer read the graph input ``page_fill`` (Note [Page fill]); with
    ``page_format`` (a format name) every attention node promises pages of that format alone
    (uniform_page_format)."""
    g = model.graph
    by_name = {n.name: n for n in g.node}
    producer = {o: n for n in g.node for o in n.output}
    layers = sum(1 for n in g.node if n.op_type == "CacheAttention")
    if layers == 0:
        raise OrtkvError("to_paged: the model has no CacheAttention node; pass the ortkv decoder")
    removed, new_nodes = set(), {}
    fill = ["page_fill"] if page_fill else []
    # the tables are graph inputs that no node writes (Note [Paged CUDA static tables])
    promise = {"static_tables": 1, **({"page_format": page_format} if page_format else {})}
    for i in range(layers):
        att = by_name[f"attention_{i}"]
        q, positions = att.input[0], att.input[3]  # (the fused base: q is the RotaryCacheUpdate's q_rot)
        prev = POOL if i == 0 else pool_output(i - 1)
        common = dict(layer=i, num_layers=layers, kv_num_heads=kv_heads, page_size=page_size)
        rot = by_name.get(f"rotary_update_{i}")
        if rot is not None and rot.op_type == "RotaryCacheUpdate":  # Note [Fused ortkv layer]: one node in, one out
            qkv, cos, sin = rot.input[0], rot.input[4], rot.input[5]
            upd = helper.make_node("PagedRotaryCacheUpdate", [prev, "directory", "page_table", qkv, positions, cos, sin]
                                   + fill, [pool_output(i), q], domain="ortkv", name=f"paged_rotary_update_{i}",
                                   num_heads=num_heads, **common)
            removed.add(id(rot))
        else:
            if f"update_k_{i}" not in by_name:
                raise OrtkvError("to_paged: the ortkv decoder must write its caches with RotaryCacheUpdate or with "
                                 "CacheUpdate into BSNH caches (builder.build(..., cache_layout='BSNH'))")
            uk, uv = by_name[f"update_k_{i}"], by_name[f"update_v_{i}"]
            if uk.op_type != "CacheUpdate" or dict((a.name, a.i) for a in uk.attribute).get("seq_axis") != 1:
                raise OrtkvError("to_paged: the ortkv decoder must have BSNH caches (cache_layout 'BSNH')")
            # the new K / V flat [B, T, Hkv*D]: CacheUpdate's own input, or a Reshape's input (older builds)
            rk, rv = producer.get(uk.input[1]), producer.get(uv.input[1])
            rk, rv = [r if r is not None and r.op_type == "Reshape" else None for r in (rk, rv)]
            k, v = [r.input[0] if r is not None else u.input[1] for r, u in ((rk, uk), (rv, uv))]
            upd = helper.make_node("PagedCacheUpdate", [prev, "directory", "page_table", k, v, positions] + fill,
                                   [pool_output(i)], domain="ortkv", name=f"paged_update_{i}", **common)
            removed |= {id(uk), id(uv)} | {id(r) for r in (rk, rv) if r is not None}
        declare_output_alias(upd, 0, 0)
        attn = helper.make_node("PagedCacheAttention", [q, pool_output(i), "directory", "page_table", positions] + fill,
                                list(att.output), domain="ortkv", name=f"paged_attention_{i}", num_heads=num_heads,
                                **common, **promise)
        removed.add(id(att))
        new_nodes[id(att)] = [upd, attn]
    nodes = []
    for n in g.node:
        if id(n) in new_nodes:
            nodes += new_nodes[id(n)]
        elif id(n) not in removed:
            nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    caches = {name for i in range(layers) for name in ortkv_names(i)}
    inputs = [vi for vi in g.input if vi.name not in caches]
    outputs = [vi for vi in g.output if vi.name not in caches]
    inputs += [helper.make_tensor_value_info(POOL, TP.UINT8, ["pool_bytes"]),
               helper.make_tensor_value_info("directory", TP.INT64, ["num_pages", 2]),
               helper.make_tensor_value_info("page_table", TP.INT32, ["batch", "max_pages"])]
    if page_fill:
        inputs.append(helper.make_tensor_value_info("page_fill", TP.INT32, ["batch", "max_pages"]))
    outputs.append(helper.make_tensor_value_info(pool_output(layers - 1), TP.UINT8, ["pool_bytes"]))
    del g.input[:]
    g.input.extend(inputs)
    del g.output[:]
    g.output.extend(outputs)
    g.name = g.name.replace("_ortkv", "_paged")
    mark_mutable(model, POOL)
    set_alias_of(model, pool_output(layers - 1), POOL)
    return model


def uniform_page_format(cfg: GenAIConfig, page_fill: bool = False) -> str | None:
    """The page_format the decoder's PagedCacheAttention nodes promise, or None (pages of any format): on CUDA, a
    float16 model whose policy is one format, F16, INT8 or INT4, for every page (kv_format; no demotion, no
    page_fill), so that the attention runs the uniform 16-bit kernel (Note [Paged CUDA uniform 16-bit] in
    custom_ops/kernels/cuda/paged_cuda.cu) or its INT4 twin (Note [Paged CUDA uniform INT4]; at head size 64, the
    every-format kernel elsewhere) or its INT8 twin (Note [Paged CUDA uniform INT8]; ORTKV_PAGED_UNIFORM_INT8=0
    keeps INT8 pages on the every-format kernel, which checks the promise too). A page of another format would be
    refused, so nothing that changes formats gets the promise."""
    o = cfg.ortkv
    if cfg.device == "cpu" or cfg.dtype != "float16" or page_fill or o.kv_demote_on_refusal:
        return None
    policy = policy_from_config(o.kv_format, o.kv_policy, o.kv_page_formats)
    if isinstance(policy, UniformPolicy) and policy.fmt in (PageFormat.F16, PageFormat.INT8, PageFormat.INT4):
        return policy.fmt.name
    return None


def paged_model_path(cfg: GenAIConfig, log=print, page_fill: bool = False, fused_rotary: bool | None = None):
    """The paged decoder's model.onnx (one per page size, one per promised format (uniform_page_format), and one
    with the page_fill input for the many-sequence path), built on first use next to the other variants.
    fused_rotary: PagedRotaryCacheUpdate (None: yes); False builds the unfused base (A/B runs)."""
    from .builder import build
    from .config import MAX_POSITIONS
    from .models import gguf_path, linear_projections, model_dir, save_decoder
    from .weights import load

    root = model_dir(cfg)
    page_format = uniform_page_format(cfg, page_fill)
    ps = cfg.ortkv.page_size
    # Note [Paged decoder]: "paged4" (PagedRotaryCacheUpdate, static tables), the many-sequence model included
    fused = True if fused_rotary is None else fused_rotary
    base = ("paged4-" if fused else "paged2s-") + ("fill-" if page_fill else "")
    name = f"{base}ps{ps}{'-' + page_format.lower() if page_format else ''}"
    target = root / name / "model.onnx"
    if target.exists():
        return target
    weights, _ = load(gguf_path(cfg, log), log=log, fmt=cfg.ortkv.weights)
    log(f"ortkv: building the paged decoder ({cfg.ortkv.weights} weights, pages of {ps}) ...")
    c = weights.config
    # the rotary tables: MAX_POSITIONS rows in whole pages (each row's positions are checked against them)
    rows = -(-MAX_POSITIONS // ps) * ps
    model = to_paged(build(weights, "ortkv", max_positions=rows, cache_layout="BSNH", dtype=cfg.dtype,
                           fused=fused, fused_mlp=True, linear=linear_projections(cfg, "ortkv")),
                     c.heads, c.kv_heads, ps, page_fill=page_fill, page_format=page_format)
    return save_decoder(model, root, name)


# Note [Paged decoder on CUDA]
# On cuda:N (float16 model, float16 pages unless a narrower format is asked) the runner keeps everything the
# kernels read on the device (Note [Paged CUDA]): the pool in a CUDA arena (bound once per generation), the
# directory as the pool's device OrtValue (rows copied up only when a page opens, changes format or is freed:
# Note [Page pool on CUDA]), and input_ids [B, 1], positions [B], page_table [B, max_pages] and logits
# [B, 1, V] as device OrtValues allocated at start() and written in place (OrtValue.update_inplace) before each
# step. The page table bound to a run is only as wide as the run needs, in buckets (Note [Page table buckets]).
# With --cuda-graph the decode step is captured as in Note [CUDA graph decode]: the prefill runs with gpu_graph_id
# -1, decode under a graph id of its own, and a new id (a fresh capture) after every arena commit (the captured
# PagedCacheUpdate keeps the uncommitted ranges of its capture), every new bucket and every start(). ORT captures a
# new id on its first run (6.05 ms against a 0.43 ms replay for a 211-node float16 chain on the H200, onnxruntime-gpu
# 1.31.1: benchmarks/bench_graph_capture_cuda.py), and a 2 MiB granule holds 5.7 of SmolLM2's F16 pages, so
# committing page by page meant a fresh graph every ~11 steps at batch 8; the pool therefore commits
# COMMIT_AHEAD_TOKENS of every row at a time under CUDA graphs (PagePool's commit_ahead, in slots: batch x 8 pages
# of 16), as ArenaKVCache commits chunks of 128 tokens.
# A requantize (the policy, or demotion) runs between steps on the device (Note [Requantize on a CUDA pool]).
# Greedy picks run on the device (Note [Greedy on the device]): a decode step's in its own run, through the decoder's
# `greedy` output (Note [Greedy in the decoder] in builder.py), the prefill's through GreedyToken (its rows end at
# different positions); sampling brings [B, V] logits back.
# With one format, F16, for every page (and no demotion) the attention nodes promise it (page_format = "F16",
# uniform_page_format; the model `paged4-ps{N}-f16`), which runs the uniform 16-bit kernel (Note [Paged CUDA uniform
# 16-bit] in custom_ops/kernels/cuda/paged_cuda.cu).
#
# Note [Page table buckets]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# PagedCacheAttention on CUDA plans its key splits from the page table's width (the rows' starts are on the device,
# Note [Paged CUDA]): a table of 2,048 keys gives 8 splits whatever the rows hold, and a 16-key row then pays for 7
# empty splits and their merge (~1.9 us a node on the H200, benchmarks/results/paged_attention_cuda_h200.md). So
# the CUDA runner binds the first `width` columns of the batch's table, `width` the pages of the smallest bucket of
# max(TABLE_BUCKET_MIN, a power of two) keys that holds every row after the run (the whole table at most): a
# generation to 2,048 keys runs under 256, 512, 1,024 and 2,048 keys, one device table each (kept, so a CUDA graph's
# input address holds) and one decode capture each. Entries past the width are -1 (no page) for every row,
# so nothing a run reads is dropped.
TABLE_BUCKET_MIN = 256  # keys: one split below 512 (Note [Cluster split chunks] in ortkv/cache_attention.h)


COMMIT_AHEAD_TOKENS = 128  # Note [Paged decoder on CUDA]: per row, what a slab commits at a time under CUDA graphs


def table_bucket(need: int, page_size: int, max_pages: int) -> int:
    """The page table width (pages) of Note [Page table buckets] for rows of at most `need` tokens."""
    keys = max(TABLE_BUCKET_MIN, 1 << max(int(need) - 1, 0).bit_length())
    return min(max_pages, -(-keys // page_size))


class PagedRunner:
    """The runner interface of runners.py (start / prefill / step / kv_bytes / close) on the paged
    decoder: a PagePool on one arena under the config's budget, one PagedKVCache for the batch, its policy
    from the ``ortkv`` section (Note [Page policies] in ortkv.paged). CPU (float32) or CUDA (float16 by
    default; Note [Paged decoder on CUDA])."""

    name = "ortkv"

    def __init__(self, path, cfg: GenAIConfig):
        from ..session import MutableCacheSession
        from .runners import (GreedyToken, LastToken, has_greedy_output, providers_for, takes_logits_start,
                              weights_resident)

        if cfg.device == "cpu" and cfg.dtype != "float32":
            raise OrtkvError(f"ortkv.cache = 'paged' on the CPU runs float32 models; got dtype {cfg.dtype}: use "
                             "dtype float32 (or auto) on the CPU, float16 on CUDA")
        self.cfg = cfg
        self.device = cfg.device
        self.dtype = {"float32": np.float32, "float16": np.float16}[cfg.dtype]
        self.cuda_graph = self.device != "cpu" and cfg.cuda_graph
        self.layers = cfg.model.decoder.num_hidden_layers
        o = cfg.ortkv
        self.policy = policy_from_config(o.kv_format, o.kv_policy, o.kv_page_formats)
        try:
            self.sess = MutableCacheSession(str(path), sess_options=_session_options(cfg, path, self),
                                            providers=providers_for(cfg, cuda_graph=self.cuda_graph))
        except OrtkvError:
            raise
        except Exception as exc:  # ORT's own errors (a node it cannot capture in a CUDA graph)
            if self.cuda_graph:
                raise OrtkvError(f"onnxruntime cannot run the paged decoder as a CUDA graph on {self.device}: "
                                 f"{str(exc).splitlines()[0][:400]}; run with --no-cuda-graph") from None
            raise
        weights_resident(cfg, path)
        have = sum(1 for n in onnx.load(str(path), load_external_data=False).graph.node
                   if n.op_type == "PagedCacheAttention")
        if have != self.layers:
            raise OrtkvError(f"model.decoder.num_hidden_layers = {self.layers} but {path} has {have} layers of "
                             "paged attention; take the decoder's numbers from the model")
        self.last_token = LastToken(cfg) if self.device != "cpu" else None
        self.greedy_token = GreedyToken(cfg) if self.device != "cpu" else None
        # Note [Greedy in the decoder] (builder.py): to_paged keeps the float16 decoder's greedy output, so the
        # decode step picks its token inside its own run (and CUDA graph), as OrtkvRunner's
        self._greedy_out = self.device != "cpu" and has_greedy_output(self.sess)
        self._head_from = takes_logits_start(self.sess.session)  # Note [Logits from logits_start] in builder.py
        self.pool = self.cache = None
        self._io = None

    @property
    def greedy_on_device(self) -> bool:  # Note [Greedy on the device]
        return self.device != "cpu"

    def start(self, batch: int, max_length: int) -> None:
        d, o = self.cfg.model.decoder, self.cfg.ortkv
        self._release()
        per_seq = -(-max_length // o.page_size)
        # Note [Paged decoder on CUDA]: under CUDA graphs a commit costs a fresh capture, so slabs grow by
        # COMMIT_AHEAD_TOKENS of every row at a time (ArenaKVCache's chunk), not page by page
        ahead = batch * -(-COMMIT_AHEAD_TOKENS // o.page_size) if self.cuda_graph else 0
        self.pool = PagePool(self.layers, d.num_key_value_heads, d.head_size, o.page_size, self.dtype, self.device,
                             Governor(o.arena_budget_bytes), max_pages=batch * per_seq,
                             demote_on_refusal=o.kv_demote_on_refusal, commit_ahead=ahead)
        self.cache = PagedKVCache(self.pool, batch, per_seq, self.policy)
        self.sess.bind_cache(POOL, self.pool.pool)
        self.lengths = np.zeros(batch, np.int64)
        if self.device != "cpu":  # Note [Paged decoder on CUDA]: fixed device buffers for the decode step
            import onnxruntime as ort

            dev = self.pool.device_index
            new = lambda shape, t: ort.OrtValue.ortvalue_from_shape_and_type(shape, t, "cuda", dev)  # noqa: E731
            self._io = {"input_ids": new([batch, 1], np.int64), "positions": new([batch], np.int64),
                        "logits": new([batch, 1, self.cfg.model.vocab_size], np.float32)}
            if self._greedy_out:  # Note [Greedy in the decoder] in builder.py
                self._io["greedy"] = new([batch, 2], np.int64)
            self._tables = {}  # width -> [device table, the host columns it holds] (Note [Page table buckets])
            self._decode_width = None
            self._prefill_ro = ort.RunOptions()
            self.decode_graphs = 0  # graph ids that ran a decode step this generation (each one captured afresh)
            self._new_decode_graph()
            if self.cuda_graph:
                self._prefill_ro.add_run_config_entry("gpu_graph_id", "-1")

    def _new_decode_graph(self) -> None:
        import onnxruntime as ort

        from .runners import _graph_ids

        self._decode_ro = ort.RunOptions()
        self._graph_ran = False
        if self.cuda_graph:
            self._decode_ro.add_run_config_entry("gpu_graph_id", str(next(_graph_ids)))

    def _reserve(self, new_lengths) -> None:
        committed = self.pool.committed_bytes
        self.cache.reserve(new_lengths)
        if self.cuda_graph and self.pool.committed_bytes != committed:
            self._new_decode_graph()  # Note [CUDA graph decode]: the captured update keeps its committed ranges

    def _advance(self, lengths) -> None:
        """The policy after a run; a requantize may commit a granule of its format's slab: a new capture too."""
        committed = self.pool.committed_bytes
        self.cache.advance(lengths)
        if self.cuda_graph and self.pool.committed_bytes != committed:
            self._new_decode_graph()

    def _table(self, need: int):
        """The page table on the device for rows of at most `need` tokens: the columns of its bucket (Note [Page
        table buckets]), copied up only when they changed (a page opened)."""
        full = self.cache.page_table
        width = table_bucket(need, self.cfg.ortkv.page_size, full.shape[1])
        if full[:, width:].max(initial=-1) >= 0:  # the bucket would drop a page (rows longer than `need`)
            width = full.shape[1]
        table = full[:, :width].copy()  # contiguous, and not a view of the cache's own (kept below)
        entry = self._tables.get(width)
        if entry is None:  # the bucket's first run: its device table, kept for every later one
            import onnxruntime as ort

            dev = ort.OrtValue.ortvalue_from_shape_and_type(list(table.shape), np.int32, "cuda", self.pool.device_index)
            entry = self._tables[width] = [dev, None]
        if entry[1] is None or not np.array_equal(entry[1], table):
            entry[0].update_inplace(table)
            entry[1] = table
        return entry[0]

    def _run(self, ids: np.ndarray, positions: np.ndarray, head: dict | None = None) -> np.ndarray:
        """Logits [B, T, V] on the host (CPU, or teacher forcing / logits_all on CUDA); [B, T - logits_start, V]
        with ``head``, runners.head_feed's feed."""
        self._reserve(positions + ids.shape[1])
        table = self.cache.page_table if self.device == "cpu" else self._table(positions.max() + ids.shape[1])
        feeds = {"input_ids": np.ascontiguousarray(ids, np.int64), "positions": np.ascontiguousarray(positions),
                 "directory": self.pool.directory_input(), "page_table": table, **(head or {})}
        ro = self._prefill_ro if self.device != "cpu" else None
        (logits,) = self.sess.run(["logits"], feeds, run_options=ro)
        return logits

    def logits_all(self, ids: np.ndarray) -> np.ndarray:
        """Right-padded prompts from position 0; logits of every position [B, T, V]. The pages hold all T
        tokens of every row (pads included) until the rows' lengths are set by prefill."""
        return self._run(ids, np.zeros(len(ids), np.int64))

    def _prefill_device(self, ids: np.ndarray, lengths: np.ndarray):
        """CUDA: the prompt's run; (its logits [B, T - start, V] in a bound device OrtValue, each row's index in
        them: lengths - 1 - start; Note [Logits from logits_start] in builder.py)."""
        import onnxruntime as ort

        from .runners import head_feed

        B, T = ids.shape
        self._reserve(np.full(B, T, np.int64))
        head, start = head_feed(self._head_from, lengths)
        out = ort.OrtValue.ortvalue_from_shape_and_type([B, T - start, self.cfg.model.vocab_size], np.float32, "cuda",
                                                        self.pool.device_index)
        self.sess.run(["logits"], {"input_ids": np.ascontiguousarray(ids, np.int64),
                                   "positions": np.zeros(B, np.int64), "directory": self.pool.directory_input(),
                                   "page_table": self._table(T), **head},
                      run_options=self._prefill_ro, bound_outputs={"logits": out})
        self.lengths = lengths.astype(np.int64).copy()
        self._advance(self.lengths)
        return out, lengths - 1 - start

    def prefill(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        from .runners import head_feed

        if self.device != "cpu":
            return self.last_token(*self._prefill_device(ids, lengths))
        head, start = head_feed(self._head_from, lengths)
        logits = self._run(ids, np.zeros(len(ids), np.int64), head)  # [B, T - start, V]
        self.lengths = lengths.astype(np.int64).copy()
        self._advance(self.lengths)
        return logits[np.arange(len(ids)), lengths - 1 - start]

    def prefill_tokens(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Greedy (CUDA): each row's next token [B] from the prompt, chosen on the device."""
        return self.greedy_token(*self._prefill_device(ids, lengths))

    def _step_device(self, next_ids: np.ndarray):
        self._reserve(self.lengths + 1)
        io = self._io
        directory = self.pool.directory_input()
        io["input_ids"].update_inplace(np.ascontiguousarray(next_ids.reshape(-1, 1), np.int64))
        io["positions"].update_inplace(self.lengths)
        table = self._table(self.lengths.max() + 1)
        if self.cuda_graph and self._decode_width != table.shape()[1]:  # Note [Page table buckets]: a new shape
            self._decode_width = table.shape()[1]
            self._new_decode_graph()
        if self.cuda_graph and not self._graph_ran:  # ORT captures a new id on its first run
            self.decode_graphs += 1
            self._graph_ran = True
        bound = {"logits": io["logits"]}
        if self._greedy_out:
            bound["greedy"] = io["greedy"]
        self.sess.run(list(bound), {"input_ids": io["input_ids"], "positions": io["positions"],
                                    "directory": directory, "page_table": table},
                      run_options=self._decode_ro, bound_outputs=bound)
        self.lengths += 1
        self._advance(self.lengths)  # a requantize here runs between steps (Note [Requantize on a CUDA pool])
        return io["logits"]

    def step(self, next_ids: np.ndarray) -> np.ndarray:
        if self.device != "cpu":
            return self._step_device(next_ids).numpy()[:, -1]
        logits = self._run(next_ids.reshape(-1, 1), self.lengths)
        self.lengths += 1
        self._advance(self.lengths)
        return logits[:, -1]

    def step_tokens(self, next_ids: np.ndarray) -> np.ndarray:
        """Greedy (CUDA): one decode step, then each row's next token [B], chosen on the device (by the decoder
        itself when it has the greedy output: Note [Greedy in the decoder] in builder.py)."""
        if not self._greedy_out:
            return self.greedy_token(self._step_device(next_ids), np.zeros(len(next_ids), np.int64))
        from .runners import decoder_greedy

        self._step_device(next_ids)
        return decoder_greedy(self._io["greedy"], self.cfg.model.vocab_size)

    def teacher_forced(self, ids: np.ndarray, chunk: int) -> np.ndarray:
        """Logits [T, V] of one sequence ids [T], fed ``chunk`` tokens per run (the policy acts between
        runs, as in generation)."""
        out = []
        for s in range(0, ids.shape[0], chunk):
            block = ids[None, s:s + chunk]
            out.append(self._run(block, self.lengths)[0])
            self.lengths += block.shape[1]
            self._advance(self.lengths)
        return np.concatenate(out)

    def kv_bytes(self) -> int:
        return self.pool.committed_bytes if self.pool is not None else 0

    def kv_live_bytes(self) -> int:
        return self.pool.stats()["live_bytes"] if self.pool is not None else 0

    def paged_stats(self) -> dict:
        s = self.pool.stats()
        s["policy"] = self.policy.describe()
        s["page_size"] = self.pool.page_size
        if self.device != "cpu":
            s["decode_graphs"] = self.decode_graphs if self.cuda_graph else 0  # Note [Paged decoder on CUDA]
        return s

    def _release(self) -> None:
        self._io = None
        if self.pool is not None:
            self.sess.unbind_cache(POOL)
            self.pool.close()
            self.pool = self.cache = None

    def close(self) -> None:
        self._io = None
        self.sess.close()
        if self.pool is not None:
            self.pool.close()  # deferred while a view is alive (Note [Arena exports])
            self.pool = self.cache = None


def _session_options(cfg: GenAIConfig, path=None, owner=None):
    from .runners import _session_options as so

    return so(cfg, path, owner)
