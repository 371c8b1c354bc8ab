"""Peak-memory plan of a model with mutable caches, from ShapesContext's types and alias classes.

Note [Memory plan]
~~~~~~~~~~~~~~~~~~
One buffer per alias class (ShapesContext.root): a cache and all its in-place updates are one buffer,
so an in-place update adds zero bytes. Buffers live from the step that produces the first member to
the last step that reads any member (a read inside an If/Loop/Scan body counts at that node); graph
outputs live to the end; graph inputs and initializers live throughout, and a READ_WRITE cache is
persistent: counted once, never released and never reused. Steps are the top-level nodes in model
order (a topological order; ORT may schedule differently). No buffer is shared between values that
are not declared aliases: ORT's own reuse of dead buffers can only lower the transient part, never
the caches. An op that declares a workspace (op_rules.WORKSPACE) adds it during its own step.
The plan is of a run the way MutableCacheSession makes it: each aliased graph output bound to its
cache's storage. ORT alone never makes a graph output alias an input (facts/ORT.md); through a plain
session.run the output would be a fresh buffer, and CacheUpdate refuses to run rather than use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import GraphCheckError
from .annotations import Access
from .op_rules import WORKSPACE
from .checker import outer_reads

KINDS = ("cache", "input", "initializer", "output", "activation")


@dataclass
class Buffer:
    root: str
    names: list[str]
    nbytes: int
    kind: str  # one of KINDS
    birth: int  # step index; -1: before the first node
    death: int  # last step it is live; len(steps): to the end


@dataclass
class MemoryPlan:
    peak_bytes: int
    peak_step: int
    peak_node: str
    workspace_at_peak: int
    live_at_peak: list[Buffer]
    buffers: list[Buffer]
    in_place: list[tuple[str, str, str]]  # (node, output, storage root)
    steps: list[tuple[str, int]] = field(default_factory=list)  # (node, live bytes incl. workspace)

    def bytes_by_kind(self, at_peak: bool = False) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for b in (self.live_at_peak if at_peak else self.buffers):
            out[b.kind] += b.nbytes
        return out

    def format(self, top: int = 10) -> str:
        k = self.bytes_by_kind(at_peak=True)
        lines = [
            f"memory plan: peak {_mib(self.peak_bytes)} at step {self.peak_step + 1}/{len(self.steps)} "
            f"(node '{self.peak_node}')",
            f"  live at peak: caches {_mib(k['cache'])}, inputs {_mib(k['input'])}, initializers "
            f"{_mib(k['initializer'])}, outputs {_mib(k['output'])}, activations {_mib(k['activation'])}, "
            f"workspace {_mib(self.workspace_at_peak)}",
            f"  in-place updates: {len(self.in_place)} (0 extra bytes each)",
            f"  peak above initializers: {_mib(self.peak_bytes - k['initializer'])}",
            f"  largest live values at peak (besides {sum(b.kind == 'initializer' for b in self.live_at_peak)} "
            f"initializers):",
        ]
        rest = sorted((b for b in self.live_at_peak if b.kind != "initializer"), key=lambda b: (-b.nbytes, b.root))
        for b in rest[:top]:
            extra = f" (+{len(b.names) - 1} alias{'es' if len(b.names) > 2 else ''})" if len(b.names) > 1 else ""
            lines.append(f"    {_mib(b.nbytes):>12}  {b.kind:<11} {b.root}{extra}")
        if len(rest) > top:
            lines.append(f"    {_mib(sum(b.nbytes for b in rest[top:])):>12}  ... {len(rest) - top} more")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes, "peak_step": self.peak_step, "peak_node": self.peak_node,
            "workspace_at_peak": self.workspace_at_peak, "in_place": len(self.in_place),
            "live_at_peak": self.bytes_by_kind(at_peak=True),
        }


def _mib(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    if n < 1 << 20:
        return f"{n / 1024:.1f} KiB"
    return f"{n / (1 << 20):.2f} MiB"


def plan_memory(ctx, threads: int = 1) -> MemoryPlan:
    """Plan ``ctx`` (an inferred ShapesContext whose dims are all concrete: pass ``dims``)."""
    graph = ctx.model.graph
    steps = ctx.order
    end = len(steps)
    inputs = [vi.name for vi in graph.input]
    inits = {t.name for t in graph.initializer}
    outputs = {vi.name for vi in graph.output}
    names: list[str] = [n for n in inputs if n not in inits] + sorted(inits)
    birth: dict[str, int] = {n: -1 for n in names}
    for i, (_, node) in enumerate(steps):
        for o in node.output:
            if o:
                names.append(o)
                birth[o] = i
    last_read: dict[str, int] = {}
    for i, (_, node) in enumerate(steps):
        for n in (*node.input, *outer_reads(node)):
            if n:
                last_read[n] = i

    missing, unsized, classes = [], [], {}
    for n in names:
        classes.setdefault(ctx.root(n), []).append(n)
    buffers: list[Buffer] = []
    for root, members in classes.items():
        t = ctx.type_of(root)
        if t.opaque is not None or not t.concrete() or t.elem is None:
            missing.append((root, t))
            continue
        try:
            nbytes = t.nbytes()
        except (ValueError, KeyError, TypeError):  # string tensors, or a number no ONNX type has
            unsized.append((root, t))
            continue
        persistent = any(m in inputs or m in inits for m in members)
        if ctx.access(root) is Access.READ_WRITE:
            kind = "cache"
        elif root in inits:
            kind = "initializer"
        elif root in inputs:
            kind = "input"
        elif any(m in outputs for m in members):
            kind = "output"
        else:
            kind = "activation"
        b0 = min(birth.get(m, end) for m in members)
        if persistent or any(m in outputs for m in members):
            d = end
        else:
            d = max([last_read.get(m, b0) for m in members] + [b0])
        buffers.append(Buffer(root, members, nbytes, kind, b0, d))
    if unsized:
        shown = "; ".join(f"'{r}' is {t}" for r, t in unsized[:6])
        raise GraphCheckError(f"the memory plan needs a fixed element size for every value; {len(unsized)} have "
                              f"none ({shown})", findings=[])
    if missing:
        free = sorted({str(d) for _, t in missing if t.shape for d in t.shape if not isinstance(d, int)})
        shown = "; ".join(f"'{r}' is {t}" for r, t in missing[:6])
        raise GraphCheckError(
            f"the memory plan needs concrete dims for every value; {len(missing)} lack them ({shown}"
            f"{' ...' if len(missing) > 6 else ''})"
            + (f". Pass dims for the symbols {free} (ortkv check --dims NAME=VALUE)" if free else ""),
            findings=[])

    in_place = [(label, o, ctx.root(o)) for label, node in steps for o in node.output
                if o and ctx.root(o) != o]
    # live bytes per step by a sweep: +nbytes where a buffer is born, -nbytes after its last step
    delta = [0] * (end + 1)
    for b in buffers:
        delta[max(b.birth, 0)] += b.nbytes
        delta[min(b.death, end - 1) + 1] -= b.nbytes
    step_bytes: list[tuple[str, int]] = []
    peak, peak_step, peak_ws, live = -1, -1, 0, 0
    for i, (label, node) in enumerate(steps):
        rule = WORKSPACE.get((node.domain, node.op_type))
        ws = rule(ctx, node, threads) if rule else 0
        live += delta[i]
        step_bytes.append((label, live + ws))
        if live + ws > peak:
            peak, peak_step, peak_ws = live + ws, i, ws
    if not steps:
        peak, peak_step = sum(b.nbytes for b in buffers), -1
    live = [b for b in buffers if b.birth <= peak_step <= b.death] if steps else list(buffers)
    return MemoryPlan(peak, peak_step, steps[peak_step][0] if steps else "(no nodes)", peak_ws, live, buffers,
                      in_place, step_bytes)
