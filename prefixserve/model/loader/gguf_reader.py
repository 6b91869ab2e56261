"""GGUF files opened for reading: the `gguf` package's reader, over plain array views, one per
file inside a conversion.

`gguf.GGUFReader` parses every metadata field when it opens a file, slicing its `numpy.memmap` once
per part of each field; a memmap slice runs Python code (`memmap.__getitem__`,
`__array_finalize__`) that a plain array's does not. A vocabulary is three fields of one part per
token (Gemma 3's 262,144 tokens: ~790,000 slices, 9.8 s to open the file here). `GGUFFileReader`
is the same reader whose `data` is the memmap viewed as a plain array: the same bytes, still
memory-mapped, its fields and tensors the same values (tests/model/test_gguf_reader.py); the file
opens in 3.1 s.

transformers' GGUF loading opens a file once for the config, once for the tokenizer and once for
the weights, and our special-token and tokenizer reads open it again: inside `one_reader_per_file`
every reader of a file, theirs (`gguf.GGUFReader`) and ours (`open_gguf`), is one object. A reader
is read-only over a memory map, so they can share it (the default model's conversion: 54 -> ~30
s before the plain views; Gemma 3's: 30.6 -> ~17 s with both).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np


class GGUFFileReader(gguf.GGUFReader):
    """`gguf.GGUFReader` whose file data is a plain ndarray view of its memmap."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: Any) -> None:
        # GGUFReader.__init__ assigns its np.memmap here before parsing anything.
        self._plain = value.view(np.ndarray)


# The package's own class, restored after each block whatever else patched it meanwhile.
_ORIGINAL_READER = gguf.GGUFReader
# Held for the whole of a `one_reader_per_file` block: conversions of different files in one
# process (their file locks differ) take turns over the module-wide patch.
_BLOCK = threading.Lock()
# Inside `one_reader_per_file`: the readers opened so far, by (real path, mode); else None.
_shared: dict[tuple[str, str], GGUFFileReader] | None = None


def _reader(path: str | os.PathLike[str], mode: str = "r") -> GGUFFileReader:
    shared = _shared  # read once: the block may end meanwhile on another thread
    if shared is None:
        return GGUFFileReader(path, mode)
    key = (os.path.realpath(path), mode)
    if key not in shared:
        shared[key] = GGUFFileReader(path, mode)
    return shared[key]


def open_gguf(path: str | os.PathLike[str]) -> GGUFFileReader:
    """The file's reader (read-only): the block's shared one inside `one_reader_per_file`."""
    return _reader(path, "r")


@contextlib.contextmanager
def one_reader_per_file() -> Iterator[None]:
    """Inside the block, every reader of one file (`open_gguf`, and `gguf.GGUFReader` as
    transformers calls it) is one object; they are dropped at its end. One block at a time in a
    process (a lock: the patch of `gguf.GGUFReader` is module-wide)."""
    global _shared
    with _BLOCK:
        _shared = {}
        gguf.GGUFReader = _reader
        try:
            yield
        finally:
            gguf.GGUFReader = _ORIGINAL_READER
            _shared = None
