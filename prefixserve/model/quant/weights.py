"""8-bit weights: int8 codes with fp32 scales per group of K, the one layout the native kernel
multiplies (csrc/linear_int8.cpp). Two ways in:

- per-channel symmetric (`--quantization int8`, from a bf16 checkpoint): one scale per output
  row, amax / 127, codes round(w / scale), computed at load (the loader caches them on disk);
- GGUF Q8_0, Q5_0 and Q4_0 (32 codes and one fp16 scale per block): kept as the file has them,
  in 8-bit codes. transformers hands the loader the file's values dequantized to fp32 (code x
  scale, exact); ggml's rule makes the largest code of a block +-127 (Q8_0), -16 (Q5_0) or -8
  (Q4_0), so the scale is that block's amax over it and the codes come back exactly
  (`recover_gguf_blocks` checks every value and declines a tensor of another type).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_GROUP = 32
# GGUF's block types whose values are an fp16 scale per 32 times an integer code, by the largest
# code's magnitude: kept as int8 codes with that scale (exact; Q5_0 and Q4_0 in 8 bits). The
# fewest codes first: Q4_0's values also fit Q5_0's rule (at half the scale, even codes).
GGUF_BLOCK_TYPES = (("q4_0", 8.0), ("q5_0", 16.0), ("q8_0", 127.0))
# Where a GGUF conversion keeps those weights (`<hf name>.codes`, `<hf name>.scales`, the type
# of each in the metadata's BLOCK_FORMATS_KEY as JSON), beside the bf16 model.safetensors: a
# safetensors file whose name the weight loader's `*.safetensors` does not take.
GGUF_BLOCKS_FILE = "weights.gguf_blocks"
BLOCK_FORMATS_KEY = "formats"
_CODE_MAX = 127.0


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """codes int8 [N, K]; scales fp32 [N, K / group]; `fmt` "int8" (per channel) or the GGUF
    block type it came from ("q8_0", "q5_0", "q4_0")."""

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: str

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The fp32 values the codes stand for, [N, K]."""
        n, k = self.codes.shape
        blocks = self.codes.float().view(n, -1, self.group) * self.scales.unsqueeze(-1)
        return blocks.view(n, k)

    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4


def quantizable(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight: 2-D with K a multiple of 64."""
    return weight.dim() == 2 and weight.shape[1] > 0 and weight.shape[1] % 64 == 0


def quantize_per_channel(weight: torch.Tensor) -> Int8Weight:
    """Symmetric int8 per output row: scale = amax / 127 (1 for an all-zero row)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / _CODE_MAX, torch.ones_like(amax))
    codes = torch.round(w / scales).clamp_(-_CODE_MAX, _CODE_MAX).to(torch.int8)
    return Int8Weight(codes.contiguous(), scales.contiguous(), "int8")


def recover_gguf_blocks(values: torch.Tensor) -> Int8Weight | None:
    """The codes and scales of a tensor dequantized from one of GGUF's symmetric block types
    (`GGUF_BLOCK_TYPES`: Q8_0, Q5_0, Q4_0; fp32 [N, K], K a multiple of 32), exactly, as int8
    codes with a scale per 32; None when these values are none of them (another type, or any
    value that is not its block's scale times an integer code)."""
    if values.dtype != torch.float32 or values.dim() != 2 or values.shape[1] % BLOCK_GROUP:
        return None
    n, k = values.shape
    blocks = values.view(n, k // BLOCK_GROUP, BLOCK_GROUP)
    amax = blocks.abs().amax(dim=-1)
    for fmt, top in GGUF_BLOCK_TYPES:
        # The block's largest value is its scale times the type's largest code (+-127 for Q8_0,
        # -16 for Q5_0, -8 for Q4_0, by how ggml quantizes), so the scale is amax / top.
        scales = amax / top
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / safe.unsqueeze(-1))
        # Exact, and every scale an fp16 (the types store one): else not this type.
        if torch.equal(codes * scales.unsqueeze(-1), blocks) and torch.equal(
            scales.half().float(), scales
        ):
            codes = codes.to(torch.int8).view(n, k).contiguous()
            return Int8Weight(codes, scales.contiguous(), fmt)
    return None


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in the kernel's layout (csrc/linear_int8.cpp): groups of four rows (the
    last padded with zeros), each group's columns 64c..64c+63 of its four rows one after the
    other, [ceil(N / 4), K / 64, 4, 64], so a tile of four rows reads one contiguous stream;
    within a row's 64, the 4-column units of the two halves interleaved (first half's unit 0,
    second half's unit 0, first half's unit 1, ...), the kernel's lane order."""
    n, k = codes.shape
    padded = torch.cat([codes, codes.new_zeros((-n) % 4, k)]) if n % 4 else codes
    # [groups, 4 rows, chunk, half, unit, 4] -> [groups, chunk, 4 rows, unit, half, 4]
    units = padded.view(-1, 4, k // 64, 2, 8, 4).permute(0, 2, 1, 4, 3, 5)
    return units.reshape(-1, k // 64, 4, 64).contiguous()


def fuse(shards: list[Int8Weight]) -> Int8Weight:
    """One weight of shards stacked along N (q/k/v, gate/up), which share a format and group."""
    if len({(w.fmt, w.group, w.codes.shape[1]) for w in shards}) != 1:
        raise ValueError("fused shards must share a format, a group and K")
    return Int8Weight(
        torch.cat([w.codes for w in shards]).contiguous(),
        torch.cat([w.scales for w in shards]).contiguous(),
        shards[0].fmt,
    )
