"""ShapesContext: alias-aware shape inference for models carrying ortkv alias annotations.

onnx's shape inference knows neither aliases nor the ortkv ops. ShapesContext walks the model in
execution order and, for every value, keeps one type (element type + dims that are concrete,
symbolic or unknown) per *alias class*: the set of value names that are one storage (a cache and its
in-place updates). What is learned for one name is learned for the class, so a dim known only on
``present_k`` is known on ``past_k`` as well. Symbolic dims unify model-wide (``DimTable``).

Note [Alias classes]
~~~~~~~~~~~~~~~~~~~~
Edges come from node ``output_alias`` entries (output -> input) and value ``alias_of`` annotations
(value -> input). Before the walk they are resolved to names (alias-index), checked for cycles
(alias-cycle) and for agreement (alias-disagree: a value's alias_of must name the input its producer's
output_alias chain ends at), then united. The root of a class is the storage owner: the end of the
chain, normally a READ_WRITE graph input. Composite nodes (If, Loop, Scan, calls of local functions)
do not get their aliases from annotations: their rule derives them from the bodies, and an
annotation on such a node is a claim checked after the rule ran (a Loop whose body returns a new
value for a carried cache loses the alias; an If whose branches resolve an output to different
storage cannot merge it).

Names and constraints only: concrete pointer identity stays a runtime check (MutableCacheSession).

Edges of ortkv nodes come from their op contract (Note [Op contract] in op_contract.py), annotated or
not; an annotation that contradicts the contract is ``alias-contract``.

Rules (Finding.rule): alias-index, alias-contract, alias-cycle, alias-disagree, alias-type, alias-rank, alias-dim,
shape-type, shape-rank, shape-dim, shape (onnx's inference refused a node), op-input (an ortkv or
contrib op's inputs), capacity, if-branch, loop-carry, function-alias, limit (the node budget,
Note [Untrusted models] in structure.py), untyped (warning), no-rule (warning).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import GraphCheckError
from .annotations import ALIAS_OF_KEY, Access, OutputAlias, _get, read_annotations
from .checker import Finding, hazard_findings, is_composite, subgraphs
from .dims import DimTable, ShapeConflict, ValueType, find_root, join_types
from .op_contract import safe_node_aliases
from .structure import MAX_INLINED, count_nodes as _count_nodes
from .op_rules import OP_RULES
from .op_rules import attr as _attr

SMALL = 4096  # int tensors up to this many elements are propagated as values (shape arithmetic)


@dataclass
class _Scope:
    """What one walk needs besides the names: opsets and a label prefix."""

    opsets: dict[str, int]
    prefix: str = ""


class ShapesContext:
    """Alias-aware types of every value of ``model``.

    dims:   symbol -> value (``{"batch": 1, "capacity": 2048}``) bound before inference.
    bounds: value name -> (lo, hi): known ranges of integer inputs such as ``positions``; used with
            constants and simple arithmetic (Add, Sub, Clip, Min, Max) for the capacity check.
    assume_aliases: value -> the input whose storage it is, for aliases a runtime makes by binding
            rather than the model stating them (``share_buffer_aliases``: onnxruntime-genai's
            past_present_share_buffer).
    Call ``infer()`` once; then ``type_of``, ``root``, ``classes``, ``findings``, ``untyped``."""

    def __init__(self, model: onnx.ModelProto, dims: dict[str, int] | None = None,
                 bounds: dict[str, tuple[int, int]] | None = None, assume_aliases: dict[str, str] | None = None):
        self.model = model
        self.assume_aliases = dict(assume_aliases or {})  # value -> storage, as if annotated (share_buffer_aliases)
        self.table = DimTable(dims)
        self.findings: list[Finding] = []
        self.values: dict[str, np.ndarray] = {}      # small int tensors with known contents
        self.partial: dict[str, tuple[list, bool]] = {}  # 0-D/1-D int tensors of dims: (entries, is_scalar)
        self.bounds: dict[str, tuple[int, int]] = dict(bounds or {})
        self.producer: dict[str, str] = {}           # value -> label of the node that makes it
        self.order: list[tuple[str, onnx.NodeProto]] = []  # top-level nodes in execution order
        self._parent: dict[str, str] = {}            # alias union-find
        self._types: dict[str, ValueType] = {}       # class root -> type
        self._origin: dict[str, str] = {}            # class root -> the name whose constraint came first
        self._outputs: list[str] = []                # every node output seen (all graphs)
        self._access = {}
        self._functions = {(f.domain, f.name): f for f in model.functions}
        self._warned_ops: set[str] = set()
        self._claims: dict[str, list] = {}            # composite node label -> its output_alias entries
        self._deferred_alias_of: dict[str, str] = {}  # alias_of on composite outputs, checked after the rule
        self._composite_outputs: set[str] = set()
        self._inferred = False
        self._depth = 0
        self._walked = 0  # nodes inferred, inlined function bodies included
        self._budget = _count_nodes(model) + MAX_INLINED
        self._stopped = False

    # --- findings ---------------------------------------------------------------------------------
    def error(self, rule: str, subject: str, message: str) -> None:
        self.findings.append(Finding("error", rule, subject, message))

    def warning(self, rule: str, subject: str, message: str) -> None:
        self.findings.append(Finding("warning", rule, subject, message))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def raise_for_errors(self) -> "ShapesContext":
        if self.errors:
            raise GraphCheckError(f"{len(self.errors)} shape/alias error(s):\n" +
                                  "\n".join(f"  {f}" for f in self.errors), findings=self.errors)
        return self

    # --- alias classes ----------------------------------------------------------------------------
    def root(self, name: str) -> str:
        """The storage owner of ``name``'s alias class (``name`` itself when it aliases nothing)."""
        return find_root(self._parent, name)

    def classes(self) -> dict[str, list[str]]:
        """Alias classes with more than one name: root -> members (root first)."""
        out: dict[str, list[str]] = {}
        for name in list(self._parent):
            out.setdefault(self.root(name), []).append(name)
        return {r: [r] + sorted(m for m in ms if m != r) for r, ms in out.items() if len(ms) > 1}

    def is_storage_alias(self, name: str) -> bool:
        """True when ``name`` is a READ_WRITE cache or shares storage with another name."""
        r = self.root(name)
        return self._access.get(r) is Access.READ_WRITE or any(
            self.root(m) == r for m in self._parent if m != r)

    def _union(self, value: str, target: str, why: str) -> None:
        """``value`` is the storage of ``target``: one class whose root is ``target``'s root."""
        rv, rt = self.root(value), self.root(target)
        if rv == rt:
            return
        tv, tt = self._types.pop(rv, ValueType()), self._types.get(rt, ValueType())
        ov = self._origin.pop(rv, value)
        self._parent[rv] = rt
        try:
            self._types[rt] = self.table.meet_types(tt, tv)
        except ShapeConflict as exc:
            ot = self._origin.get(rt, target)
            self.error(f"alias-{exc.kind}", value,
                       f"'{ov}' is {self.table.resolve_type(tv)} but '{ot}' is {self.table.resolve_type(tt)} "
                       f"({exc.detail}), and {why} makes them one storage: an in-place update keeps the "
                       f"cache's element type and shape")
            return
        self._origin.setdefault(rt, ov)

    # --- types ------------------------------------------------------------------------------------
    def type_of(self, name: str) -> ValueType:
        """The type of ``name`` (through its alias class), dims resolved through the symbol table."""
        if not name:
            return ValueType()
        return self.table.resolve_type(self._types.get(self.root(name), ValueType()))

    def set_type(self, name: str, t: ValueType | None, source: str) -> None:
        if not name or t is None or (t.elem is None and t.shape is None and t.opaque is None):
            return
        r = self.root(name)
        cur = self._types.get(r, ValueType())
        try:
            self._types[r] = self.table.meet_types(cur, t)
        except ShapeConflict as exc:
            origin = self._origin.get(r, name)
            cur_s = self.table.resolve_type(cur)
            if origin != name:
                self.error(f"alias-{exc.kind}", name,
                           f"{source} gives '{name}' {t}, but '{name}' is the storage of '{origin}', which is "
                           f"{cur_s} ({exc.detail}): an in-place update keeps the cache's element type and shape")
            else:
                self.error(f"shape-{exc.kind}", name, f"{source} gives {t} but '{name}' is {cur_s} ({exc.detail})")
            return
        self._origin.setdefault(r, name)

    def untyped(self) -> list[str]:
        """Node outputs (all graphs) with no element type or no rank after inference."""
        return [n for n in self._outputs if not self.type_of(n).known]

    def dim_bindings(self) -> dict[str, object]:
        return self.table.bindings()

    def access(self, name: str) -> Access | None:
        """The access annotation of graph input ``name`` (READ_WRITE marks a persistent cache)."""
        return self._access.get(name)

    def counts(self) -> tuple[int, int]:
        """(typed node outputs, all node outputs)."""
        return len(self._outputs) - len(self.untyped()), len(self._outputs)

    # --- values and bounds ------------------------------------------------------------------------
    def bounds_of(self, name: str) -> tuple[int, int] | None:
        if name in self.values and self.values[name].size and self.values[name].dtype.kind in "iu":
            v = self.values[name]
            return int(v.min()), int(v.max())
        return self.bounds.get(name)

    def _dims_value(self, name: str):
        """A 0-D/1-D int tensor as (entries, is_scalar) with entries int or symbolic; None if unknown."""
        if name in self.values:
            v = self.values[name]
            if v.dtype.kind in "iu" and v.ndim <= 1:
                return [int(x) for x in v.reshape(-1)], v.ndim == 0
            return None
        if name in self.partial:
            entries, scalar = self.partial[name]
            return [self.table.resolve(d) for d in entries], scalar
        return None

    def _set_dims_value(self, name: str, entries: list, scalar: bool) -> None:
        entries = [self.table.resolve(d) for d in entries]
        if all(isinstance(d, int) for d in entries):
            arr = np.array(entries, np.int64)
            self.values[name] = arr.reshape(()) if scalar else arr
        else:
            self.partial[name] = (entries, scalar)

    # --- the walk ---------------------------------------------------------------------------------
    def infer(self) -> "ShapesContext":
        if self._inferred:
            return self
        self._inferred = True
        model = self.model
        try:
            ann = read_annotations(model)
        except GraphCheckError as exc:
            self.error("malformed", "model", str(exc))
            return self
        self._access = dict(ann.access)
        opsets = {(o.domain if o.domain != "ai.onnx" else ""): o.version for o in model.opset_import}
        graph = model.graph
        self._declare_graph(graph)
        self._resolve_annotations(graph)
        self._walk(graph.node, _Scope(opsets), top=True)
        self._finish(graph)
        return self

    def _declare_graph(self, graph: onnx.GraphProto) -> None:
        """Declared types of a graph's inputs, initializers, value_info and outputs (recursively)."""
        for init in graph.initializer:
            t = ValueType(init.data_type, tuple(init.dims))
            self.set_type(init.name, t, f"initializer '{init.name}'")
            if (init.data_type in (TensorProto.INT64, TensorProto.INT32) and _small(init.dims)
                    and not any(e.key == "location" for e in init.external_data)):
                arr = _to_array(init)
                if arr is not None:
                    self.values[init.name] = arr
        for vi in (*graph.input, *graph.value_info, *graph.output):
            if vi.type.WhichOneof("value") is not None:
                self.set_type(vi.name, ValueType.from_proto(vi.type), f"the declared type of '{vi.name}'")
        for node in graph.node:
            for _, g in subgraphs(node):
                self._declare_graph(g)

    def _node_edges(self, graph: onnx.GraphProto, prefix: str, edges: dict, composite_claims: dict) -> None:
        for idx, node in enumerate(graph.node):
            label = prefix + (node.name or f"{node.op_type}#{idx}")
            if self._is_composite(node):
                self._composite_outputs.update(o for o in node.output if o)
            entries, problems, malformed = safe_node_aliases(node)  # Note [Op contract]
            if malformed:
                self.error("malformed", label, malformed)
            for p in problems:
                self.error("alias-contract", label, p)
            for na in entries:
                e = OutputAlias(na.output_index, na.input_index)
                if e.output_index >= len(node.output) or e.input_index >= len(node.input) \
                        or not node.output[e.output_index] or not node.input[e.input_index]:
                    self.error("alias-index", label,
                               f"output_alias '{e}' names output {e.output_index} and input {e.input_index}, but "
                               f"the node has {len(node.output)} outputs and {len(node.input)} inputs "
                               f"(empty names are absent optional ports)")
                    continue
                out, inp = node.output[e.output_index], node.input[e.input_index]
                if self._is_composite(node):
                    composite_claims.setdefault(label, []).append((node, e, out, inp))
                else:
                    why = f"output_alias {e}" if na.source == "annotation" else f"{node.op_type}'s contract {e}"
                    edges[out] = (inp, f"node '{label}' ({why})", label)
            for attr_name, g in subgraphs(node):
                self._node_edges(g, f"{label}/{attr_name}/", edges, composite_claims)

    def _alias_of_edges(self, graph: onnx.GraphProto, out: dict) -> None:
        for vi in (*graph.input, *graph.value_info, *graph.output):
            target = _get(vi.metadata_props, ALIAS_OF_KEY)
            if target is not None:
                out[vi.name] = target
        for node in graph.node:
            for _, g in subgraphs(node):
                self._alias_of_edges(g, out)

    def _is_composite(self, node: onnx.NodeProto) -> bool:
        return is_composite(node, self._functions)

    def _resolve_annotations(self, graph: onnx.GraphProto) -> None:
        """Steps 1-5 of Note [Alias classes] for the annotations."""
        edges: dict[str, tuple[str, str, str]] = {}  # output -> (input, why, node label)
        self._node_edges(graph, "", edges, self._claims)
        for v, t in self.assume_aliases.items():
            edges[v] = (t, f"the assumed alias '{v}' -> '{t}'", v)
        alias_of: dict[str, str] = {}
        self._alias_of_edges(graph, alias_of)

        # alias-cycle over both kinds of edge
        succ: dict[str, set[str]] = {}
        for v, (t, _, _) in edges.items():
            succ.setdefault(v, set()).add(t)
        for v, t in alias_of.items():
            succ.setdefault(v, set()).add(t)
        for claims in self._claims.values():
            for _node, _e, out, inp in claims:
                succ.setdefault(out, set()).add(inp)
        cyclic: set[str] = set()
        state: dict[str, int] = {}  # 1: on the current path, 2: done

        def report(cycle: list[str]) -> None:
            if not cyclic.intersection(cycle):
                k = cycle.index(min(cycle))  # start at the smallest name: one text per cycle
                text = cycle[k:] + cycle[:k] + [cycle[k]]
                self.error("alias-cycle", text[0], "alias annotations form a cycle: " + " -> ".join(text)
                           + "; every alias chain must end at the storage owner (a graph input)")
            cyclic.update(cycle)

        # Depth-first, iteratively (Note [Untrusted models]: a long alias chain is no recursion).
        for v0 in sorted(succ):
            if state.get(v0) is not None:
                continue
            path, pos = [v0], {v0: 0}
            stack = [iter(sorted(succ.get(v0, ())))]
            state[v0] = 1
            while stack:
                t = next(stack[-1], None)
                if t is None:
                    stack.pop()
                    done = path.pop()
                    del pos[done]
                    state[done] = 2
                    continue
                if state.get(t) == 1:
                    report(path[pos[t]:])
                elif state.get(t) is None:
                    state[t] = 1
                    pos[t] = len(path)
                    path.append(t)
                    stack.append(iter(sorted(succ.get(t, ()))))

        def chain_end(v: str) -> str:
            seen = set()
            while v in edges and v not in seen:
                seen.add(v)
                v = edges[v][0]
            return v

        claimed = {c[2] for cs in self._claims.values() for c in cs}
        for v, (t, why, _) in edges.items():
            if v not in cyclic:
                self._union(v, t, why)
        for v, t in alias_of.items():
            if v in cyclic:
                continue
            if v in edges:
                end = chain_end(v)
                if end != t:
                    self.error("alias-disagree", edges[v][2], f"alias_of says '{v}' is the storage of '{t}', but "
                               f"{edges[v][1]} makes it the storage of '{end}'; both annotations must name the "
                               f"same input")
                    continue
            if v in claimed or v in self._composite_outputs:
                self._deferred_alias_of[v] = t  # checked after the composite node's rule
                continue
            self._union(v, t, f"alias_of on '{v}'")

    def _walk(self, nodes, scope: _Scope, top: bool = False) -> set[str]:
        """Infer every node in order; return the names defined here (including nested bodies)."""
        defined: set[str] = set()
        for idx, node in enumerate(nodes):
            label = scope.prefix + (node.name or f"{node.op_type}#{idx}")
            self._walked += 1
            if self._walked > self._budget:  # calls of local functions are inlined: count every copy
                if not self._stopped:
                    self._stopped = True
                    self.error("limit", label, f"more than {self._budget} nodes to infer ({len(self._functions)} "
                               f"local function(s) inlined at each call, at most {MAX_INLINED} nodes beyond the "
                               f"model's own); inference stopped at node '{label}'")
                return defined
            if top:
                self.order.append((label, node))
            for o in node.output:
                if o:
                    self.producer[o] = label
                    self._outputs.append(o)
                    defined.add(o)
            defined |= self._infer_node(node, label, scope)
        return defined

    def _infer_node(self, node: onnx.NodeProto, label: str, scope: _Scope) -> set[str]:
        key = (node.domain, node.op_type)
        ins = [self.type_of(i) for i in node.input]
        nested: set[str] = set()
        if self._is_composite(node):
            before = len(self.findings)
            if key in self._functions:
                nested = self._call_function(node, label, scope)
            else:
                nested = getattr(self, "_rule_" + node.op_type)(node, label, scope, ins)
            failed = any(f.subject == label and f.severity == "error" for f in self.findings[before:])
            self._verify_claims(node, label, quiet=failed)
            return nested
        rule = OP_RULES.get(key)
        if rule is not None:
            outs = rule(self, node, label, ins)
        elif node.domain in ("", "ai.onnx"):
            outs = self._infer_standard(node, label, scope, ins)
        else:
            outs = None
            op = f"{node.domain}::{node.op_type}"
            if op not in self._warned_ops:
                self._warned_ops.add(op)
                self.warning("no-rule", label, f"no shape rule for op '{op}' (first seen at node '{label}'); "
                             f"its outputs stay untyped unless declared in value_info")
        for o, t in zip(node.output, outs or []):
            self.set_type(o, t, f"node '{label}' ({node.op_type})")
        if node.domain in ("", "ai.onnx"):
            self._propagate(node, scope)
        return nested

    def _verify_claims(self, node: onnx.NodeProto, label: str, quiet: bool = False) -> None:
        """Annotations on a composite node are claims: check them against what the rule derived
        (``quiet``: the rule already refused the node; its reason is the one to read)."""
        for _node, e, out, inp in self._claims.get(label, []):
            if self.root(out) != self.root(inp) and not quiet:
                self.error("alias-disagree", label, f"output_alias '{e}' says '{out}' is the storage of '{inp}', "
                           f"but the body makes '{out}' {self._describe(out)}")
        for o in node.output:
            t = self._deferred_alias_of.pop(o, None)
            if t is not None and self.root(o) != self.root(t) and not quiet:
                self.error("alias-disagree", o, f"alias_of says '{o}' is the storage of '{t}', but node '{label}' "
                           f"makes it {self._describe(o)}")

    def _describe(self, name: str) -> str:
        r = self.root(name)
        return f"the storage of '{r}'" if r != name else "a new value"

    # --- standard ops through onnx ----------------------------------------------------------------
    def _infer_standard(self, node, label, scope, ins):
        version = scope.opsets.get("", 0)
        try:
            schema = onnx.defs.get_schema(node.op_type, version, "")
        except onnx.defs.SchemaError:
            self.warning("no-rule", label, f"onnx has no schema for '{node.op_type}' at opset {version}")
            return None
        types, data = {}, {}
        for name, t in zip(node.input, ins):
            if not name:
                continue
            if not t.known:
                return self._data_rules(node, ins)
            types[name] = t.to_proto()
            if name in self.values and self.values[name].size <= SMALL:
                data[name] = numpy_helper.from_array(self.values[name], name)
        try:
            out = onnx.shape_inference.infer_node_outputs(
                schema, node, types, data, opset_imports=[helper.make_opsetid(d, v) for d, v in scope.opsets.items()])
        except Exception as exc:  # onnx raises InferenceError / ValidationError with its own text
            msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            self.error("shape", label, f"onnx shape inference rejects {node.op_type} with inputs "
                       f"{', '.join(f'{n}: {t}' for n, t in zip(node.input, ins) if n)}: {msg}")
            return None
        outs = [ValueType.from_proto(out[o]) if o in out else None for o in node.output]
        better = self._data_rules(node, ins)
        if better:
            outs = [b if b is not None else o for o, b in zip(outs, better)]
        return outs

    def _data_rules(self, node, ins):
        """Output shapes computed from symbolic shape values (Shape -> ... -> Reshape), which onnx's
        per-node inference cannot see."""
        op = node.op_type
        if op == "Reshape" and ins[0].shape is not None:
            target = self._dims_value(node.input[1])
            if target is None:
                return None
            entries, _ = target
            allowzero = _attr(node, "allowzero", 0)
            out = []
            for i, d in enumerate(entries):
                out.append(ins[0].shape[i] if d == 0 and not allowzero and i < len(ins[0].shape) else d)
            if -1 in out:
                k = out.index(-1)
                out[k] = _divide(list(ins[0].shape), [d for i, d in enumerate(out) if i != k])
            return [ValueType(ins[0].elem, tuple(out))]
        if op == "Range":
            start, limit, delta = (self._dims_value(n) for n in node.input[:3])
            if start and delta and limit and start[0] == [0] and delta[0] == [1]:
                return [ValueType(ins[1].elem, (limit[0][0],))]
            return None
        if op in ("ConstantOfShape", "Expand"):
            target = self._dims_value(node.input[-1] if op == "Expand" else node.input[0])
            if target is None:
                return None
            if op == "ConstantOfShape":
                v = _attr(node, "value")
                elem = v.data_type if v is not None else TensorProto.FLOAT
                return [ValueType(elem, tuple(target[0]))]
            if ins[0].shape is None:
                return None
            return [ValueType(ins[0].elem, _broadcast(self.table, ins[0].shape, tuple(target[0])))]
        return None

    def _small_outputs(self, node: onnx.NodeProto) -> bool:
        """Every output's shape is known and holds at most SMALL elements: the only nodes folded
        (Note [Untrusted models] in structure.py: ConstantOfShape of [12000, 12000] is never computed)."""
        for o in node.output:
            if not o:
                continue
            t = self.type_of(o)
            if not t.concrete() or not _small(t.shape):
                return False
        return True

    def _propagate(self, node: onnx.NodeProto, scope: _Scope) -> None:
        """Values of small int tensors (shape arithmetic) and bounds of integer values."""
        op, outs = node.op_type, list(node.output)
        if not outs or not outs[0]:
            return
        n_in = len(node.input)
        ins = list(node.input) + [""] * 3  # a malformed node may lack inputs its op reads
        out = outs[0]
        if op == "Constant":
            for a in node.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR and _small(a.t.dims):
                    arr = _to_array(a.t)
                elif a.name in ("value_int", "value_float") and a.type in (onnx.AttributeProto.INT,
                                                                          onnx.AttributeProto.FLOAT):
                    arr = np.array(helper.get_attribute_value(a))
                elif a.name in ("value_ints", "value_floats") and len(a.ints) + len(a.floats) <= SMALL:
                    arr = np.array(helper.get_attribute_value(a))
                else:
                    continue
                if arr is not None and arr.size <= SMALL:
                    self.values[out] = arr
            return
        if op == "Shape":
            t = self.type_of(ins[0])
            if t.shape is not None:
                dims = list(t.shape)
                start, end = _attr(node, "start", 0), _attr(node, "end", len(dims))
                if isinstance(start, int) and isinstance(end, int):
                    self._set_dims_value(out, dims[slice(start, end)], False)
            return
        if op == "Size":
            t = self.type_of(ins[0])
            if t.concrete():
                self.values[out] = np.array(int(np.prod(t.shape)), np.int64)
            return
        real = ins[:n_in]
        if all(i in self.values for i in real if i) and not subgraphs(node) and self._small_outputs(node):
            folded = _fold(node, {i: self.values[i] for i in real if i}, scope.opsets)
            if folded is not None:
                for name, arr in zip(outs, folded):
                    if name and arr is not None and np.asarray(arr).size <= SMALL:
                        self.values[name] = np.asarray(arr)
                return
        sym = [self._dims_value(i) if i else None for i in ins]
        if op in ("Identity", "Cast") and sym[0]:
            self._set_dims_value(out, *sym[0])
        elif op == "Gather" and sym[0] and ins[1] in self.values and _attr(node, "axis", 0) == 0:
            idx, entries = self.values[ins[1]], sym[0][0]
            if idx.ndim <= 1 and all(-len(entries) <= int(i) < len(entries) for i in idx.reshape(-1)):
                self._set_dims_value(out, [entries[int(i)] for i in idx.reshape(-1)], idx.ndim == 0)
        elif op == "Concat" and n_in and all(sym[:n_in]) and _attr(node, "axis", 0) == 0:
            self._set_dims_value(out, [d for s in sym[:n_in] for d in s[0]], False)
        elif op == "Unsqueeze" and sym[0] and sym[0][1]:
            self._set_dims_value(out, sym[0][0], False)
        elif op == "Squeeze" and sym[0] and len(sym[0][0]) == 1:
            self._set_dims_value(out, sym[0][0], True)
        elif op == "Slice" and sym[0] and all(i in self.values and self.values[i].size for i in ins[1:3]):
            s, e = int(self.values[ins[1]].reshape(-1)[0]), int(self.values[ins[2]].reshape(-1)[0])
            self._set_dims_value(out, sym[0][0][s:e], False)
        # bounds
        b = [self.bounds_of(i) if i else None for i in ins]
        if op in ("Identity", "Cast", "Unsqueeze", "Squeeze", "Reshape", "Expand", "Flatten") and b[0]:
            self.bounds[out] = b[0]
        elif op == "Add" and b[0] and b[1]:
            self.bounds[out] = (b[0][0] + b[1][0], b[0][1] + b[1][1])
        elif op == "Sub" and b[0] and b[1]:
            self.bounds[out] = (b[0][0] - b[1][1], b[0][1] - b[1][0])
        elif op in ("Min", "Max") and n_in and all(b[:n_in]):
            f = min if op == "Min" else max
            self.bounds[out] = (f(x[0] for x in b[:n_in]), f(x[1] for x in b[:n_in]))
        elif op == "Clip" and b[0]:
            lo, hi = b[0]
            if len(b) > 1 and b[1]:
                lo, hi = max(lo, b[1][0]), max(hi, b[1][0])
            if len(b) > 2 and b[2]:
                lo, hi = min(lo, b[2][1]), min(hi, b[2][1])
            self.bounds[out] = (lo, hi)

    # --- capacity ---------------------------------------------------------------------------------
    def check_capacity(self, label: str, op: str, position: str, n, capacity, cache: str, what: str) -> None:
        """``position + n <= capacity`` wherever the position is bounded and the dims are known.
        ``cache`` describes the storage for the message (quoted name and, for pages, the arithmetic)."""
        b = self.bounds_of(position)
        if b is None or not isinstance(capacity, int):
            return
        lo, hi = b
        if lo < 0:
            self.error("capacity", label, f"{op} node '{label}': {what} '{position}' may be {lo}; positions start at 0")
        n_min = n if isinstance(n, int) else 1
        if hi + n_min > capacity:
            source = (f"{what} '{position}' is {hi}" if lo == hi
                      else f"{what} '{position}' may reach {hi} (bounds [{lo}, {hi}])")
            n_text = f"n {n}" if isinstance(n, int) else f"n >= 1 ('{n}')"
            self.error("capacity", label,
                       f"{op} node '{label}': {source}; position {hi} + {n_text} = {hi + n_min} exceeds capacity "
                       f"{capacity} of {cache}. Remedy: a cache with capacity >= {hi + n_min}, or bound the "
                       f"position below {capacity - n_min + 1}")

    # --- control flow -----------------------------------------------------------------------------
    def _sub(self, graph, scope: _Scope, label: str, attr: str) -> tuple[set[str], _Scope]:
        sub = _Scope(scope.opsets, f"{label}/{attr}/")
        for vi in graph.input:
            self.producer.setdefault(vi.name, f"{label}/{attr}")
        defined = {vi.name for vi in graph.input} | {t.name for t in graph.initializer}
        self._depth += 1
        try:
            defined |= self._walk(graph.node, sub)
        finally:
            self._depth -= 1
        labels = [sub.prefix + (n.name or f"{n.op_type}#{i}") for i, n in enumerate(graph.node)]
        self.findings.extend(hazard_findings(list(graph.node), labels, self.root, {vi.name for vi in graph.output}))
        return defined, sub

    def _rule_If(self, node, label, scope, ins):
        then_g, else_g = _graph_attr(node, "then_branch"), _graph_attr(node, "else_branch")
        if then_g is None or else_g is None:
            self.error("shape", label, f"If node '{label}' lacks then_branch or else_branch")
            return set()
        d_then, _ = self._sub(then_g, scope, label, "then_branch")
        d_else, _ = self._sub(else_g, scope, label, "else_branch")
        for i, out in enumerate(node.output):
            if not out or i >= len(then_g.output) or i >= len(else_g.output):
                continue
            a, b = then_g.output[i].name, else_g.output[i].name
            ra, rb = self.root(a), self.root(b)
            a_store = ra not in d_then and self.is_storage_alias(ra)
            b_store = rb not in d_else and self.is_storage_alias(rb)
            ta, tb = self.type_of(a), self.type_of(b)
            if ta.elem is not None and tb.elem is not None and ta.elem != tb.elem:
                self.error("if-branch", label, f"If node '{label}' output {i} '{out}': then_branch returns "
                           f"'{a}' ({ta}) but else_branch returns '{b}' ({tb})")
            if a_store or b_store:
                if a_store and b_store and ra == rb:
                    self._union(out, ra, f"If node '{label}' (both branches return storage '{ra}')")
                    continue

                def say(branch, name, root, store):
                    return (f"{branch} returns '{name}', the storage of '{root}'" if store
                            else f"{branch} returns '{name}', a new value computed in the branch")
                self.error("if-branch", label,
                           f"If node '{label}' output {i} '{out}': {say('then_branch', a, ra, a_store)}, but "
                           f"{say('else_branch', b, rb, b_store)}; an aliased output may merge only when both "
                           f"branches resolve it to the same storage (update the cache in place in both branches, "
                           f"or return it unchanged)")
            self.set_type(out, join_types(self.table, ta, tb), f"If node '{label}'")
        return d_then | d_else

    def _carry(self, label, kind, init: str, body_in: str, body_out: str, final: str) -> None:
        """One loop-carried value: a cache keeps its storage across iterations or the model is refused."""
        if init and self.is_storage_alias(init) and self.root(body_in) == self.root(init):
            if self.root(body_out) == self.root(init):
                if final:
                    self._union(final, init, f"{kind} node '{label}' (carries '{init}' in place)")
                return
            self.error("loop-carry", label,
                       f"{kind} node '{label}' carries cache '{init}' as '{body_in}', but the body returns "
                       f"'{body_out}' for it, {self._describe(body_out)}: the next iteration would not see the "
                       f"same storage (a second cache per iteration); update '{body_in}' in place (CacheUpdate) "
                       f"and return that output")
        if final:
            t = self.type_of(body_out)
            if init:
                t = join_types(self.table, self.type_of(init), t)
            self.set_type(final, t, f"{kind} node '{label}'")

    def _pre_carry(self, label, kind, init: str, body_in: str) -> None:
        if not body_in:
            return
        if init and self.is_storage_alias(init):
            self._union(body_in, init, f"{kind} node '{label}' (loop-carried '{init}')")
        elif init:  # not a cache: its dims may change from one iteration to the next
            t = self.type_of(init)
            self.set_type(body_in, ValueType(t.elem, None if t.shape is None else (None,) * len(t.shape)),
                          f"{kind} node '{label}' (initial value '{init}')")

    def _rule_Loop(self, node, label, scope, ins):
        body = _graph_attr(node, "body")
        if body is None:
            self.error("shape", label, f"Loop node '{label}' has no body graph")
            return set()
        carried = list(node.input[2:])
        n = len(carried)
        if len(body.input) != n + 2 or len(body.output) < n + 1:
            self.error("shape", label, f"Loop node '{label}': the body has {len(body.input)} inputs and "
                       f"{len(body.output)} outputs for {n} loop-carried values (expected {n + 2} and >= {n + 1})")
            return set()
        self.set_type(body.input[0].name, ValueType(TensorProto.INT64, ()), f"Loop node '{label}'")
        trips = self.values.get(node.input[0]) if node.input and node.input[0] else None
        trip = int(trips.reshape(-1)[0]) if trips is not None and trips.size else None
        if trip is not None and trip > 0:  # the iteration number is bounded by the trip count
            self.bounds[body.input[0].name] = (0, trip - 1)
        self.set_type(body.input[1].name, ValueType(TensorProto.BOOL, ()), f"Loop node '{label}'")
        for j, init in enumerate(carried):
            self._pre_carry(label, "Loop", init, body.input[2 + j].name)
        defined, _ = self._sub(body, scope, label, "body")
        for j, init in enumerate(carried):
            final = node.output[j] if j < len(node.output) else ""
            self._carry(label, "Loop", init, body.input[2 + j].name, body.output[1 + j].name, final)
        for k, vo in enumerate(body.output[1 + n:]):
            if n + k < len(node.output) and node.output[n + k]:
                t = self.type_of(vo.name)
                self.set_type(node.output[n + k], ValueType(t.elem, None if t.shape is None else (trip, *t.shape)),
                              f"Loop node '{label}' (scan output)")
        return defined

    def _rule_Scan(self, node, label, scope, ins):
        body = _graph_attr(node, "body")
        m = _attr(node, "num_scan_inputs", 0)
        if body is None or not isinstance(m, int) or not 0 <= m <= len(node.input):
            self.error("shape", label, f"Scan node '{label}' needs a body graph and 0 <= num_scan_inputs <= "
                       f"{len(node.input)} (its inputs), not {m}")
            return set()
        states = list(node.input[:len(node.input) - m])
        scans = list(node.input[len(node.input) - m:])
        n = len(states)
        if len(body.input) != n + m or len(body.output) < n:
            self.error("shape", label, f"Scan node '{label}': the body has {len(body.input)} inputs and "
                       f"{len(body.output)} outputs for {n} states and {m} scan inputs (expected {n + m} and >= {n})")
            return set()
        in_axes, out_axes = _attr(node, "scan_input_axes", [0] * m), _attr(node, "scan_output_axes", [])
        in_axes = list(in_axes) if isinstance(in_axes, list) else []
        out_axes = list(out_axes) if isinstance(out_axes, list) else []
        for j, init in enumerate(states):
            self._pre_carry(label, "Scan", init, body.input[j].name)
        length = None
        for k, name in enumerate(scans):
            t = self.type_of(name)
            if t.shape and k < len(in_axes) and n + k < len(body.input):
                ax = in_axes[k] % len(t.shape)
                length = self.table.resolve(t.shape[ax]) if length is None else length
                self.set_type(body.input[n + k].name, ValueType(t.elem, t.shape[:ax] + t.shape[ax + 1:]),
                              f"Scan node '{label}' (slice of '{name}')")
            if n + k < len(body.input) and self.bounds_of(name) is not None:  # a slice stays in the input's range
                self.bounds[body.input[n + k].name] = self.bounds_of(name)
        defined, _ = self._sub(body, scope, label, "body")
        for j, init in enumerate(states):
            final = node.output[j] if j < len(node.output) else ""
            self._carry(label, "Scan", init, body.input[j].name, body.output[j].name, final)
        for k, vo in enumerate(body.output[n:]):
            if n + k < len(node.output) and node.output[n + k]:
                t = self.type_of(vo.name)
                if t.shape is not None:
                    ax = out_axes[k] % (len(t.shape) + 1) if k < len(out_axes) else 0
                    t = ValueType(t.elem, t.shape[:ax] + (length,) + t.shape[ax:])
                self.set_type(node.output[n + k], t, f"Scan node '{label}' (scan output)")
        return defined

    # --- local functions --------------------------------------------------------------------------
    def _call_function(self, node, label, scope) -> set[str]:
        """Infer a call of a model-local function by inlining its body under the call's names, so an
        in-place write of a parameter inside the body becomes an alias of the call's output."""
        f = self._functions[(node.domain, node.op_type)]
        if self._depth > 32:
            self.error("function-alias", label, f"local function '{f.name}' nests deeper than 32 calls (recursion?)")
            return set()
        rename = {}
        for i, p in enumerate(f.input):
            rename[p] = node.input[i] if i < len(node.input) else ""
        for j, r in enumerate(f.output):
            rename[r] = node.output[j] if j < len(node.output) else f"{label}/{r}"
        attrs = {a.name: a for a in f.attribute_proto}
        attrs.update({a.name: a for a in node.attribute})
        body = []
        for n in f.node:
            c = copy.deepcopy(n)
            c.input[:] = [rename.get(x, f"{label}/{x}") if x else "" for x in n.input]
            c.output[:] = [rename.get(x, f"{label}/{x}") if x else "" for x in n.output]
            kept = []
            for a in c.attribute:
                if a.ref_attr_name:
                    if a.ref_attr_name in attrs:
                        na = copy.deepcopy(attrs[a.ref_attr_name])
                        na.name = a.name
                        kept.append(na)
                else:
                    kept.append(a)
            del c.attribute[:]
            c.attribute.extend(kept)
            body.append(c)
        # value annotations inside the function (IR 10 FunctionProto.value_info)
        for vi in f.value_info:
            name = rename.get(vi.name, f"{label}/{vi.name}")
            if vi.type.WhichOneof("value") is not None:
                self.set_type(name, ValueType.from_proto(vi.type), f"function '{f.name}' value_info")
        opsets = dict(scope.opsets)
        opsets.update({(o.domain if o.domain != "ai.onnx" else ""): o.version for o in f.opset_import})
        # in-place writes inside the body: their output_alias entries are edges under the new names
        for c in body:
            if self._is_composite(c):
                continue
            for e in safe_node_aliases(c)[0]:
                if e.output_index < len(c.output) and e.input_index < len(c.input):
                    self._union(c.output[e.output_index], c.input[e.input_index],
                                f"node '{label}/{c.name}' in function '{f.name}'")
        self._depth += 1
        try:
            defined = self._walk(body, _Scope(opsets, f"{label}/"))
        finally:
            self._depth -= 1
        for vi in f.value_info:
            target = _get(vi.metadata_props, ALIAS_OF_KEY)
            if target is not None and vi.name in rename:
                out, want = rename[vi.name], rename.get(target, target)
                if self.root(out) != self.root(want):
                    self.error("function-alias", label, f"function '{f.name}' annotates '{vi.name}' alias_of "
                               f"'{target}', but its body makes it {self._describe(out)}")
        self._function_claims(node, label, f)
        return defined

    def _function_claims(self, node, label, f) -> None:
        for _node, e, out, inp in self._claims.pop(label, []):
            if self.root(out) != self.root(inp):
                self.error("function-alias", label,
                           f"call '{label}' declares output_alias '{e}' ('{out}' is the storage of '{inp}'), but "
                           f"function '{f.name}' returns '{f.output[e.output_index]}' as "
                           f"{self._describe(out)}; "
                           f"the body must update parameter '{f.input[e.input_index]}' in place and return it")

    # --- after the walk ---------------------------------------------------------------------------
    def _finish(self, graph: onnx.GraphProto) -> None:
        for v, t in sorted(self._deferred_alias_of.items()):
            if self.root(v) != self.root(t):
                self.error("alias-disagree", v, f"alias_of says '{v}' is the storage of '{t}', but its producer "
                           f"makes it {self._describe(v)}")
        self._hazards()
        missing = self.untyped()
        if missing:
            shown = ", ".join(f"'{m}'" for m in missing[:8])
            self.warning("untyped", "model", f"{len(missing)} value(s) have no element type or rank: {shown}"
                         f"{' ...' if len(missing) > 8 else ''}")

    def _hazards(self) -> None:
        """alias-hazard for every top-level writer, composite ones (If/Loop/Scan, calls) included."""
        outputs = {vi.name for vi in self.model.graph.output}
        self.findings.extend(hazard_findings([n for _, n in self.order], [lbl for lbl, _ in self.order], self.root,
                                             outputs))

    def summary(self, limit: int = 4) -> str:
        typed, total = self.counts()
        cls = self.classes()
        lines = [f"values typed: {typed}/{total} node outputs; alias classes: {len(cls)}"]
        for r, members in sorted(cls.items())[:limit]:
            lines.append(f"  {r}: {self.type_of(r)} <- {', '.join(m for m in members if m != r)}")
        if len(cls) > limit:
            lines.append(f"  ... {len(cls) - limit} more")
        return "\n".join(lines)


# --- helpers -------------------------------------------------------------------------------------------

def _graph_attr(node: onnx.NodeProto, name: str):
    """Attribute ``name`` of ``node`` when it is a graph, else None (a malformed model)."""
    for a in node.attribute:
        if a.name == name:
            return a.g if a.type == onnx.AttributeProto.GRAPH else None
    return None


def _small(dims) -> bool:
    """A tensor of these dims holds at most SMALL elements (decided from the dims, before any data)."""
    n = 1
    for d in dims:
        if d < 0:
            return False
        n *= d
        if n > SMALL:
            return False
    return True


def _to_array(t: onnx.TensorProto):
    """The contents of a small tensor, or None when they do not match its dims (a malformed model)."""
    try:
        arr = numpy_helper.to_array(t)
    except Exception:  # truncated raw_data, a wrong count of values, an unknown data_type
        return None
    return arr if arr.size <= SMALL else None


def _divide(num: list, den: list):
    """The dim d with prod(num) == d * prod(den) when it can be named (a number or one symbol)."""
    num, den = list(num), list(den)
    for d in list(den):
        if not isinstance(d, int) and d in num:
            num.remove(d)
            den.remove(d)
    if any(d is None for d in num + den) or any(not isinstance(d, int) for d in den):
        return None
    syms = [d for d in num if not isinstance(d, int)]
    n_int = int(np.prod([d for d in num if isinstance(d, int)] or [1]))
    d_int = int(np.prod(den or [1]))
    if d_int == 0 or n_int % d_int:
        return None
    q = n_int // d_int
    if not syms:
        return q
    return syms[0] if len(syms) == 1 and q == 1 else None


def _broadcast(table: DimTable, a: tuple, b: tuple) -> tuple:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        x, y = table.resolve(x), table.resolve(y)
        out.append(y if x == 1 else x if y == 1 else x if x == y else x if y is None else y if x is None else None)
    return tuple(out)


def _fold(node: onnx.NodeProto, values: dict[str, np.ndarray], opsets: dict[str, int]):
    """Evaluate one standard node on known small inputs with onnx's reference evaluator."""
    from onnx.reference import ReferenceEvaluator

    if node.op_type in ("RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial"):
        return None
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(values[n].dtype), values[n].shape)
              for n in dict.fromkeys(i for i in node.input if i)]
    outputs = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in node.output if o]
    g = helper.make_graph([node], "fold", inputs, outputs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opsets.get("", 17))])
    try:
        res = ReferenceEvaluator(m).run(None, {n: values[n] for n in dict.fromkeys(i for i in node.input if i)})
    except Exception:  # a value the reference evaluator cannot compute stays unknown
        return None
    it = iter(res)
    return [next(it) if o else None for o in node.output]


def share_buffer_aliases(model: onnx.ModelProto) -> dict[str, str]:
    """The aliases onnxruntime-genai's past_present_share_buffer makes at run time: every
    GroupQueryAttention's present key/value (outputs 1, 2) is bound to its past key/value buffer
    (inputs 3, 4). Pass them as ShapesContext(assume_aliases=...) to plan a GenAI share-buffer model."""
    out = {}
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft":
            for o, i in ((1, 3), (2, 4)):
                if o < len(node.output) and i < len(node.input) and node.output[o] and node.input[i]:
                    out[node.output[o]] = node.input[i]
    return out


def infer_shapes(model: onnx.ModelProto, dims: dict[str, int] | None = None,
                 bounds: dict[str, tuple[int, int]] | None = None, strict: bool = True,
                 assume_aliases: dict[str, str] | None = None) -> ShapesContext:
    """Run ShapesContext on ``model``; with ``strict`` raise GraphCheckError on any error."""
    ctx = ShapesContext(model, dims, bounds, assume_aliases).infer()
    return ctx.raise_for_errors() if strict else ctx
