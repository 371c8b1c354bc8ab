"""The full model check: the structure (structure.py), the annotation rules (checker.py), alias-aware
shape inference (shapes.py) and the memory plan (planner.py), as one report. ``ortkv check MODEL``
prints it. A malformed model gets its ``malformed`` / ``limit`` findings and nothing else (Note
[Untrusted models]); an exception nobody foresaw becomes an ``internal`` finding."""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from ..errors import GraphCheckError
from .checker import Finding, check_aliases, internal_finding
from .planner import MemoryPlan, plan_memory
from .shapes import ShapesContext
from .structure import is_fatal

# What a model nobody foresaw can still make a rule raise; each becomes an ``internal`` finding.
_UNFORESEEN = (RecursionError, ValueError, TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError,
               OverflowError)


@dataclass
class CheckReport:
    findings: list[Finding]
    shapes: ShapesContext
    plan: MemoryPlan | None
    plan_error: str | None = None

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def error(self) -> GraphCheckError | None:
        """The errors as one GraphCheckError (its ``findings`` hold them), or None."""
        if not self.errors:
            return None
        return GraphCheckError(f"{len(self.errors)} error(s) in the model:\n" +
                               "\n".join(f"  {f}" for f in self.errors), findings=self.errors)

    def raise_for_errors(self) -> "CheckReport":
        err = self.error()
        if err is not None:
            raise err
        return self

    def format(self) -> str:
        lines = [str(f) for f in self.findings] or ["no findings"]
        lines.append(self.shapes.summary())
        if self.plan is not None:
            lines.append(self.plan.format())
        elif self.plan_error:
            lines.append(f"memory plan: not computed: {self.plan_error}")
        errors, warnings = len(self.errors), len(self.findings) - len(self.errors)
        lines.append(f"{errors} error(s), {warnings} warning(s)")
        return "\n".join(lines)


def check(model: onnx.ModelProto, dims: dict[str, int] | None = None,
          bounds: dict[str, tuple[int, int]] | None = None, plan: bool = True, threads: int = 1,
          assume_aliases: dict[str, str] | None = None) -> CheckReport:
    """Check ``model`` and, when every dim is concrete (``dims`` binds the symbols), plan its memory.
    Returns the findings as data; ``report.raise_for_errors()`` turns errors into GraphCheckError.
    ``assume_aliases``: see ShapesContext (e.g. ``share_buffer_aliases(model)``)."""
    findings = check_aliases(model)
    ctx = ShapesContext(model, dims, bounds, assume_aliases)
    if is_fatal(findings):  # Note [Untrusted models]: no rule runs over a model without ONNX's structure
        return CheckReport(findings, ctx, None, "the model is malformed" if plan else None)
    try:
        ctx.infer()
    except _UNFORESEEN as exc:
        ctx.findings.append(internal_finding(exc, "shape inference"))
    seen = {(f.rule, f.subject) for f in findings}
    for f in ctx.findings:
        if (f.rule, f.subject) not in seen:
            seen.add((f.rule, f.subject))
            findings.append(f)
    memory, why = None, None
    if plan and not any(f.severity == "error" for f in findings):
        try:
            memory = plan_memory(ctx, threads=threads)
        except GraphCheckError as exc:
            why = str(exc)
        except _UNFORESEEN as exc:
            why = internal_finding(exc, "the memory planner").message
    elif plan:
        why = "the model has errors"
    return CheckReport(findings, ctx, memory, why)
