"""What the checker assumes of a model before it looks at aliases and shapes, checked first and cheaply,
so that an untrusted model (``ortkv check`` on a file from anywhere) gets findings, not an exception.

Note [Untrusted models]
~~~~~~~~~~~~~~~~~~~~~~~
The checker reads models it did not write. Every walk here is iterative (an explicit stack, never
Python recursion: a 3,000-update alias chain or a deeply nested If must not hit the recursion limit),
every amount of work is capped before it is done (MAX_NODES nodes in all graphs and functions,
MAX_DEPTH nested subgraphs, MAX_INLINED nodes inferred beyond the model's own where local functions are
inlined at each call, and ShapesContext folds a constant only when its output is known to
hold at most SMALL elements *before* computing it), and a model that breaks the structure ONNX
requires (no IR version: an empty or non-ONNX file; no graph outputs; a node reading a name nothing
defined before it; a name defined twice; a negative dim; an attribute of an undefined type) gets
``malformed`` findings and no further analysis, since every later rule assumes that structure.
A cap that is hit is a ``limit`` finding naming the number and the cap.
"""

from __future__ import annotations

import onnx

MAX_NODES = 200_000  # nodes in the main graph, all subgraphs and all local functions
MAX_INLINED = 20_000  # nodes ShapesContext infers beyond the model's own (calls of local functions inlined)
MAX_DEPTH = 64  # subgraphs nested inside subgraphs
MAX_FINDINGS = 20  # malformed findings reported per model (the first ones; the count is given)
FATAL = ("malformed", "limit")


def _attr_graphs(node: onnx.NodeProto):
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.name, a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            for g in a.graphs:
                yield a.name, g


def _repeated(fd) -> bool:
    rep = getattr(fd, "is_repeated", None)  # newer protobuf; older ones only have ``label``
    return bool(rep) if rep is not None else fd.label == fd.LABEL_REPEATED


def _invalid_text(model: onnx.ModelProto) -> str | None:
    """The first string field that is not text: protobuf hands proto2 string fields holding invalid
    UTF-8 back as bytes, and every name comparison would then fail. Iterative over all messages."""
    stack = [("model", model)]
    while stack:
        path, msg = stack.pop()
        for fd, value in msg.ListFields():
            if fd.type == fd.TYPE_STRING:
                items = value if _repeated(fd) else [value]
                if not all(isinstance(v, str) for v in items):
                    return f"{path}.{fd.name}"
            elif fd.type == fd.TYPE_MESSAGE:
                items = value if _repeated(fd) else [value]
                stack.extend((f"{path}.{fd.name}", v) for v in items)
    return None


def count_nodes(model: onnx.ModelProto) -> int:
    """Nodes of the main graph and all its subgraphs (iterative)."""
    total, stack = 0, [model.graph]
    while stack:
        g = stack.pop()
        total += len(g.node)
        for node in g.node:
            stack.extend(sg for _, sg in _attr_graphs(node))
    return total


def _label(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}#{index}"


def structure_findings(model: onnx.ModelProto) -> list:
    """``malformed`` / ``limit`` findings (all errors); empty when the model has the structure the
    checker relies on."""
    from .checker import Finding

    out: list[Finding] = []
    extra = 0

    def bad(rule: str, subject: str, message: str) -> None:
        nonlocal extra
        if len(out) < MAX_FINDINGS:
            out.append(Finding("error", rule, subject, message))
        else:
            extra += 1

    if model.ir_version <= 0:
        bad("malformed", "model", "the model has no IR version: the file is empty or not an ONNX model "
            "(onnx.load parses any bytes that happen to be valid protobuf)")
        return out
    if not model.HasField("graph"):
        bad("malformed", "model", "the model has no graph")
        return out
    where = _invalid_text(model)
    if where:
        bad("malformed", "model", f"{where} is not valid UTF-8 text (a corrupted file?)")
        return out
    if not model.opset_import:
        bad("malformed", "model", "the model imports no opset (opset_import is empty); every ONNX model names "
            "the opset of its default domain")
    if not model.graph.output:
        bad("malformed", "model", "the main graph has no outputs; an ONNX graph produces at least one")

    # Count first (cheap, iterative): nothing else runs over a model above the caps.
    total, stack = 0, [(model.graph, 0)]
    stack.extend((f, 0) for f in model.functions)
    while stack:
        g, depth = stack.pop()
        total += len(g.node)
        if total > MAX_NODES:
            bad("limit", "model", f"the model has more than {MAX_NODES} nodes (graphs, subgraphs and functions "
                "together); ortkv check does not analyse models that large")
            return out
        if depth > MAX_DEPTH:
            bad("limit", "model", f"subgraphs nest deeper than {MAX_DEPTH} levels; ortkv check does not analyse "
                "models nested that deep")
            return out
        for node in g.node:
            stack.extend((sg, depth + 1) for _, sg in _attr_graphs(node))

    # Names: every node input is defined before the node (graph inputs, initializers, earlier nodes,
    # the enclosing scopes); no name is defined twice in one graph; declared dims are >= 0.
    def check_graph(g, outer: frozenset, where: str, is_function: bool):
        defined = set()
        if is_function:
            defined.update(g.input)
        else:
            for vi in g.input:
                defined.add(vi.name)
            for t in g.initializer:
                if any(d < 0 for d in t.dims):
                    bad("malformed", t.name, f"initializer '{t.name}'{where} has a negative dim {list(t.dims)}")
                defined.add(t.name)
            for t in g.sparse_initializer:
                defined.add(t.values.name)
            for vi in (*g.input, *g.output, *g.value_info):
                tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
                if tt is not None and tt.HasField("shape") and any(
                        d.HasField("dim_value") and d.dim_value < 0 for d in tt.shape.dim):
                    bad("malformed", vi.name, f"'{vi.name}'{where} is declared with a negative dim")
        subs = []
        for i, node in enumerate(g.node):
            label = _label(node, i)
            if not node.op_type:
                bad("malformed", label, f"node {i}{where} has no op_type")
            for name in node.input:
                if name and name not in defined and name not in outer:
                    bad("malformed", label, f"node '{label}'{where} reads '{name}', which no graph input, "
                        "initializer or earlier node defines (a missing input, or nodes out of order)")
            for a in node.attribute:
                if a.type == onnx.AttributeProto.UNDEFINED and not a.ref_attr_name:
                    bad("malformed", label, f"node '{label}'{where}: attribute '{a.name}' has no type")
            for _, sg in _attr_graphs(node):
                subs.append((sg, label))
            for name in node.output:
                if not name:
                    continue
                if name in defined:
                    bad("malformed", label, f"node '{label}'{where} defines '{name}', which is already defined "
                        "(an ONNX graph defines each name once)")
                defined.add(name)
        if not is_function:
            for vi in g.output:
                if vi.name and vi.name not in defined and vi.name not in outer:
                    bad("malformed", vi.name, f"graph output '{vi.name}'{where} is not defined by any input, "
                        "initializer or node")
        return defined, subs

    work = [(model.graph, frozenset(), "", False)]
    work.extend((f, frozenset(), f" in function '{f.name}'", True) for f in model.functions)
    while work:
        g, outer, where, is_function = work.pop()
        defined, subs = check_graph(g, outer, where, is_function)
        inner = outer | defined
        for sg, label in subs:
            work.append((sg, inner, f" in a body of node '{label}'{where}", False))
    if extra:
        out.append(Finding("error", "malformed", "model", f"... and {extra} more structural problem(s)"))
    return out


def is_fatal(findings) -> bool:
    return any(f.rule in FATAL and f.severity == "error" for f in findings)
