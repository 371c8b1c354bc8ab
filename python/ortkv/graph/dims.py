"""Types of values as ShapesContext sees them: an element type and a shape whose dims are concrete
(int), symbolic (str, unified across the model by a union-find with optional concrete bindings) or
unknown (None)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx


def find_root(parent: dict[str, str], x: str) -> str:
    """Union-find lookup with path compression; an unseen ``x`` becomes its own root."""
    parent.setdefault(x, x)
    root = x
    while parent[root] != root:
        root = parent[root]
    while parent[x] != root:
        parent[x], x = root, parent[x]
    return root


def elem_name(elem: int | None) -> str:
    if elem is None:
        return "an unknown type"
    if elem == onnx.TensorProto.STRING:
        return "string"
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem).name if elem != onnx.TensorProto.BFLOAT16 else "bfloat16"
    except (KeyError, TypeError, ValueError):
        pass
    try:
        return onnx.TensorProto.DataType.Name(elem).lower()
    except ValueError:  # a number no element type has (an untrusted model)
        return f"element type {elem} (not an ONNX type)"


def elem_size(elem: int) -> float:
    """Bytes per element (fractions for the 4-bit and 2-bit types)."""
    if elem in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return 0.5
    if elem == onnx.TensorProto.STRING:
        raise ValueError("string tensors have no fixed size")
    return onnx.helper.tensor_dtype_to_np_dtype(elem).itemsize if elem != onnx.TensorProto.BFLOAT16 else 2


@dataclass(frozen=True)
class ValueType:
    """A tensor type: ``elem`` is onnx's TensorProto enum (None: unknown); ``shape`` is None when even the
    rank is unknown. ``opaque`` holds a non-tensor TypeProto (sequence, optional, map) as it came."""

    elem: int | None = None
    shape: tuple | None = None
    opaque: onnx.TypeProto | None = None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def known(self) -> bool:
        """Typed: an element type and a rank (dims may stay symbolic) or a non-tensor type."""
        return self.opaque is not None or (self.elem is not None and self.shape is not None)

    def concrete(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    def nbytes(self) -> int:
        return int(math.ceil(math.prod(self.shape) * elem_size(self.elem)))

    def __str__(self) -> str:
        if self.opaque is not None:
            return str(self.opaque.WhichOneof("value"))
        return f"{elem_name(self.elem)} {'[?]' if self.shape is None else list_dims(self.shape)}"

    @classmethod
    def from_proto(cls, tp: onnx.TypeProto) -> "ValueType":
        kind = tp.WhichOneof("value")
        if kind is None:
            return cls()
        if kind != "tensor_type":
            return cls(opaque=tp)
        tt = tp.tensor_type
        elem = tt.elem_type or None
        if not tt.HasField("shape"):
            return cls(elem, None)
        dims = []
        for d in tt.shape.dim:
            which = d.WhichOneof("value")
            dims.append(d.dim_value if which == "dim_value" else (d.dim_param or None) if which == "dim_param" else None)
        return cls(elem, tuple(dims))

    def to_proto(self) -> onnx.TypeProto:
        if self.opaque is not None:
            return self.opaque
        return onnx.helper.make_tensor_type_proto(self.elem or 0, None if self.shape is None else list(self.shape))


class ShapeConflict(Exception):
    """Two constraints on one dim, element type or rank cannot both hold."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind  # "type", "rank" or "dim"
        self.detail = detail


class DimTable:
    """Union-find over symbolic dims. A class may be bound to one concrete value (from ``fixed`` or
    learned where a symbol meets a number); two symbols that meet become one class."""

    def __init__(self, fixed: dict[str, int] | None = None):
        self._parent: dict[str, str] = {}
        self._value: dict[str, int] = {}
        for name, value in (fixed or {}).items():
            self._parent[name] = name
            self._value[name] = int(value)

    def find(self, sym: str) -> str:
        return find_root(self._parent, sym)

    def resolve(self, d):
        """int for a concrete or bound dim, the class's symbol for a free one, None for unknown."""
        if d is None or isinstance(d, int):
            return d
        root = self.find(d)
        return self._value.get(root, root)

    def resolve_type(self, t: ValueType) -> ValueType:
        if t.shape is None:
            return t
        return ValueType(t.elem, tuple(self.resolve(d) for d in t.shape), t.opaque)

    def meet(self, a, b):
        """The dim both constraints describe; raises ShapeConflict when they cannot agree."""
        a, b = self.resolve(a), self.resolve(b)
        if a is None:
            return b
        if b is None or a == b:
            return a
        if isinstance(a, int) and isinstance(b, int):
            raise ShapeConflict("dim", f"{a} vs {b}")
        if isinstance(a, int):
            a, b = b, a
        # a is a free symbol here
        if isinstance(b, int):
            self._value[self.find(a)] = b
            return b
        ra, rb = self.find(a), self.find(b)
        self._parent[rb] = ra
        return ra

    def bindings(self) -> dict[str, object]:
        """Every symbol seen -> what it resolves to (an int, or the symbol naming its class)."""
        return {s: self.resolve(s) for s in sorted(self._parent)}

    def meet_types(self, a: ValueType, b: ValueType) -> ValueType:
        if a.opaque is not None or b.opaque is not None:
            return a if a.opaque is not None else b
        if a.elem is not None and b.elem is not None and a.elem != b.elem:
            raise ShapeConflict("type", f"{elem_name(a.elem)} vs {elem_name(b.elem)}")
        elem = a.elem if a.elem is not None else b.elem
        if a.shape is None or b.shape is None:
            return ValueType(elem, a.shape if b.shape is None else b.shape)
        if len(a.shape) != len(b.shape):
            raise ShapeConflict("rank", f"rank {len(a.shape)} {list_dims(a.shape)} vs rank {len(b.shape)} "
                                        f"{list_dims(b.shape)}")
        dims = []
        for i, (x, y) in enumerate(zip(a.shape, b.shape)):
            try:
                dims.append(self.meet(x, y))
            except ShapeConflict as exc:
                raise ShapeConflict("dim", f"dim {i} is {self.resolve(x)} vs {self.resolve(y)} "
                                           f"({list_dims(a.shape)} vs {list_dims(b.shape)})") from exc
        return ValueType(elem, tuple(dims))


def list_dims(shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def join_types(table: DimTable, a: ValueType, b: ValueType) -> ValueType:
    """The loosest type both may have (If branches): dims that differ become unknown."""
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return ValueType(a.elem if a.elem == b.elem else None, None)
    dims = tuple(x if x == y else None for x, y in
                 ((table.resolve(x), table.resolve(y)) for x, y in zip(a.shape, b.shape)))
    return ValueType(a.elem if a.elem == b.elem else None, dims)
