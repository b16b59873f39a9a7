"""The local model's int8 embedding tables, dequantised only in the rows a run reads.

The shipped model (all-MiniLM-L6-v2, int8 weights) keeps each weight as int8 with one float scale per row and
dequantises it in the graph: `Mul(Cast(w_q), scale)`. onnxruntime folds that into a float copy once, at load. For
the matrices every run multiplies by, that is what makes it fast (dequantised on every run, a query took 47 ms, not
4). For the embedding tables it is not: a run reads one row per token, and the float copy of the vocabulary's 30,522
rows is 47 MB of the offload process's RSS. `gather_rows_first` rewrites `Gather(Mul(Cast(w_q), scale), ids)` into
`Mul(Cast(Gather(w_q, ids)), Gather(scale, ids))`: the same numbers bit for bit (each element is the same cast and
the same product), the table left int8. Measured in a fresh process: the session's RSS 98 MB -> 56 MB, outputs
identical, query time the same.

It reads and writes the ONNX protobuf itself (the wire format, and a few field numbers of ModelProto, GraphProto,
NodeProto, AttributeProto and TensorProto), so loomd needs no `onnx` package. A graph without the pattern comes
back unchanged, byte for byte.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

# Field numbers (onnx.proto): ModelProto.graph; GraphProto.node, .initializer, .value_info; NodeProto.input,
# .output, .name, .op_type, .attribute; AttributeProto.name, .i; TensorProto.dims, .data_type, .name.
MODEL_GRAPH = 7
GRAPH_NODE, GRAPH_INITIALIZER, GRAPH_VALUE_INFO = 1, 5, 13
NODE_INPUT, NODE_OUTPUT, NODE_NAME, NODE_OP, NODE_ATTRIBUTE = 1, 2, 3, 4, 5
ATTR_NAME, ATTR_INT = 1, 3
TENSOR_DIMS, TENSOR_TYPE, TENSOR_NAME = 1, 2, 8
INT8 = 3
_LEN = 2  # the wire type of strings, bytes and messages
Buffer = bytes | memoryview  # a message, or a slice of one (no copy)
COPY_BELOW = 1 << 16  # bytes


def _varint(data: Buffer, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | 0x80 if value else low)
        if not value:
            return bytes(out)


def _fields(message: Buffer) -> Iterator[tuple[int, int, int | Buffer, Buffer]]:
    """Each field of a message: its number, wire type, value, and its whole encoding (kept verbatim). A large message
    read through a memoryview yields slices of it; a small one is copied first (reading a byte of a memoryview is
    several times slower than of bytes)."""
    if isinstance(message, memoryview) and len(message) < COPY_BELOW:
        message = bytes(message)
    at = 0
    while at < len(message):
        start = at
        key, at = _varint(message, at)
        number, wire = key >> 3, key & 7
        value: int | Buffer
        if wire == 0:
            value, at = _varint(message, at)
        elif wire == _LEN:
            size, at = _varint(message, at)
            value, at = message[at:at + size], at + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, at = message[at:at + size], at + size
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {start}")
        yield number, wire, value, message[start:at]


def _header(number: int, size: int) -> bytes:
    return _encode_varint(number << 3 | _LEN) + _encode_varint(size)


def _message(number: int, payload: Buffer) -> bytes:
    return _header(number, len(payload)) + payload


def _strings(message: Buffer, number: int) -> list[str]:
    return [str(v, "utf-8") for n, w, v, _ in _fields(message) if n == number and not isinstance(v, int)]


def _node(node: Buffer, inputs: list[str], outputs: list[str]) -> bytes:
    """`node` with these inputs and outputs, the rest of it (name, op, attributes) as it was."""
    rest = b"".join(raw for n, _, _, raw in _fields(node) if n not in (NODE_INPUT, NODE_OUTPUT))
    return b"".join([*(_message(NODE_INPUT, s.encode()) for s in inputs),
                     *(_message(NODE_OUTPUT, s.encode()) for s in outputs)]) + rest


def _tensor_shapes(graph: list[tuple[int, int, int | Buffer, Buffer]]) -> dict[str, tuple[int, list[int]]]:
    """Each initializer's data type and dims."""
    out = {}
    for number, _, value, _ in graph:
        if number != GRAPH_INITIALIZER or isinstance(value, int):
            continue
        name, kind, dims = "", 0, []
        for n, _, v, _ in _fields(value):
            if n == TENSOR_NAME and not isinstance(v, int):
                name = str(v, "utf-8")
            elif n == TENSOR_TYPE and isinstance(v, int):
                kind = v
            elif n == TENSOR_DIMS and isinstance(v, int):
                dims.append(v)
            elif n == TENSOR_DIMS and not isinstance(v, int):  # packed
                at = 0
                while at < len(v):
                    dim, at = _varint(v, at)
                    dims.append(dim)
        out[name] = (kind, dims)
    return out


def _gathers_on_axis_0(node: Buffer) -> bool:
    for number, _, value, _ in _fields(node):
        if number == NODE_ATTRIBUTE and not isinstance(value, int):
            attr = {n: v for n, _, v, _ in _fields(value)}
            if attr.get(ATTR_NAME) == b"axis" and attr.get(ATTR_INT, 0) != 0:
                return False
    return True


def gather_rows_first(model: bytes) -> bytes:
    """The model with each `Gather(Mul(Cast(int8 table), per-row scale), ids)` read as
    `Mul(Cast(Gather(table, ids)), Gather(scale, ids))`; unchanged when it has none."""
    # Read through a memoryview: every field is a slice of the model's own bytes, not a copy (copies of the graph and
    # of each field were 150 MB of the offload process's peak RSS, at every start, for a 23 MB model).
    top = list(_fields(memoryview(model)))
    graph_bytes = next((v for n, _, v, _ in top if n == MODEL_GRAPH and not isinstance(v, int)), None)
    if graph_bytes is None:
        return model
    graph = list(_fields(graph_bytes))
    nodes = [v for n, _, v, _ in graph if n == GRAPH_NODE and not isinstance(v, int)]
    ops = [next(iter(_strings(node, NODE_OP)), "") for node in nodes]
    inputs = [_strings(node, NODE_INPUT) for node in nodes]
    outputs = [_strings(node, NODE_OUTPUT) for node in nodes]
    made_by = {name: k for k, names in enumerate(outputs) for name in names}
    uses = Counter(name for names in inputs for name in names)
    tensors = _tensor_shapes(graph)
    rewritten, added, replaced = list(nodes), [], set()
    for k, op in enumerate(ops):
        if op != "Gather" or len(inputs[k]) != 2 or len(outputs[k]) != 1 or not _gathers_on_axis_0(nodes[k]):
            continue
        table, ids = inputs[k]
        mul = made_by.get(table)
        if mul is None or ops[mul] != "Mul" or uses[table] != 1 or len(inputs[mul]) != 2:
            continue
        floats, scale = inputs[mul]
        cast = made_by.get(floats)
        if cast is None or ops[cast] != "Cast" or uses[floats] != 1 or len(inputs[cast]) != 1:
            continue
        kind, dims = tensors.get(inputs[cast][0], (0, []))
        if kind != INT8 or len(dims) != 2 or tensors.get(scale, (0, []))[1] != [dims[0], 1]:
            continue
        (quantised,), (out,) = inputs[cast], outputs[k]
        rows, row_scales = f"{out}/int8_rows", f"{out}/row_scales"
        rewritten[k] = _node(nodes[k], [quantised, ids], [rows])
        rewritten[cast] = _node(nodes[cast], [rows], [floats])
        rewritten[mul] = _node(nodes[mul], [floats, row_scales], [out])
        added.append(_message(NODE_INPUT, scale.encode()) + _message(NODE_INPUT, ids.encode())
                     + _message(NODE_OUTPUT, row_scales.encode()) + _message(NODE_NAME, row_scales.encode())
                     + _message(NODE_OP, b"Gather"))
        replaced |= {floats, table}  # their shapes changed: a shape declared for them (value_info) goes
    if not added:
        return model

    def kept(number: int, value: int | Buffer) -> bool:
        return not (number == GRAPH_VALUE_INFO and not isinstance(value, int) and replaced & set(_strings(value, 1)))

    fresh = iter(rewritten)
    body = [*(_message(GRAPH_NODE, next(fresh)) if n == GRAPH_NODE else raw for n, _, v, raw in graph if kept(n, v)),
            *(_message(GRAPH_NODE, node) for node in added)]  # appended: onnxruntime sorts the graph itself
    # One join of the pieces: the new model is the one copy of the weights made.
    graph_head = _header(MODEL_GRAPH, sum(map(len, body)))
    return b"".join([piece for n, _, _, raw in top for piece in ([graph_head, *body] if n == MODEL_GRAPH else [raw])])
