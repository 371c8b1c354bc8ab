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
attention's output), as the checker's alias-hazard rule requires. Inputs: input_ids [B, T], positions [B], pool uint8 [pool_bytes] (READ_WRITE), directory int64
[num_pages, 2], page_table int32 [B, max_pages]. Rewriting the built graph (instead of a second builder)
keeps the weights, rotary and MLP code in one place.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper

from ..errors import OrtkvError
from ..graph import mark_mutable, set_alias_of
from ..graph.annotations import declare_output_alias
from ..paged import PagedKVCache, PagePool, policy_from_config
from ..vmm import Governor
from .builder import ortkv_names
from .config import GenAIConfig

POOL = "pool"


def pool_output(i: int) -> str:
    return f"present_pool.{i}"


def to_paged(model: onnx.ModelProto, num_heads: int, kv_heads: int, page_size: int) -> onnx.ModelProto:
    """The ortkv decoder (BSNH) rewritten onto the paged ops (Note [Paged decoder]), in place."""
    g = model.graph
    by_name = {n.name: n for n in g.node}
    producer = {o: n for n in g.node for o in n.output}
    layers = sum(1 for n in g.node if n.op_type == "CacheAttention")
    if layers == 0:
        raise OrtkvError("to_paged: the model has no CacheAttention node; pass the ortkv decoder")
    removed, new_nodes = set(), {}
    for i in range(layers):
        uk, uv, att = by_name[f"update_k_{i}"], by_name[f"update_v_{i}"], by_name[f"attention_{i}"]
        if uk.op_type != "CacheUpdate" or dict((a.name, a.i) for a in uk.attribute).get("seq_axis") != 1:
            raise OrtkvError("to_paged: the ortkv decoder must have BSNH caches (cache_layout 'BSNH')")
        # the new K / V flat [B, T, Hkv*D]: CacheUpdate's own input, or a Reshape's input (older builds)
        rk, rv = producer.get(uk.input[1]), producer.get(uv.input[1])
        rk, rv = [r if r is not None and r.op_type == "Reshape" else None for r in (rk, rv)]
        k, v = [r.input[0] if r is not None else u.input[1] for r, u in ((rk, uk), (rv, uv))]
        q, positions = att.input[0], att.input[3]
        prev = POOL if i == 0 else pool_output(i - 1)
        common = dict(layer=i, num_layers=layers, kv_num_heads=kv_heads, page_size=page_size)
        upd = helper.make_node("PagedCacheUpdate", [prev, "directory", "page_table", k, v, positions],
                               [pool_output(i)], domain="ortkv", name=f"paged_update_{i}", **common)
        declare_output_alias(upd, 0, 0)
        attn = helper.make_node("PagedCacheAttention", [q, pool_output(i), "directory", "page_table", positions],
                                list(att.output), domain="ortkv", name=f"paged_attention_{i}", num_heads=num_heads,
                                **common)
        removed |= {id(uk), id(uv), id(att)} | {id(r) for r in (rk, rv) if r is not None}
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
    outputs.append(helper.make_tensor_value_info(pool_output(layers - 1), TP.UINT8, ["pool_bytes"]))
    del g.input[:]
    g.input.extend(inputs)
    del g.output[:]
    g.output.extend(outputs)
    g.name = g.name.replace("_ortkv", "_paged")
    mark_mutable(model, POOL)
    set_alias_of(model, pool_output(layers - 1), POOL)
    return model


def paged_model_path(cfg: GenAIConfig, log=print):
    """The paged decoder's model.onnx (one per page size), built on first use next to the other variants."""
    from .builder import build
    from .config import MAX_POSITIONS
    from .models import gguf_path, model_dir, save_decoder
    from .weights import load

    root = model_dir(cfg)
    name = f"paged-ps{cfg.ortkv.page_size}"
    target = root / name / "model.onnx"
    if target.exists():
        return target
    weights, _ = load(gguf_path(cfg, log), log=log, fmt=cfg.ortkv.weights)
    log(f"ortkv: building the paged decoder ({cfg.ortkv.weights} weights, pages of {cfg.ortkv.page_size}) ...")
    c = weights.config
    model = to_paged(build(weights, "ortkv", max_positions=MAX_POSITIONS, cache_layout="BSNH"), c.heads,
                     c.kv_heads, cfg.ortkv.page_size)
    return save_decoder(model, root, name)


class PagedRunner:
    """The runner interface of runners.py (start / prefill / step / kv_bytes / close) on the paged
    decoder: a PagePool on one arena under the config's budget, one PagedKVCache for the batch, its policy
    from the ``ortkv`` section (Note [Page policies] in ortkv.paged)."""

    name = "ortkv"

    def __init__(self, path, cfg: GenAIConfig):
        from ..session import MutableCacheSession

        if cfg.device != "cpu" or cfg.dtype != "float32":
            raise OrtkvError(f"ortkv.cache = 'paged' runs on the CPU in float32 (the paged kernels are CPU ones); "
                             f"got device {cfg.device}, dtype {cfg.dtype}: use --device cpu, or cache 'arena'")
        self.cfg = cfg
        self.layers = cfg.model.decoder.num_hidden_layers
        o = cfg.ortkv
        self.policy = policy_from_config(o.kv_format, o.kv_policy, o.kv_page_formats)
        self.sess = MutableCacheSession(str(path), sess_options=_session_options(cfg),
                                        providers=["CPUExecutionProvider"])
        have = sum(1 for n in onnx.load(str(path), load_external_data=False).graph.node
                   if n.op_type == "PagedCacheAttention")
        if have != self.layers:
            raise OrtkvError(f"model.decoder.num_hidden_layers = {self.layers} but {path} has {have} layers of "
                             "paged attention; take the decoder's numbers from the model")
        self.pool = self.cache = None

    def start(self, batch: int, max_length: int) -> None:
        d, o = self.cfg.model.decoder, self.cfg.ortkv
        self._release()
        per_seq = -(-max_length // o.page_size)
        self.pool = PagePool(self.layers, d.num_key_value_heads, d.head_size, o.page_size, np.float32, "cpu",
                             Governor(o.arena_budget_bytes), max_pages=batch * per_seq,
                             demote_on_refusal=o.kv_demote_on_refusal)
        self.cache = PagedKVCache(self.pool, batch, per_seq, self.policy)
        self.sess.bind_cache(POOL, self.pool.pool)
        self.lengths = np.zeros(batch, np.int64)

    def _run(self, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        self.cache.reserve(positions + ids.shape[1])
        (logits,) = self.sess.run(["logits"], {"input_ids": ids, "positions": positions,
                                               "directory": self.pool.directory, "page_table": self.cache.page_table})
        return logits

    def logits_all(self, ids: np.ndarray) -> np.ndarray:
        """Right-padded prompts from position 0; logits of every position [B, T, V]. The pages hold all T
        tokens of every row (pads included) until the rows' lengths are set by prefill."""
        return self._run(ids, np.zeros(len(ids), np.int64))

    def prefill(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        logits = self.logits_all(ids)
        self.lengths = lengths.astype(np.int64).copy()
        self.cache.advance(self.lengths)
        return logits[np.arange(len(ids)), lengths - 1]

    def step(self, next_ids: np.ndarray) -> np.ndarray:
        logits = self._run(next_ids.reshape(-1, 1), self.lengths)
        self.lengths += 1
        self.cache.advance(self.lengths)
        return logits[:, -1]

    def teacher_forced(self, ids: np.ndarray, chunk: int) -> np.ndarray:
        """Logits [T, V] of one sequence ids [T], fed ``chunk`` tokens per run (the policy acts between
        runs, as in generation)."""
        out = []
        for s in range(0, ids.shape[0], chunk):
            block = ids[None, s:s + chunk]
            out.append(self._run(block, self.lengths)[0])
            self.lengths += block.shape[1]
            self.cache.advance(self.lengths)
        return np.concatenate(out)

    def kv_bytes(self) -> int:
        return self.pool.committed_bytes if self.pool is not None else 0

    def paged_stats(self) -> dict:
        s = self.pool.stats()
        s["policy"] = self.policy.describe()
        s["page_size"] = self.pool.page_size
        return s

    def _release(self) -> None:
        if self.pool is not None:
            self.sess.unbind_cache(POOL)
            self.pool.close()
            self.pool = self.cache = None

    def close(self) -> None:
        self.sess.close()
        if self.pool is not None:
            self.pool.close()  # deferred while a view is alive (Note [Arena exports])
            self.pool = self.cache = None


def _session_options(cfg: GenAIConfig):
    from .runners import _session_options as so

    return so(cfg)
