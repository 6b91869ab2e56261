"""8-bit weights: int8 codes with fp32 scales per group of K, the one layout the native kernel
multiplies (csrc/linear/linear_int8.cpp). Two ways in:

- per-channel symmetric (`--quantization int8`, from a bf16 checkpoint): one scale per output
  row, amax / 127, codes round(w / scale), computed at load (the loader caches them on disk);
- GGUF Q8_0, Q5_0 and Q4_0 (32 codes and one fp16 scale per block): kept as the file has them,
  in 8-bit codes. transformers hands the loader the file's values dequantized to fp32 (code x
  scale, exact); ggml's rule makes the largest code of a block +-127 (Q8_0), -16 (Q5_0) or -8
  (Q4_0), so the scale is that block's amax over it and the codes come back exactly
  (`recover_gguf_blocks` checks every value and declines a tensor of another type);
- GGUF Q6_K (a scale per 16, the super-block's fp16 d times an int8 sub-scale, times a code in
  [-32, 31]): kept with its super-blocks (`q6_k_from_raw`, as Q4_K's below) and multiplied in
  6 bits (`pack_q6_k`); from the values alone (`recover_gguf_blocks`, the largest code found by
  trying each) as int8 codes with a scale per 16;
- GGUF Q4_K (super-blocks of 256: an fp16 d and dmin, per 32 a 6-bit sub-scale sc and sub-min m,
  codes q in [0, 15]; value = d sc q - dmin m): kept as "q4_k" with its super-blocks
  (`q4_k_from_raw`: read from the file's own blocks, as the values cannot always tell them; the
  loader matches them to transformers' values row by row and checks every value exactly), and
  multiplied in them (`pack_q4_k`, csrc/linear/linear_q4k.cpp). Q4_1 (the default model's file)
  has no super-blocks and is not kept: the default model's numerics stay its bf16 values.

The kernel reads Q4_0's and Q5_0's codes in 4 and 5 bits (`packed_weight`): the same integers, so
the same bits out, from half or five eighths of the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_GROUP = 32
# GGUF's block types whose values are an fp16 scale per 32 times an integer code, by the largest
# code's magnitude: kept as int8 codes with that scale (exact; Q5_0 and Q4_0 in 8 bits). The
# fewest codes first: Q4_0's values also fit Q5_0's rule (at half the scale, even codes).
GGUF_BLOCK_TYPES = (("q4_0", 8.0), ("q5_0", 16.0), ("q8_0", 127.0))
# GGUF's Q6_K: a scale per 16 values, codes in [-32, 31] (up to sign, as recovered: +-32 at most).
Q6_K_GROUP = 16
Q6_K_TOP = 32.0
# Where a GGUF conversion keeps those weights (`<hf name>.codes`, `<hf name>.scales`, the type
# of each in the metadata's BLOCK_FORMATS_KEY as JSON), beside the bf16 model.safetensors: a
# safetensors file whose name the weight loader's `*.safetensors` does not take.
GGUF_BLOCKS_FILE = "weights.gguf_blocks"
BLOCK_FORMATS_KEY = "formats"
_CODE_MAX = 127.0
# The formats whose codes the kernel reads in fewer bits, by their bits: the codes of a block lie
# in [-2^(b-1), 2^(b-1) - 1] once the block's sign is chosen so (`_narrow_codes`).
LOW_BIT_FORMATS = {"q4_0": 4, "q5_0": 5}
# The kernel's summation order for weights with groups of 32 or more (per-channel int8, Q8_0,
# Q5_0, Q4_0: spans of up to 16 groups summed in integers, csrc/linear/linear_int8.cpp), named in
# the disk tier's namespace (`weights_numerics`): K/V that an earlier order computed (one float
# step per 64 columns) round otherwise, so they are not this build's hits. Change the name with
# the order.
SPAN_ORDER = "int8-spans16"
_SPAN_FORMATS = frozenset({"int8", "q8_0", "q5_0", "q4_0"})
# The formats of int8 codes with a scale per 32, symmetric: shards of them fuse as one.
_PER_32_SYMMETRIC = {fmt for fmt, _ in GGUF_BLOCK_TYPES}


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """codes int8 [N, K]; scales fp32 [N, K / group]; `fmt` "int8" (per channel) or the GGUF
    block type it came from ("q8_0", "q5_0", "q4_0", "q6_k", "q4_k"); mins fp32 [N, K / group]
    for an affine one ("q4_k": value = code x scale + min, codes in [0, 15]), else None; and a
    K-quant's super-blocks, `super_scales` fp16 [N, K / 256, 2] (Q4_K's d, dmin: each scale d
    times a 6-bit sub-scale, each min -dmin times a 6-bit sub-min) or [N, K / 256, 1] (Q6_K's d:
    each scale per 16 d times an int8 sub-scale), exactly. A fused weight of Q4_K rows then
    Q6_K rows ("q4_k+q6_k", `fuse`) keeps the two as `parts`, its scales and mins per 16."""

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: str
    mins: torch.Tensor | None = None
    super_scales: torch.Tensor | None = None
    parts: tuple[Int8Weight, ...] | None = None

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The fp32 values the codes stand for, [N, K]."""
        n, k = self.codes.shape
        blocks = self.codes.float().view(n, -1, self.group) * self.scales.unsqueeze(-1)
        if self.mins is not None:
            blocks = blocks + self.mins.unsqueeze(-1)
        return blocks.view(n, k)

    def nbytes(self) -> int:
        mins = 0 if self.mins is None else self.mins.numel() * 4
        supers = 0 if self.super_scales is None else self.super_scales.numel() * 2
        return self.codes.numel() + self.scales.numel() * 4 + mins + supers


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
    (`GGUF_BLOCK_TYPES`: Q8_0, Q5_0, Q4_0, with a scale per 32; then Q6_K, with a scale per 16;
    fp32 [N, K], K a multiple of 32), exactly, as int8 codes; None when these values are none of
    them (another type, or any value that is not its block's scale times an integer code)."""
    if values.dtype != torch.float32 or values.dim() != 2 or values.shape[1] % BLOCK_GROUP:
        return None
    return _recover_per_32(values) or _recover_q6_k(values)


def _recover_per_32(values: torch.Tensor) -> Int8Weight | None:
    """Q8_0, Q5_0 or Q4_0 blocks of these values (`recover_gguf_blocks`), or None. Each type is
    tried on row 0 first, the whole tensor only for the type row 0 fits (a large embedding is
    one pass, not three)."""
    for fmt, top in GGUF_BLOCK_TYPES:
        if _per_32_codes(values[:1], top) is None:
            continue
        found = _per_32_codes(values, top)
        if found is not None:
            return Int8Weight(*found, fmt)
    return None


def _per_32_codes(values: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 codes, scales per 32) of values whose every block's largest is its scale times
    `top` (+-127 for Q8_0, -16 for Q5_0, -8 for Q4_0, by how ggml quantizes), or None."""
    n, k = values.shape
    blocks = values.reshape(n, k // BLOCK_GROUP, BLOCK_GROUP)
    scales = blocks.abs().amax(dim=-1) / top
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe.unsqueeze(-1))
    # Exact, and every scale an fp16 (the types store one): else not this type.
    if torch.equal(codes * scales.unsqueeze(-1), blocks) and torch.equal(
        scales.half().float(), scales
    ):
        return codes.to(torch.int8).view(n, k).contiguous(), scales.contiguous()
    return None


def _recover_q6_k(values: torch.Tensor) -> Int8Weight | None:
    """Q6_K blocks of these values: per 16, a scale times codes in [-32, 31]. llama.cpp picks a
    sub-block's scale by a search, so its largest value's code is any of 1..32: each is tried,
    and a block takes the first that gives back its values exactly. Row 0 alone first: a tensor
    of another type is declined after one row's tries."""
    if _per_16_codes(values[:1]) is None:
        return None
    found = _per_16_codes(values)
    if found is None:
        return None
    codes, scales = found
    return Int8Weight(codes, scales, "q6_k")


def _per_16_codes(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 codes [N, K], fp32 scales [N, K / 16]) giving back these values exactly, each block
    of 16 a scale times codes in [-Q6_K_TOP, Q6_K_TOP], or None."""
    n, k = values.shape
    blocks = values.reshape(n, k // Q6_K_GROUP, Q6_K_GROUP)
    amax = blocks.abs().amax(dim=-1)
    found = amax == 0  # all-zero blocks: codes 0, scale 0
    codes = torch.zeros_like(blocks)
    scales = torch.zeros_like(amax)
    for top in range(int(Q6_K_TOP), 0, -1):
        scale = amax / top
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        tried = torch.round(blocks / safe.unsqueeze(-1))
        exact = (tried * scale.unsqueeze(-1) == blocks).all(dim=-1) & ~found
        codes = torch.where(exact.unsqueeze(-1), tried, codes)
        scales = torch.where(exact, scale, scales)
        found |= exact
        if bool(found.all()):
            return codes.to(torch.int8).view(n, k).contiguous(), scales.contiguous()
    return None


def in_span_order(codes: torch.Tensor, group: int) -> torch.Tensor:
    """Codes [R, K] with each row's columns in the kernel's span order
    (csrc/linear/linear_int8.cpp): the row's groups of 32 in spans of 16 while they last, then
    8, 4 and 2 (2 always for a weight whose groups are 16 columns); a span of n groups is n / 2
    steps of 64 codes, where lane l of step t holds columns 4 (t (16 / n) + l / n) .. + 3 of the
    span's group l % n. Column 32 g + 4 (t (16 / n) + r) + b of the span thus goes to step t,
    lane g + n r, byte b: a permutation of [g, t, r, b] to [t, r, g, b], by spans of one width."""
    rows, k = codes.shape
    widest = 16 if group % 32 == 0 else 2
    parts, g0, groups = [], 0, k // 32
    while g0 < groups:
        n = widest
        while n > groups - g0:
            n //= 2
        count = (groups - g0) // n if n == widest else 1  # the spans of this width in a row
        spans = codes[:, 32 * g0 : 32 * (g0 + count * n)].reshape(
            rows, count, n, n // 2, 16 // n, 4
        )
        parts.append(spans.permute(0, 1, 3, 4, 2, 5).reshape(rows, -1))
        g0 += count * n
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].contiguous()


def pack_codes(codes: torch.Tensor, bits: int = 8, *, group: int) -> torch.Tensor:
    """int8 codes [N, K] of a weight with scales per `group` columns in the kernel's layout
    (csrc/linear/linear_int8.cpp): each row's codes in the span order (`in_span_order`), in groups
    of four rows (the last padded with zeros), each group's steps of 64 codes of its four rows one
    after the other, [ceil(N / 4), K / 64, 4, 64], so a tile of four rows reads one contiguous
    stream.

    `bits` 4 or 5 (codes in [-2^(b-1), 2^(b-1) - 1]): each row's 64 stored unsigned (code +
    2^(b-1)) as uint8 [.., 32] of nibble pairs (byte i: lane-order code i low, code i + 32 high),
    5-bit codes followed by their fifth bits in 8 bytes (bit p of the little-endian 64: code p's),
    [.., 40]."""
    n, k = codes.shape
    padded = torch.cat([codes, codes.new_zeros((-n) % 4, k)]) if n % 4 else codes
    # [groups, 4 rows, step, 64] -> [groups, step, 4 rows, 64]
    lanes = in_span_order(padded, group).view(-1, 4, k // 64, 64).transpose(1, 2).contiguous()
    if bits == 8:
        return lanes
    if bits not in (4, 5):
        raise ValueError(f"codes are packed in 4, 5 or 8 bits, not {bits}")
    zero = 1 << (bits - 1)
    if int(lanes.min()) < -zero or int(lanes.max()) >= zero:
        raise ValueError(f"codes outside [{-zero}, {zero - 1}] do not fit {bits} bits")
    stored = (lanes.to(torch.int16) + zero).to(torch.uint8)
    nibbles = (stored[..., :32] & 0x0F) | ((stored[..., 32:] & 0x0F) << 4)
    if bits == 4:
        return nibbles.contiguous()
    fifth = ((stored >> 4) & 1).view(*stored.shape[:-1], 8, 8)
    place = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)
    fifth_bytes = (fifth * place).sum(-1, dtype=torch.int32).to(torch.uint8)
    return torch.cat([nibbles, fifth_bytes], dim=-1).contiguous()


def _narrow_codes(weight: Int8Weight, bits: int) -> Int8Weight | None:
    """The weight with each block's codes in [-2^(b-1), 2^(b-1) - 1], or None where they cannot
    be. ggml's Q4_0 and Q5_0 give the block's largest value the code -2^(b-1) with a scale of
    either sign; recovered with a positive scale, a block whose largest value was positive has
    codes in [-2^(b-1) + 1, 2^(b-1)]: such blocks take the negated codes and scale (the same
    values, and the same products: negation is exact)."""
    zero = 1 << (bits - 1)
    n, k = weight.codes.shape
    blocks = weight.codes.view(n, -1, weight.group)
    flip = blocks.amax(dim=-1) >= zero  # [N, groups]
    codes = torch.where(flip.unsqueeze(-1), -blocks, blocks)
    if int(codes.min()) < -zero or int(codes.max()) >= zero:
        return None
    scales = torch.where(flip, -weight.scales, weight.scales)
    return Int8Weight(codes.view(n, k).contiguous(), scales.contiguous(), weight.fmt)


def packed_weight(weight: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, scales) for the kernel: Q4_K and Q6_K in their super-blocks (`pack_q4_k`,
    `pack_q6_k`), Q4_0 and Q5_0 in 4 and 5 bits where their codes fit (`LOW_BIT_FORMATS`), the
    rest in 8; scales per 32 in float16 where it holds them exactly. An affine weight (mins)
    needs its super-blocks."""
    if weight.parts is not None:
        return pack_k_quant_mix(*weight.parts)
    if weight.super_scales is not None:
        return pack_q4_k(weight) if weight.fmt == "q4_k" else pack_q6_k(weight)
    if weight.mins is not None:
        raise ValueError("an affine weight (Q4_K) needs its super-blocks to be multiplied")
    bits = LOW_BIT_FORMATS.get(weight.fmt, 8)
    narrow = _narrow_codes(weight, bits) if bits < 8 else None
    if narrow is None:
        return pack_codes(weight.codes, group=weight.group), _kernel_scales(
            weight.scales, weight.group
        )
    return pack_codes(narrow.codes, bits, group=narrow.group), _kernel_scales(
        narrow.scales, narrow.group
    )


def _kernel_scales(scales: torch.Tensor, group: int) -> torch.Tensor:
    """Scales per 32 that float16 holds exactly (GGUF Q8_0's, Q5_0's and Q4_0's: the file's own
    fp16) in float16, which the kernel reads as they are: the same values in half the bytes
    (Q8_0 at 8.5 bits a weight, not 9); others as they are, float32."""
    if group != BLOCK_GROUP or scales.dtype != torch.float32:
        return scales
    half = scales.half()
    return half.contiguous() if torch.equal(half.float(), scales) else scales


def fusable(shards: list[Int8Weight]) -> bool:
    """Whether `fuse` takes these shards: one format (with super-blocks in all or none),
    symmetric ones with a scale per 32, or Q4_K ones then Q6_K ones (`_k_quant_mix`)."""
    fmts = {w.fmt for w in shards}
    shapes = {(w.group, w.codes.shape[1], w.super_scales is None) for w in shards}
    one = len(shapes) == 1 and (len(fmts) == 1 or fmts <= _PER_32_SYMMETRIC)
    return one or _k_quant_mix(shards)


def _k_quant_mix(shards: list[Int8Weight]) -> bool:
    """Whether these shards are Q4_K ones then Q6_K ones, all with super-blocks and one K, the
    Q4_K rows a multiple of 4 (the kernel's groups of rows do not straddle the two)."""
    fmts = [w.fmt for w in shards]
    q4 = fmts.count("q4_k")
    return (
        0 < q4 < len(fmts)
        and fmts == ["q4_k"] * q4 + ["q6_k"] * (len(fmts) - q4)
        and all(w.super_scales is not None for w in shards)
        and len({w.codes.shape[1] for w in shards}) == 1
        and sum(w.codes.shape[0] for w in shards[:q4]) % 4 == 0
    )


def fuse(shards: list[Int8Weight]) -> Int8Weight:
    """One weight of shards stacked along N (q/k/v, gate/up), which share a format and group;
    or, of Q4_0 / Q5_0 / Q8_0 shards mixed (llama.cpp's Q4_K_M gives v more bits than q and k),
    one "q8_0" weight: all are int8 codes with a scale per 32, exactly."""
    if not fusable(shards):
        raise ValueError(
            "fused shards must share a format (or mix Q4_0, Q5_0, Q8_0, or be Q4_K then Q6_K), "
            "group and K"
        )
    if _k_quant_mix(shards):
        return _fuse_k_quant_mix(shards)
    mins = None if shards[0].mins is None else torch.cat([w.mins for w in shards]).contiguous()
    supers = None
    if shards[0].super_scales is not None:
        supers = torch.cat([w.super_scales for w in shards]).contiguous()
    return Int8Weight(
        torch.cat([w.codes for w in shards]).contiguous(),
        torch.cat([w.scales for w in shards]).contiguous(),
        shards[0].fmt if len({w.fmt for w in shards}) == 1 else "q8_0",
        mins,
        supers,
    )


# GGUF's K-quants: super-blocks of Q4_K_SUPER values. Q4_K's block in the file is
# Q4_K_BLOCK_BYTES (fp16 d and dmin, 12 bytes of 6-bit sub-scales and sub-mins, 128 of
# nibbles), Q6_K's Q6_K_BLOCK_BYTES (128 bytes of low nibbles, 64 of high bit pairs, 16 int8
# sub-scales, fp16 d).
Q4_K_SUPER = 256
Q4_K_BLOCK_BYTES = 144
Q6_K_BLOCK_BYTES = 210
# The kernels' layouts of a group of four rows' super-block (csrc/linear/kquant.h): Q4_K the rows'
# 128 bytes of nibbles, then their 8 sub-scales each, then their 8 sub-mins each; Q6_K the rows'
# 128 bytes of low nibbles, then their 64 of high bit pairs, then their 16 sub-scales each.
_Q4_K_GROUP_BYTES = 4 * 128 + 2 * 4 * 8
_Q6_K_GROUP_BYTES = 4 * (128 + 64 + 16)


def q4_k_from_raw(raw: torch.Tensor) -> Int8Weight:
    """The "q4_k" weight of a file's Q4_K tensor, uint8 [N, K / 256 x 144] (ggml's block_q4_K,
    row by row), exactly: its dequantize() is the `gguf` package's values bit for bit (fp32
    (d sc) x q - (dmin m), both products exact)."""
    n = raw.shape[0]
    blocks = raw.contiguous().view(n, -1, Q4_K_BLOCK_BYTES)
    supers = blocks[..., :4].contiguous().view(torch.float16).view(n, -1, 2)
    packed = blocks[..., 4:16].to(torch.int32)
    # ggml's get_scale_min_k4: bytes 0-3 sub-scales 0-3 (low 6 bits), 4-7 sub-mins 0-3; bytes
    # 8-11 the low 4 bits of sub-scales 4-7 and sub-mins 4-7, their top 2 bits in bytes 0-7's.
    first, second, third = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sub_scales = torch.cat([first & 63, (third & 15) | ((first >> 6) << 4)], dim=-1)
    sub_mins = torch.cat([second & 63, (third >> 4) | ((second >> 6) << 4)], dim=-1)
    nibbles = blocks[..., 16:].view(n, -1, 4, 1, 32)
    codes = torch.cat([nibbles & 15, nibbles >> 4], dim=3).view(n, -1).to(torch.int8)
    d, dmin = supers[..., :1].float(), supers[..., 1:].float()
    scales = (d * sub_scales.float()).view(n, -1)
    mins = -(dmin * sub_mins.float()).view(n, -1)
    return Int8Weight(codes.contiguous(), scales.contiguous(), "q4_k", mins.contiguous(), supers)


def quantize_q4_k(weight: torch.Tensor) -> Int8Weight:
    """A weight [N, K] (K a multiple of 256) in Q4_K's form, simply (for tests and benchmarks,
    not ggml's search): per 32 the range over 15 and the least value (at most 0), per 256 d and
    dmin the largest of them over 63 in fp16, the 6-bit sub-scales and sub-mins rounded."""
    w = weight.detach().float()
    n, k = w.shape
    blocks = w.view(n, k // Q4_K_SUPER, 8, 32)
    low = blocks.amin(-1).clamp(max=0.0)
    step = (blocks.amax(-1) - low) / 15
    d = (step.amax(-1, keepdim=True) / 63).half().float()
    dmin = (-low).amax(-1, keepdim=True).div(63).half().float()
    sub_scales = torch.where(d > 0, step / d.clamp_min(1e-30), 0.0).round().clamp(0, 63)
    sub_mins = torch.where(dmin > 0, -low / dmin.clamp_min(1e-30), 0.0).round().clamp(0, 63)
    scales, mins = d * sub_scales, -(dmin * sub_mins)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = ((blocks - mins.unsqueeze(-1)) / safe.unsqueeze(-1)).round().clamp(0, 15)
    supers = torch.cat([d, dmin], dim=-1).half()
    return Int8Weight(
        codes.to(torch.int8).view(n, k).contiguous(),
        scales.view(n, -1).contiguous(),
        "q4_k",
        mins.view(n, -1).contiguous(),
        supers.contiguous(),
    )


def _sub_integers(per_32: torch.Tensor, per_256: torch.Tensor) -> torch.Tensor:
    """The 6-bit integers c with per_32 = per_256 x c exactly (per_256 fp16 [N, K / 256]), uint8
    [N, K / 256, 8]; ValueError where a value is none."""
    n = per_32.shape[0]
    unit = per_256.float().view(n, -1, 1)
    ints = torch.where(unit != 0, per_32.view(n, -1, 8) / unit.clamp_min(1e-38), 0.0).round()
    if not torch.equal(ints * unit, per_32.view(n, -1, 8)) or ints.min() < 0 or ints.max() > 63:
        raise ValueError("Q4_K scales and mins must be d and dmin times 6-bit integers")
    return ints.to(torch.uint8)


def pack_q4_k(weight: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [ceil(N / 4), K / 256, 576], d_dmin fp16 [N, 2 K / 256]): a Q4_K weight in
    the kernel's super-block layout (csrc/linear/linear_q4k.cpp), rows in groups of four (the last
    padded with zeros): byte i of a row's 128 holds the codes at positions i and i + 64 of each
    128 in x's order (`_x_order`), low nibble and high, so each 32-bit lane's eight codes lie in
    one sub-block."""
    if weight.super_scales is None or weight.mins is None or weight.codes.shape[1] % Q4_K_SUPER:
        raise ValueError("Q4_K packing needs super-blocks of 256 (d, dmin) and mins")
    n = weight.codes.shape[0]
    supers = weight.super_scales.view(n, -1, 2)
    sub_scales = _sub_integers(weight.scales, supers[..., 0])
    sub_mins = _sub_integers(-weight.mins, supers[..., 1])
    codes = weight.codes.to(torch.uint8).view(n, -1, Q4_K_SUPER)[..., _x_order()]
    codes = codes.view(n, -1, 2, 2, 64)  # [.., load, low / high nibble, byte]
    nibbles = (codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)).view(n, -1, 128)
    rows = torch.cat([nibbles, sub_scales, sub_mins], dim=-1)  # [N, K / 256, 144]
    packed = _groups_of_four(rows, (128, 136, 144))
    assert packed.shape[-1] == _Q4_K_GROUP_BYTES
    return packed.contiguous(), supers.reshape(n, -1).contiguous()


def _groups_of_four(rows: torch.Tensor, ends: tuple[int, ...]) -> torch.Tensor:
    """Per-row super-block bytes [N, K / 256, B] (fields ending at `ends`, the last B) in the
    kernels' layout [ceil(N / 4), K / 256, 4 B]: rows in groups of four (the last padded with
    zero rows), each field of the four rows together, field after field."""
    pad = (-rows.shape[0]) % 4
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])])
    groups = rows.view(-1, 4, *rows.shape[1:]).transpose(1, 2)  # [G, K / 256, 4 rows, B]
    starts = (0, *ends[:-1])
    fields = [
        groups[..., a:b].reshape(*groups.shape[:2], 4 * (b - a))
        for a, b in zip(starts, ends, strict=True)
    ]
    return torch.cat(fields, dim=-1)


def q6_k_from_raw(raw: torch.Tensor) -> Int8Weight:
    """The "q6_k" weight of a file's Q6_K tensor, uint8 [N, K / 256 x 210] (ggml's block_q6_K,
    row by row), exactly: codes q - 32 in [-32, 31], scales per 16 d x sc, its d; dequantize()
    is the `gguf` package's values bit for bit."""
    n = raw.shape[0]
    blocks = raw.contiguous().view(n, -1, Q6_K_BLOCK_BYTES)
    # Per half of 128: low nibbles of bytes 0-63 are columns 0-63, high nibbles 64-127; bit
    # pair t of byte l of the 32 high bytes is column 32t + l's top bits.
    low = blocks[..., :128].view(n, -1, 2, 1, 64)
    low = torch.cat([low & 15, low >> 4], dim=3).view(n, -1, 2, 128)
    high = blocks[..., 128:192].view(n, -1, 2, 1, 32)
    high = torch.cat([(high >> (2 * t)) & 3 for t in range(4)], dim=3).view(n, -1, 2, 128)
    codes = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).view(n, -1)
    sub_scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    d = blocks[..., 208:210].contiguous().view(torch.float16).view(n, -1, 1)
    scales = (d.float() * sub_scales).view(n, -1)
    return Int8Weight(codes.contiguous(), scales.contiguous(), "q6_k", None, d.contiguous())


def _x_order() -> torch.Tensor:
    """The column of each position of a super-block in the kernels' x order (kquant.h
    `x_column`): 128 columns a 64-byte load, its low nibbles' then its high ones'; 32-bit lane L
    of load p holds columns 128 p + 8 L .. + 3 low and the next four high (one sub-block)."""
    q = torch.arange(Q4_K_SUPER)
    pair, high, r = q // 128, (q // 64) % 2, q % 64
    return 128 * pair + 8 * (r // 4) + 4 * high + r % 4


def pack_q6_k(weight: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [ceil(N / 4), K / 256, 832], d fp16 [N, K / 256]): a Q6_K weight in the
    kernel's layout (csrc/linear/linear_q6k.cpp), 6 bits a code in x's column order, rows in
    groups of four (the last padded with zeros)."""
    if weight.super_scales is None or weight.codes.shape[1] % Q4_K_SUPER:
        raise ValueError("Q6_K packing needs super-blocks of 256 and their d")
    n = weight.codes.shape[0]
    d = weight.super_scales.view(n, -1)
    unit = d.float().view(n, -1, 1)
    per_16 = weight.scales.view(n, -1, 16)
    sub = torch.where(unit != 0, per_16 / torch.where(unit != 0, unit, 1.0), 0.0).round()
    if not torch.equal(sub * unit, per_16) or sub.min() < -128 or sub.max() > 127:
        raise ValueError("Q6_K scales must be d times int8 sub-scales")
    q = (weight.codes.to(torch.int16) + 32).view(n, -1, Q4_K_SUPER)[..., _x_order()]
    if int(q.min()) < 0 or int(q.max()) > 63:
        raise ValueError("Q6_K codes must lie in [-32, 31]")
    q = q.to(torch.uint8).view(n, -1, 2, 2, 64)  # [.., pair, low / high nibble, byte]
    low = (q[:, :, :, 0] & 15) | ((q[:, :, :, 1] & 15) << 4)  # [N, K / 256, 2, 64]
    pairs = (q >> 4).view(n, -1, 2, 4, 32)
    high = pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 2) | (pairs[:, :, :, 2] << 4)
    high = high | (pairs[:, :, :, 3] << 6)  # [N, K / 256, 2, 32]
    rows = torch.cat(
        [low.reshape(n, -1, 128), high.reshape(n, -1, 64), sub.to(torch.int8).view(torch.uint8)],
        dim=-1,
    )
    packed = _groups_of_four(rows, (128, 192, 208))
    assert packed.shape[-1] == _Q6_K_GROUP_BYTES
    return packed.contiguous(), d.contiguous()


def _fuse_k_quant_mix(shards: list[Int8Weight]) -> Int8Weight:
    """Q4_K shards then Q6_K shards as one "q4_k+q6_k" weight: each format's shards fused as
    `parts`, and for everything else codes, scales and mins per 16 (Q4_K's per 32 repeated,
    Q6_K's mins 0) that give back every value."""
    q4 = [w for w in shards if w.fmt == "q4_k"]
    parts = (fuse(q4), fuse(shards[len(q4) :]))
    scales = torch.cat([parts[0].scales.repeat_interleave(2, dim=1), parts[1].scales])
    mins = torch.cat([parts[0].mins.repeat_interleave(2, dim=1), torch.zeros_like(parts[1].scales)])
    codes = torch.cat([parts[0].codes, parts[1].codes])
    return Int8Weight(codes, scales, "q4_k+q6_k", mins, None, parts)


def pack_k_quant_mix(q4_k: Int8Weight, q6_k: Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [bytes], scales fp16 [N, 2 K / 256]) of a fused weight's Q4_K rows then Q6_K
    rows for the kernel (csrc/linear/kquant.h kMixed): both packed groups flat, one after the
    other; a Q6_K row's d in the first K / 256 of its scales, zeros after."""
    codes_4, d_dmin = pack_q4_k(q4_k)
    codes_6, d = pack_q6_k(q6_k)
    scales = torch.cat([d_dmin, torch.cat([d, torch.zeros_like(d)], dim=1)])
    return torch.cat([codes_4.view(-1), codes_6.view(-1)]).contiguous(), scales.contiguous()


def weights_numerics(quantization: str | None) -> str:
    """What the disk tier's namespace adds for a model's weight formats (`quantize_model`'s
    "q8_0", "int8+q8_0", ...): the formats, and the span order where any format takes it."""
    if not quantization:
        return ""
    spans = any(fmt in _SPAN_FORMATS for fmt in quantization.split("+"))
    return f"/weights-{quantization}" + (f"/{SPAN_ORDER}" if spans else "")
