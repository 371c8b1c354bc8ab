"""Note [Logits from logits_start] (generate/builder.py): the decoders' optional logits_start input. Its default
computes what the graph without it computed, bit for bit; a fed value computes the same logits for fewer positions;
the runners' prefills feed it and pick each row's last token from the shorter logits. A 2-layer slice of SmolLM2."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import ortkv
from ortkv import _ortkv
from ortkv.generate import builder, weights
from ortkv.generate.assets import smollm2_gguf
from ortkv.generate.builder import LOGITS_START
from ortkv.generate.config import GenAIConfig
from ortkv.generate.loop import generate
from ortkv.generate.runners import CopyRunner, OrtkvRunner, head_start

V = 49152
HAVE_PAGED = hasattr(_ortkv, "paged_requantize")
paged_kernels = pytest.mark.skipif(not HAVE_PAGED, reason="this build has no paged kernels")

# (weights, variant, build kwargs): the float32 head as ortkv.Linear with the final norm in its prologue (Note [Norm in
# the projection]: both of its inputs are sliced), as MatMul after SkipSimplifiedLayerNormalization, the unfused BSNH
# base of the paged decoder, the q4 / q8 heads (MatMulNBits on the 8-bit embedding), the copy baseline in float32 and
# in float16 (ortkv.Linear's float16 head, then the Cast to float32 logits; the float16 ortkv decoder needs CUDA)
BUILDS = {
    "f32_linear": ("float32", "ortkv", dict(linear=True)),
    "f32_matmul": ("float32", "ortkv", dict(linear=False)),
    "f32_bsnh_unfused": ("float32", "ortkv", dict(cache_layout="BSNH", fused=False)),
    "q4": ("q4", "ortkv", {}),
    "q8": ("q8", "ortkv", {}),
    "copy_f32": ("float32", "copy", dict(linear=True)),
    "copy_f16": ("float32", "copy", dict(dtype="float16")),
}


@pytest.fixture(scope="module")
def slice_weights():
    return {fmt: weights.load(smollm2_gguf(), layers=2, fmt=fmt)[0] for fmt in ("float32", "q4", "q8")}


def _model(slice_weights, build: str, variant: str | None = None) -> onnx.ModelProto:
    fmt, default_variant, kw = BUILDS[build]
    return builder.build(slice_weights[fmt], variant or default_variant, max_positions=64, **kw)


def without_logits_start(model: onnx.ModelProto) -> onnx.ModelProto:
    """The decoder as it was built before logits_start: each Slice of it removed (its readers read its data input),
    the input, its initializer and the Slices' value_info dropped."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    slices = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Slice" and n.input[1] == LOGITS_START}
    assert slices, "the model has no Slice from logits_start"
    keep = [n for n in g.node if n.output[0] not in slices]
    for n in keep:
        for i, name in enumerate(n.input):
            n.input[i] = slices.get(name, name)
    del g.node[:]
    g.node.extend(keep)
    for field, drop in ((g.input, {LOGITS_START}), (g.initializer, {LOGITS_START, "logits_end"}),
                        (g.value_info, set(slices))):
        kept = [x for x in field if x.name not in drop]
        del field[:]
        field.extend(kept)
    return m


def _caches(model: onnx.ModelProto, batch: int, capacity: int = 64) -> dict:
    """Zeroed caches for every READ_WRITE input, shaped as declared (batch, capacity)."""
    out = {}
    dtype = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16}
    for vi in model.graph.input:
        if vi.name.startswith("past_key.") or vi.name.startswith("past_value."):
            t = vi.type.tensor_type
            shape = [d.dim_value if d.HasField("dim_value") else {"batch": batch, "capacity": capacity}[d.dim_param]
                     for d in t.shape.dim]
            out[vi.name] = np.zeros(shape, dtype[t.elem_type])
    return out


def _feeds(model: onnx.ModelProto, ids: np.ndarray) -> dict:
    """A prefill's feeds from position 0: positions (ortkv), or a mask, position ids and empty pasts (copy)."""
    names = [i.name for i in model.graph.input]
    if "positions" in names:
        return {"input_ids": ids, "positions": np.zeros(len(ids), np.int64)}
    past = next(i for i in model.graph.input if i.name.startswith("past_key_values."))
    dtype = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16}[past.type.tensor_type.elem_type]
    return {"input_ids": ids, "attention_mask": np.ones_like(ids),
            "position_ids": np.tile(np.arange(ids.shape[1]), (len(ids), 1)),
            **{n: np.zeros((len(ids), 3, 0, 64), dtype) for n in names if n.startswith("past_key_values.")}}


def _run(model: onnx.ModelProto, ids: np.ndarray, start=None) -> np.ndarray:
    """One prefill of ids from position 0 on fresh caches; logits_start fed unless None."""
    sess = ortkv.MutableCacheSession(model)
    for name, arr in _caches(model, len(ids)).items():
        sess.bind_cache(name, arr)
    feeds = _feeds(model, ids)
    if start is not None:
        feeds[LOGITS_START] = np.array([start], np.int64)
    try:
        return sess.run(["logits"], feeds)[0]
    finally:
        sess.close()


IDS = np.array([[504, 3575, 282, 4649, 314, 7042, 30], [1, 9690, 28, 2, 4932, 30, 1001]], np.int64)


@pytest.mark.parametrize("build", list(BUILDS))
def test_default_is_the_graph_without_logits_start_bit_for_bit(slice_weights, build):
    """Unfed, logits_start is 0: every position, what the same graph without the Slice computes, bit for bit; the
    input is optional (an initializer that is a graph input: ORT lists it as overridable, not as required)."""
    m = _model(slice_weights, build)
    assert m.ir_version >= 4  # below 4 an initializer named like an input is a constant, not a default
    init = next(t for t in m.graph.initializer if t.name == LOGITS_START)
    assert onnx.numpy_helper.to_array(init).tolist() == [0]
    sess = ortkv.MutableCacheSession(m)
    assert LOGITS_START not in [i.name for i in sess.session.get_inputs()]
    assert LOGITS_START in [i.name for i in sess.session.get_overridable_initializers()]
    sess.close()
    new, old = _run(m, IDS), _run(without_logits_start(m), IDS)
    assert new.shape == old.shape == (2, 7, V) and np.isfinite(new).all()
    np.testing.assert_array_equal(new, old)
    np.testing.assert_array_equal(_run(m, IDS, 0), old)  # fed 0: the same


@pytest.mark.parametrize("build", list(BUILDS))
def test_fed_logits_start_computes_the_same_logits_for_fewer_positions(slice_weights, build):
    """logits_start = s gives [B, T - s, V], the full run's positions s.. exactly: nothing before the head depends on
    it, and the head's kernels (ortkv.Linear's tiles, MLAS SGEMM, MatMulNBits with int8 activations per row) sum
    each (row, column) in an order set by K, not by the number of rows (measured bit-equal on this CPU; a kernel that
    chose its order by M would differ by rounding, and this test would say so). A new shape also shows that ORT did
    not fold the default in as a constant."""
    m = _model(slice_weights, build)
    full = _run(m, IDS)
    for s in (1, 3, IDS.shape[1] - 1):
        got = _run(m, IDS, s)
        assert got.shape == (2, IDS.shape[1] - s, V)
        np.testing.assert_array_equal(got, full[:, s:])


def test_float16_ortkv_decoder_slices_before_the_head_and_greedy_reads_the_logits(slice_weights):
    """The float16 ortkv decoder (CUDA only: its RotaryCacheUpdate / CacheAttention run float16 on CUDA) takes
    logits_start too: the head (ortkv.Linear) reads the Slice, the Cast makes the logits of [B, logits_seq, V], and
    Note [Greedy in the decoder] slices the last position of those logits (the same last position whatever
    logits_start is); the model check types it."""
    m = builder.build(slice_weights["float32"], "ortkv", max_positions=64, dtype="float16", cache_layout="SBNH")
    producer = {o: n for n in m.graph.node for o in n.output}
    cast = producer["logits"]
    head = producer[cast.input[0]]
    assert (cast.op_type, head.op_type) == ("Cast", "Linear")
    assert producer[head.input[0]].op_type == "Slice" and producer[head.input[0]].input[1] == LOGITS_START
    greedy_slice = next(n for n in m.graph.node if n.op_type == "Slice" and n.input[1] == "greedy_last")
    assert greedy_slice.input[0] == "logits"
    r = ortkv.graph.check(m, dims={"batch": 2, "seq": 8, "capacity": 64})
    # (the check's op-input findings say that the CPU kernels of the attention take float32: a CUDA model)
    assert [f for f in r.findings if f.rule != "op-input"] == [] and r.shapes.type_of("logits").shape == (2, 8, V)


def test_genai_variant_is_unchanged_and_copy_takes_it(slice_weights):
    genai = _model(slice_weights, "f32_matmul", "genai")
    assert LOGITS_START not in [i.name for i in genai.graph.input]
    assert not any(n.op_type == "Slice" and LOGITS_START in n.input for n in genai.graph.node)
    assert [d.dim_param for d in genai.graph.output[0].type.tensor_type.shape.dim[:2]] == ["batch", "seq"]
    copy = _model(slice_weights, "copy_f32")
    assert LOGITS_START in [i.name for i in copy.graph.input]
    # through a plain InferenceSession, as CopyRunner runs it: run() takes a numpy feed of the initializer's name
    sess = ort.InferenceSession(copy.SerializeToString(), _so(), providers=["CPUExecutionProvider"])
    feeds = _feeds(copy, IDS)
    full = sess.run(["logits"], feeds)[0]
    last = sess.run(["logits"], {**feeds, LOGITS_START: np.array([6], np.int64)})[0]
    assert full.shape == (2, 7, V) and last.shape == (2, 1, V)
    np.testing.assert_array_equal(last, full[:, 6:])


def _so():
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(ortkv.get_library_path())
    return so


def test_session_checks_the_feed_type_by_name(slice_weights):
    """Note [Overridable initializers]: a feed of logits_start is type-checked as an input's (a numpy feed is bound
    as an OrtValue: IOBinding's bind_cpu_input takes required inputs only)."""
    m = _model(slice_weights, "f32_linear")
    sess = ortkv.MutableCacheSession(m)
    for name, arr in _caches(m, 1).items():
        sess.bind_cache(name, arr)
    with pytest.raises(ortkv.InputTypeError, match=r"input 'logits_start' is int32 but the model declares int64"):
        sess.run(["logits"], {"input_ids": IDS[:1], "positions": np.zeros(1, np.int64),
                              LOGITS_START: np.array([2], np.int32)})
    (out,) = sess.run(["logits"], {"input_ids": IDS[:1], "positions": np.zeros(1, np.int64),
                                   LOGITS_START: ort.OrtValue.ortvalue_from_numpy(np.array([5], np.int64))})
    assert out.shape == (1, 2, V)
    sess.close()


def test_model_check_passes_and_types_the_default_run(slice_weights):
    """ortkv.graph.check: no findings; the logits typed as the default run's (logits_start read as its initializer,
    every position: the largest logits), so the memory plan is computed from batch / seq / capacity alone."""
    for build in ("f32_linear", "f32_matmul", "f32_bsnh_unfused"):  # (q4: the check has no GatherBlockQuantized rule)
        r = ortkv.graph.check(_model(slice_weights, build), dims={"batch": 2, "seq": 8, "capacity": 64})
        assert r.findings == [] and r.shapes.untyped() == [], (build, r.findings)
        assert r.shapes.type_of("logits").shape == (2, 8, V) and r.plan is not None


def test_head_start():
    assert head_start(np.array([5, 9, 7])) == 4
    assert head_start(np.array([6, 6])) == 5
    assert head_start(np.array([1, 3])) == 0
    assert head_start(np.array([0, 3])) == 0  # an empty row (never prefilled): from position 0


# --- the runners ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slice_paths(slice_weights, tmp_path_factory):
    """The slice as the ortkv decoder (BNSH, ortkv.Linear as the CPU model cache builds it), the copy baseline, and
    the paged decoders (pages of 4, with and without page_fill) as paged_model_path builds them."""
    from ortkv.generate.paged import to_paged

    w = slice_weights["float32"]
    root = tmp_path_factory.mktemp("logits_start")
    models = {"ortkv": builder.build(w, "ortkv", max_positions=64, linear=True),
              "copy": builder.build(w, "copy", max_positions=64, linear=True)}
    if HAVE_PAGED:
        for fill in (False, True):
            base = builder.build(w, "ortkv", max_positions=256, cache_layout="BSNH", fused=True, fused_mlp=True,
                                 linear=True)
            models["paged_fill" if fill else "paged"] = to_paged(base, w.config.heads, w.config.kv_heads, 4,
                                                                 page_fill=fill)
    paths = {}
    for name, model in models.items():
        (root / name).mkdir()
        onnx.save_model(model, str(root / name / "model.onnx"), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="model.onnx.data")
        paths[name] = root / name / "model.onnx"
    return paths


def _cfg(paged: bool = False) -> GenAIConfig:
    cfg = GenAIConfig()
    cfg.model.decoder.num_hidden_layers = 2
    cfg.search.max_length = 64
    if paged:
        cfg.ortkv.cache_layout = "BSNH"
        cfg.ortkv.cache = "paged"
        cfg.ortkv.page_size = 4
    return cfg.validate()


# right-padded rows of 5, 9 and 7 tokens (pad 2): min(lengths) - 1 = 4, so logits of positions 4..8
ROWS = [[504, 3575, 282, 4649, 314], [1, 9690, 28, 2, 4932, 30, 1001, 17, 600], [504, 3575, 282, 4649, 30, 198, 28]]
LENGTHS = np.array([len(r) for r in ROWS])
PADDED = np.array([r + [2] * (LENGTHS.max() - len(r)) for r in ROWS], np.int64)


def _spy(sess, seen: list):
    """Wrap sess.run to record each run's logits_start feed (None: not fed) and its logits' shape."""
    real = sess.run

    def run(output_names=None, feeds=None, *a, **kw):
        out = real(output_names, feeds, *a, **kw)
        start = (feeds or {}).get(LOGITS_START)
        if start is not None and not isinstance(start, np.ndarray):
            start = start.numpy()
        names = output_names or [o.name for o in sess.get_outputs()]
        logits = out[list(names).index("logits")]
        seen.append((None if start is None else start.tolist(), tuple(logits.shape)))
        return out

    sess.run = run


def _runner(kind: str, paths):
    if kind == "ortkv":
        return OrtkvRunner(paths["ortkv"], _cfg())
    if kind == "copy":
        return CopyRunner(paths["copy"], _cfg())
    from ortkv.generate.paged import PagedRunner

    return PagedRunner(paths["paged"], _cfg(paged=True))


RUNNERS = ["ortkv", "copy", pytest.param("paged", marks=paged_kernels)]


@pytest.mark.parametrize("kind", RUNNERS)
def test_prefill_of_rows_of_different_lengths_picks_each_rows_last_token(slice_paths, kind):
    """A prefill feeds logits_start = min(lengths) - 1 (the copy model, left-padded: T - 1), gets the shorter logits
    and returns row b's position lengths[b] - 1: the logits the runner returned before (every position computed,
    picked at lengths - 1: _head_from off), bit for bit, and those of each row prefilled alone."""
    # ROWS are of different lengths: the copy baseline left-pads them (Note [Copy mask is finite] in builder.py)
    got, seen = {}, []
    for head_from in (True, False):
        r = _runner(kind, slice_paths)
        assert r._head_from
        r._head_from = head_from
        _spy(r.sess, seen)
        r.start(3, 64)
        got[head_from] = r.prefill(PADDED, LENGTHS)
        r.close()
    T = PADDED.shape[1]
    start = T - 1 if kind == "copy" else int(LENGTHS.min()) - 1
    assert start > 0 and (kind == "copy" or T - start > 1)  # rows of different lengths: several positions computed
    assert seen == [([start], (3, T - start, V)), (None, (3, T, V))]
    assert got[True].shape == (3, V) and np.isfinite(got[True]).all()
    np.testing.assert_array_equal(got[True], got[False])
    # each row alone (its own length: logits_start = its last position) gives its row of the batch
    for b, row in enumerate(ROWS):
        r = _runner(kind, slice_paths)
        r.start(1, 64)
        alone = r.prefill(np.array([row], np.int64), np.array([len(row)]))
        r.close()
        np.testing.assert_allclose(alone[0], got[True][b], rtol=1e-4, atol=1e-3)  # another batch: other tiles


@pytest.mark.parametrize("kind", RUNNERS)
def test_generated_tokens_unchanged(slice_paths, kind):
    """Greedy continuations of the rows with logits_start and without (every position computed): the same."""
    from ortkv.generate.config import Search

    out = {}
    for head_from in (True, False):
        r = _runner(kind, slice_paths)
        r._head_from = head_from
        out[head_from] = generate(r, ROWS, Search(max_length=64), 12, eos_id=-1, pad_id=2).new_ids
        r.close()
    assert out[True] == out[False] and all(len(t) == 12 for t in out[True])


def test_logits_all_and_decode_steps_keep_every_position(slice_paths):
    """logits_all (teacher forcing, perplexity, reference agreement) and the decode step feed no logits_start: every
    position, the default's."""
    r = OrtkvRunner(slice_paths["ortkv"], _cfg())
    seen = []
    _spy(r.sess, seen)
    r.start(3, 64)
    assert r.logits_all(PADDED).shape == (3, PADDED.shape[1], V)
    r.start(3, 64)
    r.prefill(PADDED, LENGTHS)
    r.step(np.array([30, 30, 30], np.int64))
    r.close()
    T = PADDED.shape[1]
    assert seen[0] == (None, (3, T, V)) and seen[1] == ([4], (3, T - 4, V))
    assert seen[2][1] == (3, 1, V)  # the decode step: its one position (the fast CPU path feeds no logits_start)


def test_a_model_without_logits_start_still_runs(slice_weights, tmp_path):
    """A decoder built before logits_start (given by path) runs as before: nothing fed, every position computed."""
    path = tmp_path / "model.onnx"
    onnx.save_model(without_logits_start(builder.build(slice_weights["float32"], "ortkv", max_positions=64,
                                                       linear=True)),
                    str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data")
    r = OrtkvRunner(path, _cfg())
    assert not r._head_from
    seen = []
    _spy(r.sess, seen)
    r.start(3, 64)
    assert r.prefill(PADDED, LENGTHS).shape == (3, V)
    r.close()
    assert seen == [(None, (3, PADDED.shape[1], V))]


@paged_kernels
def test_many_sequence_forward_computes_the_last_position_unless_all_logits(slice_paths):
    """MultiRunner.forward: each run (rows of one token count T) feeds logits_start = T - 1; all_logits feeds nothing.
    The last positions equal all_logits' last rows bit for bit."""
    from ortkv.generate.multi import MultiRunner

    cfg = _cfg(paged=True)
    prompts = {0: np.array(ROWS[0], np.int64), 1: np.array(ROWS[1], np.int64)}
    out = {}
    seen = []
    for all_logits in (False, True):
        runner = MultiRunner(slice_paths["paged_fill"], cfg, max_sequences=4)
        assert runner._head_from
        _spy(runner.sess, seen)
        for sid, p in prompts.items():
            runner.cache.new_sequence(sid, p)
        placement = runner.cache.admit(prompts)
        out[all_logits] = runner.forward(placement, all_logits=all_logits)
        runner.cache.done(placement)
        runner.close()
    # one run per token count (5, then 9), last position only; then all positions
    assert seen == [([4], (1, 1, V)), ([8], (1, 1, V)), (None, (1, 5, V)), (None, (1, 9, V))]
    np.testing.assert_array_equal(out[False], np.stack([x[-1] for x in out[True]]))
