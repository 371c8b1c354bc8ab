"""The alias checker: the model-level guard for Note [Aliasing CacheUpdate output]
(custom_ops/ort/cache_update_op.cc). ORT writes through a declared alias without ordering or
ownership checks, so the rules below must hold before a model runs:

  alias-index     an output_alias entry names ports the node has
  alias-contract  an ortkv node's output_alias agrees with its op contract (Note [Op contract]): the
                  aliases of ortkv ops come from the op, annotated or not
  alias-cycle     alias_of annotations never form a cycle
  alias-target    alias_of names a graph input marked READ_WRITE
  alias-initializer  no alias (node or value annotation) resolves to an initializer
  alias-readonly  a node's in-place write (annotated, or by an ortkv op's contract) resolves to a
                  READ_WRITE graph input (or an intermediate)
  alias-disagree  a node's output_alias and its output's alias_of name the same input, and neither
                  exists without the other on a graph output
  alias-hazard    every other reader of a pre-update name runs before the write (is an ancestor of
                  the writing node), and the pre-update name is not itself a graph output
  ir-version      annotations need IR >= 10; ORT loads IR <= 13
  malformed, limit  the model lacks the structure ONNX requires, or is above a cap (structure.py,
                  Note [Untrusted models]); no other rule runs then
  internal        a failure no rule foresaw, as a finding instead of an exception
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from ..errors import GraphCheckError
from .annotations import MAX_IR_VERSION, MIN_IR_VERSION, Access, read_annotations
from .op_contract import safe_node_aliases


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" or "warning"
    rule: str
    subject: str  # the node or value the finding is about
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: [{self.rule}] {self.subject}: {self.message}"


def _node_label(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}#{index}"


def internal_finding(exc: BaseException, what: str) -> Finding:
    """The last line of defence for an untrusted model (Note [Untrusted models] in structure.py): a
    failure the rules did not foresee becomes one error finding instead of an exception."""
    text = " ".join(str(exc).split())[:300] or type(exc).__name__
    return Finding("error", "internal", "model", f"{what} could not analyse this model ({type(exc).__name__}: "
                   f"{text}); the model is probably malformed (onnx.checker.check_model may say how)")


def check_aliases(model: onnx.ModelProto) -> list[Finding]:
    """Return every finding; the model is not modified. A model without the structure ONNX requires
    gets only ``malformed`` / ``limit`` findings (structure.py)."""
    from .structure import is_fatal, structure_findings

    try:
        findings = structure_findings(model)
        if is_fatal(findings):
            return findings
        return findings + _check_aliases(model)
    except (RecursionError, ValueError, TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError,
            OverflowError) as exc:
        return [internal_finding(exc, "the alias checker")]


def _check_aliases(model: onnx.ModelProto) -> list[Finding]:
    graph = model.graph
    findings: list[Finding] = []

    def error(rule, subject, message):
        findings.append(Finding("error", rule, subject, message))

    try:
        ann = read_annotations(model)
    except GraphCheckError as exc:
        return [Finding("error", "malformed", "model", str(exc))]

    inputs = {vi.name for vi in graph.input}
    initializers = {t.name for t in graph.initializer} | {t.name for t in graph.sparse_initializer}
    outputs = {vi.name for vi in graph.output}
    annotated = bool(ann.access or ann.alias_of or ann.node_aliases)
    if annotated and model.ir_version < MIN_IR_VERSION:
        error("ir-version", "model", f"IR version {model.ir_version} has no metadata_props on values and nodes; "
              f"alias annotations need IR >= {MIN_IR_VERSION} (set model.ir_version = {MIN_IR_VERSION})")
    if model.ir_version > MAX_IR_VERSION:
        findings.append(Finding("warning", "ir-version", "model",
                                f"IR version {model.ir_version} > {MAX_IR_VERSION}: onnxruntime 1.31 refuses to load it"))

    # alias-cycle: follow alias_of from every value.
    # Each value has one alias_of, so one walk per unvisited start finds every cycle in linear time.
    in_cycle: set[str] = set()
    done: set[str] = set()
    for start in ann.alias_of:
        path, pos, cur = [], {}, start
        while cur in ann.alias_of and cur not in done and cur not in pos:
            pos[cur] = len(path)
            path.append(cur)
            cur = ann.alias_of[cur]
        done.update(path)
        if cur in pos:
            cycle = path[pos[cur]:]
            in_cycle.update(cycle)
            k = cycle.index(min(cycle))  # start at the smallest name: one text per cycle
            cycle = cycle[k:] + cycle[:k] + [cycle[k]]
            error("alias-cycle", cycle[0], "alias_of annotations form a cycle: " + " -> ".join(cycle))

    # alias-target / alias-initializer for value annotations.
    for value, target in ann.alias_of.items():
        if value in in_cycle:
            continue
        if target in initializers:
            error("alias-initializer", value, f"alias_of names '{target}', an initializer; an initializer is "
                  "read-only model state and must never be written in place")
        elif target not in inputs:
            error("alias-target", value, f"alias_of names '{target}', which is not a graph input "
                  f"(graph inputs: {sorted(inputs)})")
        elif ann.access.get(target) is not Access.READ_WRITE:
            acc = ann.access.get(target)
            error("alias-target", value, f"alias_of names graph input '{target}', which is "
                  f"{acc.value if acc else 'not annotated'}; mark it access=READ_WRITE to update it in place")

    # Node aliases: resolve each written value to its root through earlier in-place writes.
    producer: dict[str, tuple[int, int]] = {}  # value -> (node index, output index)
    for idx, node in enumerate(graph.node):
        for o, name in enumerate(node.output):
            if name:
                producer[name] = (idx, o)
    node_alias_of_output: dict[str, str] = {}  # written output name -> pre-update input name
    from_contract: dict[str, str] = {}  # written output name -> the op that makes it an alias (no annotation)
    for idx, node in enumerate(graph.node):
        label = _node_label(node, idx)
        entries, problems, malformed = safe_node_aliases(node)
        if malformed:
            error("malformed", label, malformed)
        for p in problems:
            error("alias-contract", label, p)
        annotated_outs = {e.output_index for e in entries if e.source == "annotation"}
        annotated_outs |= {e.output_index for e in (ann.node_aliases.get(idx) or [])}
        for e in entries:
            if e.output_index >= len(node.output) or e.input_index >= len(node.input) \
                    or not node.output[e.output_index] or not node.input[e.input_index]:
                error("alias-index", label, f"output_alias '{e.output_index}:{e.input_index}:MUST_ALIAS' names "
                      f"output {e.output_index} / input {e.input_index} but the node has {len(node.output)} "
                      f"outputs and {len(node.input)} inputs")
                continue
            out = node.output[e.output_index]
            node_alias_of_output[out] = node.input[e.input_index]
            if e.source == "contract" and e.output_index not in annotated_outs:
                from_contract[out] = node.op_type

    roots: dict[str, str] = {}  # memo: a chain of n in-place writes costs O(n), not O(n^2)

    def root_of(value: str) -> str:
        path, seen = [], set()
        while value in node_alias_of_output and value not in seen and value not in roots:
            seen.add(value)
            path.append(value)
            value = node_alias_of_output[value]
        root = roots.get(value, value)
        for v in path:
            roots[v] = root
        return root

    for out_name, in_name in node_alias_of_output.items():
        idx, _ = producer[out_name]
        label = _node_label(graph.node[idx], idx)
        root = root_of(in_name)
        how = (f" ({from_contract[out_name]} always writes output '{out_name}' into its input '{in_name}': the op "
               f"contract, annotated or not)" if out_name in from_contract else "")
        unsafe = False
        if root in initializers:
            unsafe = True
            error("alias-initializer", label, f"writes '{out_name}' in place into '{root}', an initializer; "
                  f"initializers are shared read-only model state (the write would persist across runs){how}. "
                  f"Remedy: make '{root}' a graph input marked READ_WRITE (ortkv.graph.mark_mutable)")
        elif root in inputs and ann.access.get(root) is not Access.READ_WRITE:
            unsafe = True
            acc = ann.access.get(root)
            error("alias-readonly", label, f"writes '{out_name}' in place into graph input '{root}', which is "
                  f"{acc.value if acc else 'not annotated'}{how}; mark it access=READ_WRITE "
                  f"(ortkv.graph.mark_mutable)")
        declared = ann.alias_of.get(out_name)
        if declared is not None and declared != root and out_name not in in_cycle:
            error("alias-disagree", label, f"output_alias says '{out_name}' is the storage of '{root}' "
                  f"(through input '{in_name}') but value '{out_name}' says alias_of '{declared}'")
        if declared is None and out_name in outputs and not unsafe:
            source = f"its op contract ({from_contract[out_name]})" if out_name in from_contract else "output_alias"
            error("alias-disagree", out_name, f"graph output '{out_name}' is written in place by node '{label}' "
                  f"({source}) but carries no alias_of='{root}'; annotate both or neither "
                  f"(ortkv.graph.set_alias_of(model, '{out_name}', '{root}'))")
    local_functions = {(f.domain, f.name) for f in model.functions}
    for value, target in ann.alias_of.items():
        src = producer.get(value)
        if src and is_composite(graph.node[src[0]], local_functions):
            continue  # a composite node's aliases come from its bodies: ShapesContext derives and checks them
        if value in outputs and value not in node_alias_of_output and value not in in_cycle:
            who = _node_label(graph.node[src[0]], src[0]) if src else "no node"
            error("alias-disagree", value, f"alias_of says '{value}' is the storage of '{target}' but its producer "
                  f"({who}) declares no output_alias for it; annotate both or neither")

    # static-tables: a PagedCacheAttention node's static_tables = 1 promises that no node writes its directory,
    # page table or page_fill (Note [Paged CUDA static tables] in custom_ops/kernels/cuda/paged_cuda.cu): each must
    # be a graph input or initializer of the model's graph that no node (in any body, or in place) writes
    written_roots = {root_of(o) for o in node_alias_of_output}
    every: list[tuple[onnx.NodeProto, str]] = []  # every node of the graph and of its bodies, with its label

    def collect(nodes, where):
        for i, n in enumerate(nodes):
            every.append((n, _node_label(n, i) + where))
            for attr, body in subgraphs(n):
                collect(body.node, f" (in {_node_label(n, i)}.{attr})")

    collect(graph.node, "")
    made_by = {o: label for n, label in every for o in n.output if o}
    for node, label in every:
        if node.op_type != "PagedCacheAttention" or node.domain != "ortkv":
            continue
        if not any(a.name == "static_tables" and a.i == 1 for a in node.attribute):
            continue
        for port, i in (("directory", 2), ("page_table", 3), ("page_fill", 5)):
            name = node.input[i] if i < len(node.input) else ""
            if not name:
                continue
            promise = f"static_tables = 1 promises that no node writes its {port} '{name}', but "
            if name in made_by:
                error("static-tables", label, promise + f"node '{made_by[name]}' computes it. Remedy: feed "
                      f"'{name}' as a graph input or initializer, or drop static_tables (the CUDA kernels then "
                      "read the tables again after the kernel before ends)")
            elif name in written_roots:
                error("static-tables", label, promise + f"a node writes graph input '{name}' in place. "
                      "Remedy: drop static_tables")
            elif name not in inputs and name not in initializers:
                error("static-tables", label, promise + f"'{name}' is not a graph input or initializer of the "
                      "model's graph. Remedy: feed it as one, or drop static_tables")

    # alias-hazard: readers of a pre-update name must be ancestors of the writer.
    labels = [_node_label(n, i) for i, n in enumerate(graph.node)]
    findings.extend(hazard_findings(list(graph.node), labels, root_of, outputs))
    return findings


def check_model(model: onnx.ModelProto) -> list[Finding]:
    """Raise GraphCheckError listing every error; return the warnings."""
    findings = check_aliases(model)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise GraphCheckError(
            f"{len(errors)} alias annotation error(s):\n" + "\n".join(f"  {f}" for f in errors), findings=errors
        )
    return findings


COMPOSITE = ("If", "Loop", "Scan")


def subgraphs(node: onnx.NodeProto) -> list[tuple[str, onnx.GraphProto]]:
    """(attribute name, body) for every graph-valued attribute of ``node`` (If branches, Loop/Scan body)."""
    return [(a.name, g) for a in node.attribute
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs))]


def is_composite(node: onnx.NodeProto, local_functions) -> bool:
    """If/Loop/Scan or a call of a model-local function: its aliases come from its bodies, not its
    annotations (ShapesContext derives them and checks any annotation as a claim)."""
    return ((node.domain in ("", "ai.onnx") and node.op_type in COMPOSITE)
            or (node.domain, node.op_type) in local_functions)


def outer_reads(node: onnx.NodeProto) -> set[str]:
    """Names a node's bodies (If/Loop/Scan subgraphs) read from the enclosing scope."""
    reads: set[str] = set()
    for _, g in subgraphs(node):
        local = {vi.name for vi in g.input} | {t.name for t in g.initializer}
        local.update(o for n in g.node for o in n.output if o)
        for n in g.node:
            reads.update(i for i in (*n.input, *outer_reads(n)) if i and i not in local)
        reads.update(vi.name for vi in g.output if vi.name not in local)
    return reads


def hazard_findings(nodes: list[onnx.NodeProto], labels: list[str], root, outputs: set[str]) -> list[Finding]:
    """alias-hazard. A node whose output is the storage of one of the names it reads (its inputs, or
    what its bodies read) overwrites that pre-update name in place, so every other reader of the name
    must run before it (be an ancestor of the writer), and the name must not be a graph output.
    ``root`` maps a value name to its storage root (the annotations' chain, or ShapesContext.root)."""
    findings: list[Finding] = []
    made = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    reads = [{i for i in n.input if i} | outer_reads(n) for n in nodes]
    readers: dict[str, list[int]] = {}
    for i, names in enumerate(reads):
        for name in names:
            readers.setdefault(name, []).append(i)
    for w, node in enumerate(nodes):
        written = {root(o): o for o in node.output if o and root(o) != o}
        if not written:
            continue
        before = None  # the writer's ancestors, computed only when another reader needs them

        def ancestors(w=w):
            seen, stack = set(), [w]
            while stack:
                for name in reads[stack.pop()]:
                    p = made.get(name)
                    if p is not None and p not in seen:
                        seen.add(p)
                        stack.append(p)
            return seen

        for pre in sorted(reads[w]):
            out = written.get(root(pre))
            if out is None or pre == out:
                continue
            for r in readers.get(pre, []):
                if r != w and before is None:
                    before = ancestors()
                if r != w and r not in before:
                    findings.append(Finding(
                        "error", "alias-hazard", labels[r],
                        f"reads '{pre}', which node '{labels[w]}' overwrites in place (as '{out}'), and nothing "
                        f"orders the read before the write; read '{out}' instead, or make '{labels[w]}' depend on it"))
            if pre in outputs:
                findings.append(Finding(
                    "error", "alias-hazard", pre, f"graph output '{pre}' is the pre-update name of a cache that node "
                    f"'{labels[w]}' overwrites in place; expose '{out}' instead"))
    return findings
