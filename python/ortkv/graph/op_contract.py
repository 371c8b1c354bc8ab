"""The op contract of every ortkv op: ports, element types, attributes (types, defaults, allowed values),
limits, and which output MUST alias which input. One table, read by the alias checker (checker.py), the
shape rules (op_rules.py, through ShapesContext) and the memory planner (its workspace).

Note [Op contract]
~~~~~~~~~~~~~~~~~~
The alias of an ortkv op comes from the op itself, not from the model's annotations: the kernels
declare it to ONNX Runtime (GetAliasMap, custom_ops/ort/cache_update_op.cc), and ORT writes through it
whether or not the model says so. So the checker derives each ortkv node's aliases from
``OpContract.must_alias``; an ``output_alias`` annotation on an ortkv node may repeat an entry of the
contract (the builders write it) but never contradict it (rule ``alias-contract``). An unannotated
CacheUpdate whose cache is an initializer or an input not marked READ_WRITE is therefore an error,
exactly like an annotated one. Ops of other domains keep getting their aliases from annotations.

What the kernels accept is written here once, and ``tests/test_op_contract.py`` runs the real kernels
on a grid of attribute values, shapes and types and asserts that the rules and the kernels agree on
every case (accepted / refused). Where a kernel is more lenient than the contract, the difference is
named in ``KERNEL_LENIENCY`` (the checker refuses; the kernel would run with a default); it is empty
now that the kernels refuse a wrongly typed attribute too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onnx import AttributeProto, TensorProto

from ..errors import GraphCheckError
from ..reference.codecs import PageFormat

DOMAIN = "ortkv"
FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
INT = AttributeProto.INT
FLOAT = AttributeProto.FLOAT
STRING = AttributeProto.STRING


@dataclass(frozen=True)
class Port:
    name: str
    types: tuple[int, ...] | None  # allowed element types (None: any)
    shape: str  # what the kernel expects, for messages and the README
    optional: bool = False  # INPUT_OUTPUT_OPTIONAL: a trailing port the node may omit (or name "")


@dataclass(frozen=True)
class Attr:
    name: str
    kind: int  # AttributeProto.INT, FLOAT or STRING
    required: bool = False
    default: object = None
    allowed: tuple | None = None  # the only values the kernel runs with (None: see minimum / the rule)
    minimum: float | None = None
    doc: str = ""


@dataclass(frozen=True)
class OpContract:
    domain: str
    op_type: str
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    must_alias: tuple[tuple[int, int], ...]  # (output index, input index): the output IS the input's storage
    attrs: tuple[Attr, ...]
    limits: dict = field(default_factory=dict)
    kernel: str = ""  # where a kernel exists ("" for a design-only contract)

    def attr_spec(self, name: str) -> Attr | None:
        return next((a for a in self.attrs if a.name == name), None)


CONTRACTS: dict[tuple[str, str], OpContract] = {}


def _add(c: OpContract) -> None:
    CONTRACTS[(c.domain, c.op_type)] = c


_add(OpContract(
    DOMAIN, "CacheUpdate",
    inputs=(Port("cache", FLOATS, "rank >= 3, e.g. BNSH [batch, heads, capacity, head_size]"),
            Port("values", FLOATS, "the cache's shape except n >= 1 along the sequence axis; for a cache of rank "
                 ">= 4 with seq_axis 1 (BSNH) also flat [batch, n, heads * head_size]"),
            Port("position", (TensorProto.INT64,), "scalar or [batch]")),
    outputs=(Port("updated_cache", FLOATS, "the cache's shape"),),
    must_alias=((0, 0),),
    attrs=(Attr("seq_axis", INT, default=-2,
                doc="the sequence axis; negative counts from the end; must resolve into [1, rank - 1], or be 0: "
                    "SBNH [capacity, batch, ...], token-major (the batch is then axis 1)"),),
    kernel="CPU, CUDA",
))
_add(OpContract(
    DOMAIN, "CacheAttention",
    inputs=(Port("query", (TensorProto.FLOAT,), "[batch, tokens, num_heads * head_size]; float32 (the CPU "
                 "kernel; the CUDA kernel also takes float16 and bfloat16, not described here yet)"),
            Port("key_cache", (TensorProto.FLOAT,), "rank 4: [batch, capacity, kv_heads, head_size] (seq_axis 1), "
                 "[batch, kv_heads, capacity, head_size] (seq_axis 2 / -2) or [capacity, batch, kv_heads, "
                 "head_size] (seq_axis 0, SBNH)"),
            Port("value_cache", (TensorProto.FLOAT,), "the key cache's shape"),
            Port("start", (TensorProto.INT64,), "scalar or [batch]")),
    outputs=(Port("output", (TensorProto.FLOAT,), "the query's shape"),),
    must_alias=(),
    attrs=(Attr("num_heads", INT, required=True, minimum=1, doc="query heads"),
           Attr("kv_num_heads", INT, required=True, minimum=1, doc="KV heads; num_heads must be a multiple"),
           Attr("scale", FLOAT, default=0.0, doc="softmax scale; <= 0: 1 / sqrt(head_size)"),
           Attr("seq_axis", INT, default=1, allowed=(1, 2, -2, 0), doc="1: BSNH caches; 2 or -2: BNSH; 0: SBNH")),
    limits={"max_group": 64},  # query heads per KV head (the CPU kernel's per-group accumulators)
    kernel="CPU, CUDA",
))
# Note [RotaryCacheUpdate] / Note [SwiGLU] in custom_ops/include/ortkv/rotary_cache_update.h
_add(OpContract(
    DOMAIN, "RotaryCacheUpdate",
    inputs=(Port("qkv", FLOATS, "[batch, tokens, (num_heads + 2 kv_num_heads) * head_size]: the fused QKV "
                 "projection's output (q, then k, then v columns); float32 on the CPU"),
            Port("k_cache", FLOATS, "rank 4 in the layout of seq_axis: BNSH [batch, kv_heads, capacity, head_size] "
                 "(-2 / 2), BSNH [batch, capacity, kv_heads, head_size] (1), SBNH [capacity, batch, kv_heads, "
                 "head_size] (0)"),
            Port("v_cache", FLOATS, "the key cache's shape and type"),
            Port("positions", (TensorProto.INT64,), "scalar or [batch]: each row's first new token's position"),
            Port("cos_cache", FLOATS, "[rows, head_size / 2] with rows >= capacity (com.microsoft.RotaryEmbedding's "
                 "table)"),
            Port("sin_cache", FLOATS, "the cos table's shape")),
    outputs=(Port("q_rot", FLOATS, "[batch, tokens, num_heads * head_size]"),
             Port("k_cache_out", FLOATS, "the key cache"), Port("v_cache_out", FLOATS, "the value cache")),
    must_alias=((1, 1), (2, 2)),
    attrs=(Attr("num_heads", INT, required=True, minimum=1, doc="query heads"),
           Attr("kv_num_heads", INT, required=True, minimum=1, doc="KV heads"),
           Attr("seq_axis", INT, default=-2, allowed=(-2, 2, 1, 0),
                doc="the caches' sequence axis: -2 or 2 BNSH, 1 BSNH, 0 SBNH")),
    kernel="CPU, CUDA",
))
_add(OpContract(
    DOMAIN, "SwiGLU",
    inputs=(Port("x", FLOATS, "[..., 2 * F]: gate then up (the fused [wg | wu] projection's output); float32 on "
                 "the CPU"),),
    outputs=(Port("y", FLOATS, "[..., F] = silu(gate) * up"),),
    must_alias=(),
    attrs=(),
    kernel="CPU, CUDA",
))
# The paged ops (Note [Paged cache physical form] in custom_ops/include/ortkv/paged.h): one uint8 pool of
# page slots, a directory (format, byte offset) per page id and a page table per sequence; the directory
# and the page table are host-managed and only read by the ops.
# PagedCacheAttention's page_format attribute: a format name in either case (custom_ops/ort/paged_ops.cc)
_PAGE_FORMAT_NAMES = tuple(n for f in PageFormat for n in (f.name, f.name.lower()))
_PAGED_ATTRS = (Attr("layer", INT, required=True, minimum=0, doc="this node's layer; < num_layers"),
                Attr("num_layers", INT, required=True, minimum=1, doc="layers per page slot"),
                Attr("kv_num_heads", INT, required=True, minimum=1, doc="KV heads of a page"),
                Attr("page_size", INT, required=True, minimum=1, doc="tokens per page"))
_PAGED_PORTS = (Port("pool", (TensorProto.UINT8,), "[pool_bytes]: every page's bytes"),
                Port("directory", (TensorProto.INT64,), "[num_pages, 2] = (format, byte offset of the slot)"),
                Port("page_table", (TensorProto.INT32,), "[batch, max_pages] of page ids, -1 = none"))
# Note [Page fill] (custom_ops/include/ortkv/paged.h): rows held per page-table entry; absent = all full.
_PAGE_FILL = Port("page_fill", (TensorProto.INT32,), "[batch, max_pages] rows held per page-table entry, 0 .. "
                  "page_size (optional; absent = every entry full; CPU kernels only in this build)", optional=True)
_add(OpContract(
    DOMAIN, "PagedCacheUpdate",
    inputs=_PAGED_PORTS + (Port("key", FLOATS, "[batch, tokens, kv_heads * head_size]"),
                           Port("value", FLOATS, "the key's shape and type"),
                           Port("position", (TensorProto.INT64,), "scalar or [batch]"), _PAGE_FILL),
    outputs=(Port("updated_pool", (TensorProto.UINT8,), "the pool"),),
    must_alias=((0, 0),),
    attrs=_PAGED_ATTRS,
    kernel="CPU",
))
# Note [PagedRotaryCacheUpdate] in custom_ops/include/ortkv/paged.h: RotaryCacheUpdate's rotary, then PagedCacheUpdate
_add(OpContract(
    DOMAIN, "PagedRotaryCacheUpdate",
    inputs=_PAGED_PORTS + (Port("qkv", FLOATS, "[batch, tokens, (num_heads + 2 kv_num_heads) * head_size]: the fused "
                                "QKV projection's output (q, then k, then v columns)"),
                           Port("position", (TensorProto.INT64,), "scalar or [batch]"),
                           Port("cos_cache", FLOATS, "[rows, head_size / 2] of qkv's type, rows >= max_pages * "
                                "page_size"),
                           Port("sin_cache", FLOATS, "the cos table's shape"), _PAGE_FILL),
    outputs=(Port("updated_pool", (TensorProto.UINT8,), "the pool"),
             Port("q_rot", FLOATS, "[batch, tokens, num_heads * head_size]")),
    must_alias=((0, 0),),
    attrs=_PAGED_ATTRS + (Attr("num_heads", INT, required=True, minimum=1, doc="query heads"),),
    kernel="CPU, CUDA",
))
_add(OpContract(
    DOMAIN, "PagedCacheAttention",
    inputs=(Port("query", FLOATS, "[batch, tokens, num_heads * head_size]"),) + _PAGED_PORTS +
           (Port("start", (TensorProto.INT64,), "scalar or [batch]"), _PAGE_FILL),
    outputs=(Port("output", FLOATS, "the query's shape and type"),),
    must_alias=(),
    attrs=(Attr("num_heads", INT, required=True, minimum=1, doc="query heads"),) + _PAGED_ATTRS[:2] +
          (Attr("kv_num_heads", INT, required=True, minimum=1, doc="KV heads; num_heads must be a multiple"),
           _PAGED_ATTRS[3], Attr("scale", FLOAT, default=0.0, doc="softmax scale; <= 0: 1 / sqrt(head_size)"),
           Attr("page_format", STRING, default="", allowed=("",) + _PAGE_FORMAT_NAMES,
                doc="every page read has this format (refused otherwise); '' = any. On CUDA F16 / BF16 under "
                    "queries of that type take the uniform 16-bit kernel"),
           Attr("static_tables", INT, default=0, allowed=(0, 1),
                doc="1: directory, page_table and page_fill are graph inputs or initializers that no node writes, "
                    "so the CUDA kernels trust what they read of them before the kernel before ends (Note [Paged "
                    "CUDA static tables]); the checker refuses it otherwise")),
    limits={"max_group": 64},
    kernel="CPU",
))

# Note [MatMulQ4 layout] (custom_ops/include/ortkv/matmul_q4.h): a Q4_1 matrix kept exactly, repacked at build
# time (ortkv.generate.weights.pack_matmul_q4) into tiles of 16 output columns.
_add(OpContract(
    DOMAIN, "MatMulQ4",
    inputs=(Port("X", (TensorProto.FLOAT,), "[..., K]"),
            Port("codes", (TensorProto.UINT8,), "[ceil(N / 16), K / 32, 256]: 4-bit codes, two per byte"),
            Port("scales", (TensorProto.FLOAT16,), "[ceil(N / 16), K / 32, 16]: Q4_1 block scales d"),
            Port("mins", (TensorProto.FLOAT16,), "[ceil(N / 16), K / 32, 16]: Q4_1 block minimums m")),
    outputs=(Port("Y", (TensorProto.FLOAT,), "[..., N]"),),
    must_alias=(),
    attrs=(Attr("K", INT, required=True, minimum=1, doc="the inner dimension; a multiple of 32 (the Q4_1 block)"),
           Attr("N", INT, required=True, minimum=1, doc="output columns"),
           Attr("act_terms", INT, default=1, allowed=(1, 2),
                doc="int8 terms per activation block (Note [MatMulQ4 activation terms])"),
           Attr("isa", STRING, default="auto", allowed=("auto", "avx512vnni", "avx2", "scalar"),
                doc="the kernel copy; auto: the best the CPU runs (Note [MatMulQ4 dispatch])")),
    kernel="CPU",
))

# Note [Linear] (custom_ops/include/ortkv/linear.h): Y = X W^T, W in torch's Linear layout [N, K].
_add(OpContract(
    DOMAIN, "Linear",
    inputs=(Port("X", FLOATS, "[..., K]: float32 / float16 on the CPU, float16 / bfloat16 on CUDA; K a multiple of 8"),
            Port("W", FLOATS, "[N, K] (torch's Linear layout: MatMul's B transposed), X's type"),
            Port("skip", FLOATS, "[..., K], X's shape: the product reads norm(X + skip) * gamma, CPU float32 only "
                 "(Note [Linear norm prologue]); with gamma", optional=True),
            Port("gamma", FLOATS, "[K], the RMSNorm weight of the prologue; with skip", optional=True)),
    outputs=(Port("Y", FLOATS, "[..., N], X's type; [..., N / 2] with activation swiglu"),
             Port("sum", FLOATS, "[..., K]: X + skip (the residual stream), with the prologue", optional=True)),
    must_alias=(),
    attrs=(Attr("rows_per_warp", INT, default=2, allowed=(1, 2, 4),
                doc="output rows per warp of the CUDA GEMV (M <= 8; Note [Linear GEMV])"),
           Attr("activation", STRING, default="none", allowed=("none", "swiglu"),
                doc="swiglu: W = [wg; wu], Y = silu(X wg^T) * (X wu^T), CPU float32 only "
                    "(Note [Linear SwiGLU epilogue])"),
           Attr("epsilon", FLOAT, default=1e-5, doc="the norm prologue's epsilon (Note [Linear norm prologue])")),
    kernel="CPU, CUDA",
))

# Where a kernel runs what the contract refuses (documented, tested in tests/test_op_contract.py):
KERNEL_LENIENCY: dict[str, str] = {}


def contract_of(node) -> OpContract | None:
    return CONTRACTS.get((node.domain, node.op_type))


_KIND_NAME = {INT: "int", FLOAT: "float", STRING: "string"}


def attribute(node, name: str, contract: OpContract | None = None):
    """The value of ``node``'s attribute ``name`` as the kernel reads it: the contract's default when
    absent or of the wrong type (what KernelInfoGetAttribute does). Never raises."""
    contract = contract or contract_of(node)
    spec = contract.attr_spec(name) if contract else None
    for a in node.attribute:
        if a.name != name:
            continue
        if spec is None:
            return None
        if a.type == spec.kind == INT:
            return int(a.i)
        if a.type == spec.kind == FLOAT:
            return float(a.f)
        if a.type == spec.kind == STRING:
            return a.s.decode("utf-8", "replace")
        break
    return spec.default if spec else None


def attribute_problems(node, contract: OpContract) -> list[str]:
    """What is wrong with ``node``'s attributes and ports by the contract (messages without the node)."""
    problems = []
    given = {}
    for a in node.attribute:
        given.setdefault(a.name, a)
    for spec in contract.attrs:
        a = given.get(spec.name)
        if a is None:
            if spec.required:
                problems.append(f"attribute {spec.name} ({_KIND_NAME[spec.kind]}, {spec.doc}) is required")
            continue
        if a.type != spec.kind:
            kind = AttributeProto.AttributeType.Name(a.type) if a.type in AttributeProto.AttributeType.values() \
                else str(a.type)
            problems.append(f"attribute {spec.name} is {kind}; it must be {_KIND_NAME[spec.kind]} ({spec.doc}; "
                            f"the kernel reads a {kind} {spec.name} as absent)")
            continue
        value = a.i if spec.kind == INT else a.f if spec.kind == FLOAT else a.s.decode("utf-8", "replace")
        if spec.allowed is not None and value not in spec.allowed:
            problems.append(f"attribute {spec.name}={value}; allowed: {', '.join(map(str, spec.allowed))} "
                            f"({spec.doc})")
        elif spec.minimum is not None and value < spec.minimum:
            problems.append(f"attribute {spec.name}={value} must be >= {spec.minimum:g} ({spec.doc})")
    return problems


def arity_problems(node, contract: OpContract) -> list[str]:
    """Ports are required (INPUT_OUTPUT_REQUIRED: present, not empty) except trailing ``optional`` ones
    (INPUT_OUTPUT_OPTIONAL, e.g. page_fill, Note [Page fill]), which a node may omit or name ""."""
    problems = []
    for what, names, ports in (("inputs", list(node.input), contract.inputs),
                               ("outputs", list(node.output), contract.outputs)):
        required = sum(1 for p in ports if not p.optional)
        want = ", ".join(p.name + (" (optional)" if p.optional else "") for p in ports)
        if not required <= len(names) <= len(ports):
            takes = f"{len(ports)}" if required == len(ports) else f"{required} to {len(ports)}"
            problems.append(f"has {len(names)} {what} but {contract.op_type} takes {takes} ({want})")
        elif any(not n and not ports[i].optional for i, n in enumerate(names)):
            k = next(i for i, n in enumerate(names) if not n and not ports[i].optional)
            problems.append(f"{what[:-1]} {k} ({ports[k].name}) is empty; every port of {contract.op_type} is "
                            f"required ({want})")
    return problems


@dataclass(frozen=True)
class NodeAlias:
    output_index: int
    input_index: int
    source: str  # "contract" or "annotation"


def node_aliases(node) -> tuple[list[NodeAlias], list[str]]:
    """The aliases of one node: its op contract's (ortkv ops) and its ``output_alias`` annotation,
    and the ways the annotation contradicts the contract (messages). Entries may name ports the node
    lacks; callers report those (alias-index). Raises GraphCheckError for a malformed annotation."""
    from .annotations import output_aliases

    contract = contract_of(node)
    problems: list[str] = []
    declared = output_aliases(node)
    if contract is None:
        return [NodeAlias(e.output_index, e.input_index, "annotation") for e in declared], problems
    want = dict(contract.must_alias)
    entries = _contract_entries(contract, node)
    for e in declared:
        if want.get(e.output_index) == e.input_index:
            continue  # repeats the contract
        if e.output_index >= len(node.output) or e.input_index >= len(node.input):
            entries.append(NodeAlias(e.output_index, e.input_index, "annotation"))  # callers: alias-index
            continue
        if e.output_index in want:
            problems.append(f"output_alias '{e}' says output {e.output_index} is the storage of input "
                            f"{e.input_index}, but {contract.op_type}'s kernel makes output {e.output_index} the "
                            f"storage of input {want[e.output_index]} "
                            f"({contract.inputs[want[e.output_index]].name}); remove or correct the annotation")
        else:
            problems.append(f"output_alias '{e}' says output {e.output_index} is the storage of input "
                            f"{e.input_index}, but {contract.op_type} writes a new buffer for that output (its "
                            f"kernel declares no alias there); remove the annotation")
    return entries, problems


def safe_node_aliases(node) -> tuple[list[NodeAlias], list[str], str | None]:
    """node_aliases, with a malformed annotation returned as a message instead of raised (the
    contract's entries still hold)."""
    try:
        entries, problems = node_aliases(node)
        return entries, problems, None
    except GraphCheckError as exc:
        contract = contract_of(node)
        return (_contract_entries(contract, node) if contract is not None else []), [], str(exc)


def _contract_entries(contract: OpContract, node) -> list[NodeAlias]:
    """The contract's aliases between ports the node has (an empty name is an absent port)."""
    return [NodeAlias(o, i, "contract") for o, i in contract.must_alias
            if o < len(node.output) and node.output[o] and i < len(node.input) and node.input[i]]
