"""One decoder run per step, three ways, behind one small interface:

    runner = XRunner(path, cfg)          # loads the model
    runner.start(batch, max_length)      # allocates the generation state (caches, generator)
    runner.prefill(ids [B, T] right-padded, lengths [B]) -> logits of each row's last prompt token [B, V]
    runner.step(next_ids [B]) -> logits [B, V]
    runner.kv_bytes() -> KV cache bytes resident now

* OrtkvRunner : MutableCacheSession; caches are arena views (bytes follow the tokens) or dense arrays.
* CopyRunner  : plain InferenceSession; present = Concat(past, new) is fed back as the next past.
* GenAIRunner : onnxruntime-genai's Generator on the GenAI-format model, with or without
                past_present_share_buffer; ortkv samples from its logits like from the others.
"""

from __future__ import annotations

import json

import numpy as np

from ..errors import OrtkvError
from ..vmm import ArenaKVCache, CacheGeometry, Governor
from .builder import genai_names, ortkv_names
from .config import GenAIConfig


def _session_options(cfg: GenAIConfig):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = cfg.ortkv.intra_op_num_threads
    so.log_severity_level = 3
    return so


def _check_layers(cfg: GenAIConfig, path, layers: int) -> None:
    """The config's decoder must describe the model it runs: a layer count that differs would leave caches
    unbound or feed names the graph does not have (head counts and sizes are checked when caches bind)."""
    want = cfg.model.decoder.num_hidden_layers
    if layers != want:
        raise OrtkvError(f"model.decoder.num_hidden_layers = {want} but {path} has {layers} layers of KV caches; "
                         "take the decoder's numbers from the model (or remove them from the config)")


class OrtkvRunner:
    name = "ortkv"

    def __init__(self, path, cfg: GenAIConfig):
        from ..session import MutableCacheSession

        self.cfg = cfg
        self.layers = cfg.model.decoder.num_hidden_layers
        self.sess = MutableCacheSession(str(path), sess_options=_session_options(cfg),
                                        providers=["CPUExecutionProvider"])
        self.arena_cache = None
        _check_layers(cfg, path, len(self.sess.caches) // 2)

    def start(self, batch: int, max_length: int) -> None:
        cfg, d = self.cfg, self.cfg.model.decoder
        if self.arena_cache is not None:  # a new generation: give the previous caches back
            for i in range(self.layers):
                for name in ortkv_names(i)[:2]:
                    self.sess.unbind_cache(name)
            self.arena_cache.close_when_unused()  # frees now, or once stray views are gone
            self.arena_cache = None
        geom = CacheGeometry(layers=self.layers, kv_heads=d.num_key_value_heads, head_size=d.head_size,
                             capacity=max_length, batch=batch, dtype_bytes=4)
        if cfg.ortkv.cache == "arena":
            self.arena_cache = ArenaKVCache(geom, cfg.ortkv.cache_layout, "cpu", Governor(cfg.ortkv.arena_budget_bytes),
                                            np.float32)
            views = self.arena_cache.views
        else:  # dense: the whole max_length, resident up front (what a preallocated buffer costs)
            shape = geom.tensor_shape(cfg.ortkv.cache_layout)
            views = [np.zeros(shape, np.float32) for _ in range(geom.tensors)]
            for v in views:
                v.fill(0)
        self._dense_bytes = sum(v.nbytes for v in views) if self.arena_cache is None else 0
        for i in range(self.layers):
            past_k, past_v, _, _ = ortkv_names(i)
            self.sess.bind_cache(past_k, views[2 * i])
            self.sess.bind_cache(past_v, views[2 * i + 1])
        self.lengths = np.zeros(batch, np.int64)

    def _ensure(self, tokens: int) -> None:
        if self.arena_cache is not None:
            self.arena_cache.ensure(tokens)

    def logits_all(self, ids: np.ndarray) -> np.ndarray:
        """Run right-padded prompts from position 0; logits of every position [B, T, V]."""
        self._ensure(ids.shape[1])
        (logits,) = self.sess.run(["logits"], {"input_ids": ids, "positions": np.zeros(len(ids), np.int64)})
        return logits

    def prefill(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        logits = self.logits_all(ids)
        self.lengths = lengths.astype(np.int64).copy()
        return logits[np.arange(len(ids)), lengths - 1]

    def step(self, next_ids: np.ndarray) -> np.ndarray:
        self._ensure(int(self.lengths.max()) + 1)
        (logits,) = self.sess.run(["logits"], {"input_ids": next_ids.reshape(-1, 1), "positions": self.lengths})
        self.lengths += 1
        return logits[:, -1]

    def kv_bytes(self) -> int:
        return self.arena_cache.committed_bytes if self.arena_cache is not None else self._dense_bytes

    def close(self) -> None:
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
        self.layers, self.pad = cfg.model.decoder.num_hidden_layers, cfg.model.pad_token_id
        self.sess = ort.InferenceSession(str(path), _session_options(cfg), providers=["CPUExecutionProvider"])
        self.out_names = [o.name for o in self.sess.get_outputs()]
        _check_layers(cfg, path, sum(i.name.startswith("past_key_values.") for i in self.sess.get_inputs()) // 2)

    def start(self, batch: int, max_length: int) -> None:
        d = self.cfg.model.decoder
        empty = np.zeros((batch, d.num_key_value_heads, 0, d.head_size), np.float32)
        self.past = {n: empty for i in range(self.layers) for n in genai_names(i)[:2]}
        self.mask = None
        self.lengths = None

    def _run(self, feeds):
        results = dict(zip(self.out_names, self.sess.run(None, {**feeds, **self.past})))
        for i in range(self.layers):
            pk, pv, ok, ov = genai_names(i)
            self.past[pk], self.past[pv] = results[ok], results[ov]
        return results["logits"][:, -1]

    def prefill(self, ids, lengths):
        ids, self.mask, pos = _left_pad(ids, lengths, self.pad)
        self.lengths = lengths.astype(np.int64).copy()
        return self._run({"input_ids": ids, "attention_mask": self.mask, "position_ids": pos})

    def step(self, next_ids):
        self.mask = np.concatenate([self.mask, np.ones((len(next_ids), 1), np.int64)], axis=1)
        pos = self.lengths.reshape(-1, 1)
        self.lengths = self.lengths + 1
        return self._run({"input_ids": next_ids.reshape(-1, 1), "attention_mask": self.mask, "position_ids": pos})

    def kv_bytes(self) -> int:
        return sum(v.nbytes for v in self.past.values())

    def close(self) -> None:
        self.sess = None
        self.past = {}


class GenAIRunner:
    def __init__(self, path, cfg: GenAIConfig, share: bool):
        import onnxruntime_genai as og

        self.name = "genai-share" if share else "genai"
        self.share, self.pad = share, cfg.model.pad_token_id
        self.greedy = not cfg.search.do_sample
        d = cfg.model.decoder
        self._per_token = 2 * d.num_hidden_layers * d.num_key_value_heads * d.head_size * 4
        config = og.Config(str(path.parent))
        config.overlay(json.dumps({"search": {"past_present_share_buffer": share, "num_beams": 1,
                                              "do_sample": False}}))
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

    def kv_bytes(self) -> int:
        held = self.max_length if self.share else self.tokens
        return self.batch * held * self._per_token

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
