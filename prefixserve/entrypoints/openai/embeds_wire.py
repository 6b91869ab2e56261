"""`prompt_embeds` over HTTP (vLLM's wire form): a base64 string of `torch.save` bytes holding one
2-D float tensor. Decoded here, off the event loop, before anything reaches the engine (which then
checks shape, dtype and values: inputs/prompt_embeds.py).

What an attacker controls is a zip archive and a pickle: the bytes must start as a zip archive
does (torch.load picks its reader from the first bytes, zipfile looks at the end), the archive
is inspected with zipfile first (uncompressed entries only, as torch.save writes them, and no
more bytes in all than the decoded body, so nothing inflates), then loaded with
`torch.load(weights_only=True)`, PyTorch's restricted unpickler that builds tensors and plain
containers and never calls arbitrary code. The tensor must be a plain dense one (sparse and
nested tensors load, but have no storage to measure: their layout is checked before anything
else), a 2-D view of exactly its own storage, contiguous: a stride-0 view of one element would
be a small body that becomes a large tensor when the engine copies it. So the body limit
(--max-request-body-bytes) bounds the tensor's bytes.
"""

from __future__ import annotations

import base64
import binascii
import io
import zipfile

import torch

from prefixserve.entrypoints.server.errors import OpenAIError
from prefixserve.inputs.prompt_embeds import layout_problem

_ZIP_MAGIC = b"PK\x03\x04"
# Zip entries besides the tensor's bytes (pickle, version, byteorder...): a few KB in practice.
_ARCHIVE_OVERHEAD = 64 << 10


def _refuse(why: str) -> OpenAIError:
    return OpenAIError(f"prompt_embeds: {why}", param="prompt_embeds")


def decode_prompt_embeds(data: str) -> torch.Tensor:
    """The tensor a base64 `torch.save` string holds; a 400 naming the problem otherwise."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _refuse("not valid base64") from None
    if not raw.startswith(_ZIP_MAGIC):
        raise _refuse("not a tensor saved with torch.save (its default zip format)")
    buffer = io.BytesIO(raw)
    try:
        with zipfile.ZipFile(buffer) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError):
        raise _refuse("not a tensor saved with torch.save (its default zip format)") from None
    if any(e.compress_type != zipfile.ZIP_STORED for e in entries):
        raise _refuse("compressed archive entries are not accepted")
    if sum(e.file_size for e in entries) > len(raw) + _ARCHIVE_OVERHEAD:
        raise _refuse("archive entries larger than the archive")
    buffer.seek(0)
    try:
        value = torch.load(buffer, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - whatever a malformed archive raises
        raise _refuse(f"cannot be loaded as a tensor ({type(exc).__name__})") from None
    if not isinstance(value, torch.Tensor):
        raise _refuse(f"must hold one tensor, got {type(value).__name__}")
    if (problem := layout_problem(value)) is not None:  # sparse and nested ones have no storage
        raise _refuse(problem)
    if value.dim() != 2:
        raise _refuse(f"must be a 2-D tensor [num_tokens, hidden_size], got {list(value.shape)}")
    storage = value.untyped_storage().nbytes()
    if not value.is_contiguous() or storage != value.numel() * value.element_size():
        raise _refuse("must be a contiguous tensor that holds exactly its own storage")
    return value
