"""Alias annotations serialized in the model (metadata_props, IR version >= 10).

* graph input ValueInfoProto:  ``access``   = ``READ_WRITE`` | ``READ_ONLY``
* aliased output ValueInfoProto: ``alias_of`` = the input's name
* producing NodeProto:          ``output_alias`` = ``<output_index>:<input_index>:MUST_ALIAS``
  (several entries separated by ``;``)

ONNX Runtime ignores these keys; ortkv's checker and MutableCacheSession read them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import onnx

from ..errors import GraphCheckError

ACCESS_KEY = "access"
ALIAS_OF_KEY = "alias_of"
OUTPUT_ALIAS_KEY = "output_alias"
MUST_ALIAS = "MUST_ALIAS"
MIN_IR_VERSION = 10  # first IR version with metadata_props on values and nodes (onnx 1.16)
MAX_IR_VERSION = 13  # newest IR version onnxruntime 1.31 loads


class Access(str, enum.Enum):
    READ_WRITE = "READ_WRITE"
    READ_ONLY = "READ_ONLY"


@dataclass(frozen=True)
class OutputAlias:
    """Output ``output_index`` of a node MUST be the storage of its input ``input_index``."""

    output_index: int
    input_index: int
    kind: str = MUST_ALIAS

    def __str__(self) -> str:
        return f"{self.output_index}:{self.input_index}:{self.kind}"

    @classmethod
    def parse_list(cls, text: str, node_name: str = "?") -> list["OutputAlias"]:
        entries = []
        for raw in text.split(";"):
            raw = raw.strip()
            if not raw:
                continue
            parts = raw.split(":")
            if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] != MUST_ALIAS:
                raise GraphCheckError(
                    f"node '{node_name}': output_alias entry '{raw}' is malformed; expected "
                    f"'<output_index>:<input_index>:{MUST_ALIAS}' (entries separated by ';')"
                )
            entries.append(cls(int(parts[0]), int(parts[1]), parts[2]))
        return entries


def _get(props, key: str) -> str | None:
    for p in props:
        if p.key == key:
            return p.value
    return None


def _set(props, key: str, value: str) -> None:
    for p in props:
        if p.key == key:
            p.value = value
            return
    entry = props.add()
    entry.key, entry.value = key, value


def _graph(model_or_graph) -> onnx.GraphProto:
    return model_or_graph.graph if isinstance(model_or_graph, onnx.ModelProto) else model_or_graph


def _value_infos(graph: onnx.GraphProto, name: str):
    """Every ValueInfoProto of ``name`` (a value may be described as input, output and value_info)."""
    return [vi for vi in (*graph.input, *graph.output, *graph.value_info) if vi.name == name]


def ensure_ir_version(model: onnx.ModelProto) -> None:
    """Raise the model to IR 10 if older (metadata_props on values and nodes need it)."""
    if model.ir_version < MIN_IR_VERSION:
        model.ir_version = MIN_IR_VERSION
    elif model.ir_version > MAX_IR_VERSION:
        raise GraphCheckError(
            f"model IR version {model.ir_version} is newer than onnxruntime loads ({MAX_IR_VERSION}); "
            f"set model.ir_version to a value in [{MIN_IR_VERSION}, {MAX_IR_VERSION}]"
        )


def set_input_access(model, name: str, access: Access | str) -> None:
    """Annotate graph input ``name`` as READ_WRITE (a mutable cache) or READ_ONLY."""
    graph = _graph(model)
    access = Access(access)
    if any(init.name == name for init in graph.initializer):
        raise GraphCheckError(f"value '{name}' is an initializer; an initializer cannot be marked {access.value}")
    inputs = [vi for vi in graph.input if vi.name == name]
    if not inputs:
        raise GraphCheckError(f"'{name}' is not a graph input; graph inputs: {[vi.name for vi in graph.input]}")
    if isinstance(model, onnx.ModelProto):
        ensure_ir_version(model)
    _set(inputs[0].metadata_props, ACCESS_KEY, access.value)


def mark_mutable(model, name: str) -> None:
    """Shorthand for ``set_input_access(model, name, Access.READ_WRITE)``."""
    set_input_access(model, name, Access.READ_WRITE)


def input_access(model, name: str) -> Access | None:
    for vi in _graph(model).input:
        if vi.name == name:
            value = _get(vi.metadata_props, ACCESS_KEY)
            return Access(value) if value in Access._value2member_map_ else None
    return None


def set_alias_of(model, output_name: str, input_name: str) -> None:
    """Annotate value ``output_name`` (usually a graph output) as the storage of ``input_name``."""
    graph = _graph(model)
    infos = _value_infos(graph, output_name)
    if not infos:
        # An intermediate value with no ValueInfo yet: describe it so the annotation has a home.
        vi = graph.value_info.add()
        vi.name = output_name
        infos = [vi]
    if isinstance(model, onnx.ModelProto):
        ensure_ir_version(model)
    for vi in infos:
        _set(vi.metadata_props, ALIAS_OF_KEY, input_name)


def alias_of(model, value_name: str) -> str | None:
    for vi in _value_infos(_graph(model), value_name):
        target = _get(vi.metadata_props, ALIAS_OF_KEY)
        if target is not None:
            return target
    return None


def declare_output_alias(node: onnx.NodeProto, output_index: int, input_index: int) -> None:
    """Declare that ``node.output[output_index]`` MUST alias ``node.input[input_index]``."""
    if not 0 <= output_index < len(node.output):
        raise GraphCheckError(f"node '{node.name}' has {len(node.output)} outputs; output_index {output_index} is out of range")
    if not 0 <= input_index < len(node.input):
        raise GraphCheckError(f"node '{node.name}' has {len(node.input)} inputs; input_index {input_index} is out of range")
    entries = [e for e in output_aliases(node) if e.output_index != output_index]
    entries.append(OutputAlias(output_index, input_index))
    _set(node.metadata_props, OUTPUT_ALIAS_KEY, ";".join(str(e) for e in entries))


def output_aliases(node: onnx.NodeProto) -> list[OutputAlias]:
    text = _get(node.metadata_props, OUTPUT_ALIAS_KEY)
    return OutputAlias.parse_list(text, node.name) if text else []


def annotate_in_place(model: onnx.ModelProto, node: onnx.NodeProto, output_index: int = 0, input_index: int = 0) -> None:
    """Write all three annotations for one in-place node whose aliased input is a graph input:
    the input becomes READ_WRITE, the node declares the alias, and the output (when it is a
    graph output or has a ValueInfo) records ``alias_of``."""
    declare_output_alias(node, output_index, input_index)
    cache = node.input[input_index]
    mark_mutable(model, cache)
    out = node.output[output_index]
    if _value_infos(model.graph, out):
        set_alias_of(model, out, cache)


@dataclass
class AliasAnnotations:
    """Everything the annotations say about one graph."""

    access: dict[str, Access] = field(default_factory=dict)  # graph input -> access
    alias_of: dict[str, str] = field(default_factory=dict)  # value -> the input it aliases
    node_aliases: dict[int, list[OutputAlias]] = field(default_factory=dict)  # node index -> entries

    def mutable_inputs(self) -> list[str]:
        return [name for name, acc in self.access.items() if acc is Access.READ_WRITE]

    def aliased_outputs(self, graph: onnx.GraphProto) -> dict[str, str]:
        """Graph output -> the cache input it aliases."""
        outs = {vi.name for vi in graph.output}
        return {o: i for o, i in self.alias_of.items() if o in outs}


def read_annotations(model) -> AliasAnnotations:
    graph = _graph(model)
    ann = AliasAnnotations()
    for vi in graph.input:
        value = _get(vi.metadata_props, ACCESS_KEY)
        if value is not None:
            if value not in Access._value2member_map_:
                raise GraphCheckError(
                    f"graph input '{vi.name}': access '{value}' is not one of READ_WRITE, READ_ONLY"
                )
            ann.access[vi.name] = Access(value)
    for vi in (*graph.input, *graph.output, *graph.value_info):
        target = _get(vi.metadata_props, ALIAS_OF_KEY)
        if target is not None:
            previous = ann.alias_of.setdefault(vi.name, target)
            if previous != target:
                raise GraphCheckError(
                    f"value '{vi.name}' carries two alias_of annotations: '{previous}' and '{target}'"
                )
    for index, node in enumerate(graph.node):
        entries = output_aliases(node)
        if entries:
            ann.node_aliases[index] = entries
    return ann
