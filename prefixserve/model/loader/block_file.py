"""A converted GGUF file's block weights (`GGUF_BLOCKS_FILE`) written one weight at a time.

safetensors' own `save_file` takes every tensor at once and serializes a copy of them all: an 8B
Q4_K_M model's codes, scales and mins are ~10 GB, held twice. `BlockFileWriter` writes each
weight's bytes as it comes, after a header space reserved from the names that may come (the
header is written last, padded with spaces, which the safetensors format allows), so a
conversion holds one weight at a time. The file is an ordinary safetensors file.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

import torch

from prefixserve.model.quant.weights import BLOCK_FORMATS_KEY, Int8Weight

_DTYPES = {
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
}
# The tensors one weight may have, by the field of `Int8Weight` they come from.
_FIELDS = ("codes", "scales", "mins", "super_scales")
# Header bytes reserved per tensor beyond its name: its dtype, shape and offsets in JSON
# (`"<name>.super_scales":{"dtype":"F16","shape":[...],"data_offsets":[...,...]}`) with room.
_ENTRY_BYTES = 128


class BlockFileWriter:
    """Writes `path` (through a temporary file renamed at the end, nothing when no weight was
    added); `names`: every name a weight may be added under, for the header's reservation."""

    def __init__(self, path: Path, names: Iterable[str]) -> None:
        self.path = path
        names = list(names)
        self._reserved = 4096 + sum(
            len(_FIELDS) * (len(n) + len(".super_scales") + _ENTRY_BYTES) + len(n) + 16
            for n in names
        )
        self._tmp = path.with_name(f".{path.name}.partial")
        self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed in close / __exit__)
        self._file.seek(8 + self._reserved)
        self._entries: dict[str, dict] = {}
        self._formats: dict[str, str] = {}
        self._offset = 0

    def add(self, name: str, weight: Int8Weight) -> None:
        if weight.parts is not None:
            raise ValueError("a fused K-quant mix is made at load, not written")
        for field in _FIELDS:
            tensor = getattr(weight, field)
            if tensor is not None:
                self._write(f"{name}.{field}", tensor)
        self._formats[name] = weight.fmt

    def _write(self, key: str, tensor: torch.Tensor) -> None:
        data = tensor.detach().contiguous()
        raw = data.view(torch.uint8).reshape(-1).numpy() if data.numel() else b""
        self._file.write(memoryview(raw))
        size = data.numel() * data.element_size()
        self._entries[key] = {
            "dtype": _DTYPES[data.dtype],
            "shape": list(data.shape),
            "data_offsets": [self._offset, self._offset + size],
        }
        self._offset += size

    def close(self) -> None:
        """The header, then the file in place (or, with no weight, no file)."""
        if not self._formats:
            self._file.close()
            self._tmp.unlink(missing_ok=True)
            return
        metadata = {"format": "pt", BLOCK_FORMATS_KEY: json.dumps(self._formats)}
        header = json.dumps({"__metadata__": metadata, **self._entries}, separators=(",", ":"))
        encoded = header.encode()
        if len(encoded) > self._reserved:
            self.abort()
            raise ValueError(
                f"block file header of {len(encoded)} bytes exceeds the {self._reserved} reserved"
            )
        self._file.seek(0)
        self._file.write(struct.pack("<Q", self._reserved))
        self._file.write(encoded.ljust(self._reserved, b" "))
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> BlockFileWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()
