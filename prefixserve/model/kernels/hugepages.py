"""Weights in transparent huge pages: one 2 MiB-aligned arena, `madvise(MADV_HUGEPAGE)` before
first touch, so that streaming a decode step's weights takes one TLB entry per 2 MiB instead of
one per 4 KiB.

A bf16 decode step reads every weight once (~270 MB for the default model) and is bound by
memory bandwidth; with 4 KiB pages that is ~66,000 TLB misses a token. Measured on AMD Zen 5
(BENCHMARKS.md, "Weights in transparent huge pages"): the streaming kernel over all the default
model's linears read faster from huge pages than from ordinary ones, and the engine's decode
step at batch 1 took less time. Linux with THP in "madvise" or
"always" mode only; elsewhere (or when madvise fails) the weights stay where they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_ALIGN = 64  # each tensor starts on a cache line


@functools.cache
def _madvise() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_page_arena(nbytes: int) -> torch.Tensor | None:
    """An untouched uint8 tensor of `nbytes` whose memory starts on a 2 MiB boundary and is
    advised to be backed by huge pages; None where that cannot be asked for."""
    madvise = _madvise()
    if madvise is None or nbytes <= 0:
        return None
    padded = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(padded + HUGE_PAGE, dtype=torch.uint8)  # large: mmap'd, not yet touched
    start = -raw.data_ptr() % HUGE_PAGE
    if madvise(raw.data_ptr() + start, padded, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed (errno %d)", ctypes.get_errno())
        return None
    return raw[start : start + padded]


def move_to_huge_pages(params: Iterable[torch.nn.Parameter]) -> bool:
    """Copy these parameters (each once, however often listed: tied weights) into one huge-page
    arena and point them at it; their values do not change. False (nothing moved) where the
    arena cannot be made."""
    unique = list({id(p): p for p in params}.values())
    sizes = [-(-p.numel() * p.element_size() // _ALIGN) * _ALIGN for p in unique]
    arena = huge_page_arena(sum(sizes))
    if arena is None:
        return False
    offset = 0
    with torch.no_grad():
        for param, size in zip(unique, sizes, strict=True):
            nbytes = param.numel() * param.element_size()
            view = arena[offset : offset + nbytes].view(param.dtype).view(param.shape)
            view.copy_(param.data)
            param.data = view
            offset += size
    return True
