"""GGUF files opened for reading: the `gguf` package's reader, over plain array views.

`gguf.GGUFReader` parses every metadata field when it opens a file, slicing its `numpy.memmap` once
per part of each field; a memmap slice runs Python code (`memmap.__getitem__`,
`__array_finalize__`) that a plain array's does not. A vocabulary is three fields of one part per
token (Gemma 3's 262,144 tokens: ~790,000 slices, 9.8 s to open the file here). `GGUFFileReader`
is the same reader whose `data` is the memmap viewed as a plain array: the same bytes, still
memory-mapped, its fields and tensors the same values (tests/model/test_gguf_reader.py); the file
opens in 3.1 s.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from gguf import GGUFReader


class GGUFFileReader(GGUFReader):
    """`gguf.GGUFReader`, read-only, whose file data is a plain ndarray view of its memmap."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: Any) -> None:
        # GGUFReader.__init__ assigns its np.memmap here before parsing anything.
        self._plain = value.view(np.ndarray)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFileReader:
    """The file's reader (read-only)."""
    return GGUFFileReader(path, "r")
