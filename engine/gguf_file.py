"""A GGUF file's metadata and tensors, read in one pass over its header.

`gguf.GGUFReader` builds a NumPy view for every part of every metadata value; a tokenizer's vocabulary
and merges are ~100,000 strings, so opening the embedded default took ~4 s of its ~6 s load. This
reader decodes the header with `struct` from one bytes buffer (the same values, in a fraction of the
time) and maps the tensor data as read-only NumPy views of the file, shaped as `gguf.GGUFReader` shapes
them, so `gguf.quants.dequantize` takes them as they are.

Format (little-endian; versions 2 and 3): magic "GGUF", version u32, tensor count u64, metadata count
u64; each metadata entry a key (u64 length + UTF-8), a value type u32 and the value; each tensor a name,
its dimension count u32, dimensions u64 (innermost first), its ggml type u32 and its offset u64 from the
data section, which starts at the next multiple of `general.alignment` (default 32) after the header.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# metadata value type -> its little-endian layout (struct format characters)
_NUMBERS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}
MAX_HEADER = 1 << 30  # a header larger than this is not one we can be asked to read


class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands (the message says where it went wrong)."""


@dataclass
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as ggml lists it: innermost dimension first
    data: np.ndarray  # read-only view of the file: typed for plain types, bytes per block row for quantized ones


class _Cursor:
    def __init__(self, buf: memoryview, pos: int = 0):
        self.buf, self.pos = buf, pos

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"a string of {n} bytes runs past the end of the file at byte {self.pos}")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, kind: int):
        if kind in _NUMBERS:
            return self.take(_NUMBERS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, n = self.take("<I"), self.take("<Q")
            if inner in _NUMBERS:  # numbers in one NumPy read
                dtype = np.dtype(_NUMBERS[inner])  # NumPy reads struct's format characters
                size = dtype.itemsize * n
                if self.pos + size > len(self.buf):
                    raise GGUFError(f"an array of {n} values runs past the end of the file at byte {self.pos}")
                out = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).tolist()
                self.pos += size
                return out
            if inner == _STRING:
                return [self.string() for _ in range(n)]
            return [self.value(inner) for _ in range(n)]
        raise GGUFError(f"unknown metadata value type {kind} at byte {self.pos}")


class GGUFFile:
    """`fields`: metadata key -> its value (numbers, strings, lists of them); `tensors`: in file order."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise GGUFError(f"cannot map {self.path.name}: {e}") from None
        buf = memoryview(self._map)[:MAX_HEADER]
        try:
            self._parse(buf, gguf)
        except struct.error:
            raise GGUFError(f"{self.path.name} ends inside its header") from None

    def _parse(self, buf: memoryview, gguf) -> None:
        if bytes(buf[:4]) != b"GGUF":
            raise GGUFError(f"{self.path.name} does not start with the GGUF magic bytes")
        c = _Cursor(buf, 4)
        self.version = c.take("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"GGUF version {self.version} is not supported (2 and 3 are; a big-endian file reads "
                            "as a huge version)")
        n_tensors, n_fields = c.take("<Q"), c.take("<Q")
        self.fields: dict[str, object] = {}
        for _ in range(n_fields):
            key = c.string()
            self.fields[key] = c.value(c.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = tuple(c.take("<Q") for _ in range(c.take("<I")))
            infos.append((name, dims, c.take("<I"), c.take("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise GGUFError(f"general.alignment {align} is not a power of two")
        start = -(-c.pos // align) * align
        self.tensors: list[GGUFTensor] = []
        seen = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise GGUFError(f"tensor {name!r} appears twice")
            seen.add(name)
            try:
                kind = gguf.GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            n = int(np.prod(dims)) if dims else 1
            shape = tuple(reversed(dims))
            n_bytes = n * type_size // block
            at = start + offset
            if at + n_bytes > len(self._map):
                raise GGUFError(f"tensor {name!r} runs past the end of the file")
            plain = _PLAIN.get(kind.name)
            if plain is not None:
                data = np.frombuffer(self._map, dtype=plain, count=n, offset=at).reshape(shape)
            else:
                data = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=at).reshape(
                    gguf.quants.quant_shape_to_byte_shape(shape, kind))
            self.tensors.append(GGUFTensor(name, kind, dims, data))
