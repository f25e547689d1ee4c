"""Damage a GGUF file one field at a time (tests only).

`fields(data)` lists where every header field lies (to overwrite one in place); `Gguf` parses a
file into metadata entries, tensor infos and the data section and writes it back, so that an edit
may change sizes (a value's type, a repeated key or tensor) and the data still follows, aligned.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

# GGUF value types: id -> struct format of a scalar (strings and arrays are read apart).
SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclass
class Field:
    what: str    # "tensor_count", "kv:<key>", "kv_type:<key>", "tensor:<name>:dim0", "tensor:<name>:type", ...
    offset: int  # byte offset in the file
    fmt: str     # struct format of the value there


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> bytes:
        n = self.take("<Q")
        s = self.data[self.pos:self.pos + n]
        self.pos += n
        return s

    def value(self, vtype: int, out: list, what: str):
        if vtype in SCALAR:
            out.append(Field(what, self.pos, SCALAR[vtype]))
            return self.take(SCALAR[vtype])
        if vtype == STRING:
            out.append(Field(what + ":len", self.pos, "<Q"))
            return self.string()
        if vtype == ARRAY:
            item = self.take("<I")
            out.append(Field(what + ":count", self.pos, "<Q"))
            n = self.take("<Q")
            return (item, [self.value(item, out if i < 4 else [], f"{what}[{i}]") for i in range(n)])
        raise ValueError(f"unknown GGUF value type {vtype}")


def fields(data: bytes) -> list[Field]:
    """Every header field: counts, each metadata value (and its type), each tensor's name length,
    dimension count, dimensions, type and offset (for arrays, their count and first items)."""
    r, out = _Reader(data), []
    r.take("<I")
    out.append(Field("version", r.pos, "<I"))
    r.take("<I")
    out.append(Field("tensor_count", r.pos, "<Q"))
    n_tensors = r.take("<Q")
    out.append(Field("kv_count", r.pos, "<Q"))
    n_kv = r.take("<Q")
    for _ in range(n_kv):
        key = r.string().decode()
        out.append(Field(f"kv_type:{key}", r.pos, "<I"))
        r.value(r.take("<I"), out, f"kv:{key}")
    for _ in range(n_tensors):
        out.append(Field("tensor_name_len", r.pos, "<Q"))
        name = r.string().decode()
        out.append(Field(f"tensor:{name}:ndims", r.pos, "<I"))
        for d in range(r.take("<I")):
            out.append(Field(f"tensor:{name}:dim{d}", r.pos, "<Q"))
            r.take("<Q")
        out.append(Field(f"tensor:{name}:type", r.pos, "<I"))
        r.take("<I")
        out.append(Field(f"tensor:{name}:offset", r.pos, "<Q"))
        r.take("<Q")
    return out


def find_field(data: bytes, what: str) -> Field:
    return next(f for f in fields(data) if f.what == what)


def overwrite(data: bytes, what: str, value) -> bytes:
    """data with the field `what` set to value (wrapped to the field's width for integers)."""
    f = find_field(data, what)
    out = bytearray(data)
    if f.fmt[-1] in "BHIQ":
        value %= 1 << (8 * struct.calcsize(f.fmt))
    struct.pack_into(f.fmt, out, f.offset, value)
    return bytes(out)


def read(data: bytes, what: str):
    f = find_field(data, what)
    return struct.unpack_from(f.fmt, data, f.offset)[0]


@dataclass
class TensorInfo:
    name: str
    dims: list   # ggml order (innermost first)
    type: int
    offset: int


@dataclass
class Gguf:
    kvs: list = field(default_factory=list)      # [key, vtype, value] (arrays: (item_type, [values]))
    tensors: list = field(default_factory=list)  # [TensorInfo]
    data: bytes = b""                            # the data section
    version: int = 3

    @classmethod
    def parse(cls, blob: bytes) -> "Gguf":
        r, g = _Reader(blob), cls()
        r.take("<I")
        g.version = r.take("<I")
        n_tensors, n_kv = r.take("<Q"), r.take("<Q")
        for _ in range(n_kv):
            key = r.string().decode()
            vtype = r.take("<I")
            g.kvs.append([key, vtype, r.value(vtype, [], key)])
        for _ in range(n_tensors):
            name = r.string().decode()
            dims = [r.take("<Q") for _ in range(r.take("<I"))]
            g.tensors.append(TensorInfo(name, dims, r.take("<I"), r.take("<Q")))
        start = -(-r.pos // g.alignment) * g.alignment
        g.data = blob[start:]
        return g

    @property
    def alignment(self) -> int:
        return next((v for k, _, v in self.kvs if k == "general.alignment"), 32)

    def get(self, key: str):
        return next(v for k, _, v in self.kvs if k == key)

    def set(self, key: str, vtype: int, value) -> "Gguf":
        """Sets (or adds) key with this type and value."""
        for kv in self.kvs:
            if kv[0] == key:
                kv[1], kv[2] = vtype, value
                return self
        self.kvs.append([key, vtype, value])
        return self

    def serialize(self) -> bytes:
        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors), len(self.kvs)))

        def value(vtype, v):
            if vtype in SCALAR:
                out.extend(struct.pack(SCALAR[vtype], v))
            elif vtype == STRING:
                v = v.encode() if isinstance(v, str) else v
                out.extend(struct.pack("<Q", len(v)) + v)
            else:
                item, items = v
                out.extend(struct.pack("<IQ", item, len(items)))
                for x in items:
                    value(item, x)

        for key, vtype, v in self.kvs:
            value(STRING, key)
            out.extend(struct.pack("<I", vtype))
            value(vtype, v)
        for t in self.tensors:
            value(STRING, t.name)
            out.extend(struct.pack("<I", len(t.dims)) + b"".join(struct.pack("<Q", d) for d in t.dims))
            out.extend(struct.pack("<IQ", t.type, t.offset))
        out.extend(b"\0" * (-len(out) % self.alignment))
        return bytes(out) + self.data
