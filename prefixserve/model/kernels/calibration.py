"""Choice by measurement: which tile family of the native GEMM (csrc/linear/gemm_bf16_tiles.h) runs
decode-sized calls and which larger ones on this host, timed once at first start (about two seconds)
and cached per CPU model and kernel build (its sources) under the cache dir.

Every family sums each output in one order, so the choice changes speed only, never a bit: a
family is a candidate only after its outputs equal the build's FMA tiles' bit for bit on a
random problem here (with a bias, a residual, an odd K and several row counts); one that differs
is never chosen, and a warning says so. The candidates are then timed at a decode shape (1 and 8
rows over 96 MB of a small model's linears, which streams them from memory as decode does; each
family with its tiles' software prefetch on and off, ranked by the faster) and a prefill shape
(192 rows over a 2 MB weight, arithmetic-bound); each class takes the fastest,
the build's FMA tiles unless another is at least `MIN_GAIN` faster (a tie is noise). Then the
decode family's variants (the tiles' software prefetch on or off, a lone row's tile on 4 panels
or 2) are timed at a lone row, the default kept unless another is `MIN_GAIN` faster. What is
compared is timed in turns (a sample of each a round), so that a host whose speed drifts
meanwhile slows each alike: timed one after the other on a noisy VM, the portable loop came
out ahead of the AVX2 tiles at decode in four calibrations of eight.

`PREFIXSERVE_GEMM_TILES` overrides it ("avx512_bf16", "avx512,avx512_bf16", or "off" for the
build's FMA tiles without a measurement). The cache file holds the CPU's model name and flags,
the families, the timings and the choice; delete it (or change the build) to measure again.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from prefixserve.model.kernels.build import _build_tag, _module, sources_digest
from prefixserve.model.kernels.cpu_paths import cpuinfo
from prefixserve.settings import cache_root, file_lock, gemm_tiles

logger = logging.getLogger(__name__)

# Bump when what is measured or how the choice is made changes: older cache files are ignored.
CALIBRATION_VERSION = 6
# The decode variants: (software prefetch, panels of a lone row's tile); the first is the default.
DECODE_VARIANTS = ((True, 4), (False, 4), (True, 2), (False, 2))
# Another family replaces the build's FMA tiles for a class only when it is this much faster.
MIN_GAIN = 1.05


@dataclass(frozen=True, slots=True)
class GemmChoice:
    """The families decode-sized and larger calls take, the decode variant (whether
    decode-sized tiles prefetch in software, the panels of a lone row's tile), and why.
    `seconds`: per family, the measured time of the decode shape in each variant
    (`variant_key`) and of the prefill shape (None when nothing was measured)."""

    decode: str
    prefill: str
    source: str  # "measured", "cached", "PREFIXSERVE_GEMM_TILES", "one family", "off"
    families: tuple[str, ...] = ()
    prefetch: bool = True
    one_row_panels: int = 4
    seconds: dict[str, dict[str, float]] | None = None
    rejected: tuple[str, ...] = ()  # families whose bits differed from the build's here


def _cache_path() -> Path:
    """One file per CPU, torch and Python (`build._build_tag`), kernel sources, calibration
    version and thread count: a change to any of them measures again."""
    name = (
        f"gemm-{_build_tag()}-{sources_digest()}-v{CALIBRATION_VERSION}"
        f"-t{torch.get_num_threads()}.json"
    )
    return cache_root() / "calibration" / name


def _agrees(module: Any, family: str, reference: str) -> bool:
    """Whether `family` gives `reference`'s bits on random problems: plain linears (odd K, a
    bias, a residual) and the gated epilogue (SiLU and GELU, a bias)."""
    return _linears_agree(module, family, reference) and _gated_agree(module, family, reference)


def _gated_agree(module: Any, family: str, reference: str) -> bool:
    gen = torch.Generator().manual_seed(8)
    k, i = 96, 64
    w = torch.randn(2 * i, k, generator=gen).bfloat16()
    bias = torch.randn(2 * i, generator=gen).bfloat16()
    packed = module.pack_bf16_gemm(w)
    x = (torch.randn(13, k, generator=gen) * 4).bfloat16()
    was = module.gemm_bf16_selected()
    try:
        for act in (1, 2):
            outs = []
            for tiles in (family, reference):
                module.gemm_bf16_select(tiles, tiles)
                out = torch.empty(13, i, dtype=torch.bfloat16)
                module.linear_bf16_packed_gated(out, x, packed, 2 * i, bias, act, 2)
                outs.append(out)
            if not torch.equal(outs[0], outs[1]):
                return False
        return True
    finally:
        module.gemm_bf16_select(was[0], was[1])


def _linears_agree(module: Any, family: str, reference: str) -> bool:
    gen = torch.Generator().manual_seed(7)
    for k, n in ((201, 96), (640, 160)):
        w = torch.randn(n, k, generator=gen).bfloat16()
        bias = torch.randn(n, generator=gen).bfloat16()
        packed = module.pack_bf16_gemm(w)
        for rows in (1, 5, 13, 40):
            x = torch.randn(rows, k, generator=gen).bfloat16()
            res = torch.randn(rows, n, generator=gen).bfloat16()
            outs = []
            for tiles in (family, reference):
                out = torch.empty(rows, n, dtype=torch.bfloat16)
                module.linear_bf16_packed_on(out, x, packed, n, bias, 2, tiles, res)
                outs.append(out)
            if not torch.equal(outs[0], outs[1]):
                return False
    return True


def _sample(fn: Any, min_seconds: float) -> float:
    """Seconds of one call of `fn`, averaged over calls for at least `min_seconds`."""
    start, calls = time.perf_counter(), 0
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls


def _time_each(
    fns: dict[str, Any], repeats: int = 5, min_seconds: float = 0.02
) -> dict[str, float]:
    """Median seconds of one call of each of `fns`, their samples taken in turns (one of each
    a round), so that a host whose speed drifts while they are measured (another process, a
    noisy neighbour) slows each alike instead of the ones timed last."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(_sample(fn, min_seconds))
    return {name: statistics.median(times) for name, times in samples.items()}


def variant_key(prefetch: bool, one_row_panels: int) -> str:
    """The name of a decode variant's timing (a lone row) in `GemmChoice.seconds`."""
    return f"row_prefetch{int(prefetch)}_panels{one_row_panels}"


# The decode shape's weights (out, in): a small model's linears, whose panel counts split
# unevenly over the threads' jobs, cloned up to 96 MB (more than a last-level cache).
DECODE_SHAPES = ((576, 576), (960, 576), (3072, 576), (576, 1536), (1024, 1024), (2816, 1024))
DECODE_BYTES = 96 * 2**20


def _decode_stream(module: Any, gen: torch.Generator) -> list[tuple[Any, int, int]]:
    """(packed, out, in) weights for the decode shape."""
    base = [
        (module.pack_bf16_gemm(torch.randn(n, k, generator=gen).bfloat16()), n, k)
        for n, k in DECODE_SHAPES
    ]
    stream, total = [], 0
    while total < DECODE_BYTES:
        for packed, n, k in base:
            stream.append((packed.clone(), n, k))  # the bytes, not the values, matter
            total += packed.numel() * 2
    return stream


def _measure(module: Any, families: list[str]) -> dict[str, dict[str, float]]:
    """Seconds per family of the decode shape (1 and 8 rows over `_decode_stream`, with the
    tiles' software prefetch on and off; "decode" the faster) and of the prefill shape (192
    rows, 1024 x 1024); and, for the family fastest at decode, of a lone row over the stream in
    each of DECODE_VARIANTS."""
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    stream = _decode_stream(module, gen)
    square = module.pack_bf16_gemm(torch.randn(1024, 1024, generator=gen).bfloat16())
    rows = {
        r: {k: torch.randn(r, k, generator=gen).bfloat16() for k in (576, 1024, 1536)}
        for r in (1, 8)
    }
    outs = {
        r: {n: torch.empty(r, n, dtype=torch.bfloat16) for n, _ in DECODE_SHAPES} for r in (1, 8)
    }
    big = torch.randn(192, 1024, generator=gen).bfloat16()
    big_out = torch.empty(192, 1024, dtype=torch.bfloat16)
    run = module.linear_bf16_packed_on
    was = module.gemm_bf16_selected()

    def decode(tiles: str, counts: tuple[int, ...], prefetch: bool, panels: int) -> None:
        module.gemm_bf16_select("", "", int(prefetch), panels)
        for r in counts:
            for packed, n, k in stream:
                run(outs[r][n], rows[r][k], packed, n, None, threads, tiles)

    panels = DECODE_VARIANTS[0][1]
    seconds: dict[str, dict[str, float]] = {}
    try:
        decodes = _time_each(
            {
                decode_key(t, p): lambda t=t, p=p: decode(t, (1, 8), p, panels)
                for t in families
                for p in (True, False)
            }
        )
        prefills = _time_each(
            {t: lambda t=t: run(big_out, big, square, 1024, None, threads, t) for t in families}
        )
        for tiles in families:
            seconds[tiles] = _decode_timings(decodes, tiles) | {"prefill": prefills[tiles]}
        fastest = _fastest(seconds, families[0], "decode")  # the family decode will take

        variants = {variant_key(*v): lambda v=v: decode(fastest, (1,), *v) for v in DECODE_VARIANTS}
        seconds[fastest].update(_time_each(variants))
        return seconds
    finally:
        module.gemm_bf16_select("", "", int(was[3]), int(was[4]))


def decode_key(tiles: str, prefetch: bool) -> str:
    """The name of a family's decode-shape timing with software prefetch on or off."""
    return f"{tiles}_decode_prefetch{int(prefetch)}"


def _decode_timings(decodes: dict[str, float], tiles: str) -> dict[str, float]:
    """A family's decode-shape timings with prefetch on and off, and as "decode" the faster of
    the two: families are ranked each at its own better setting (ranked with prefetch on for
    all, an AVX2 build on AMD Zen 4 chose the portable loop, which never prefetches, over the
    AVX2 tiles, whose decode is faster without prefetch: BENCHMARKS.md §47)."""
    on, off = decodes[decode_key(tiles, True)], decodes[decode_key(tiles, False)]
    return {"decode": min(on, off), "decode_prefetch1": on, "decode_prefetch0": off}


def _fastest(seconds: dict[str, dict[str, float]], default: str, shape: str) -> str:
    best = min(seconds, key=lambda tiles: seconds[tiles][shape])
    return best if seconds[default][shape] >= MIN_GAIN * seconds[best][shape] else default


def _fastest_decode(
    seconds: dict[str, dict[str, float]], default: str
) -> tuple[str, tuple[bool, int]]:
    """(family, variant) for decode: the fastest family at the decode shape (the default
    unless another is MIN_GAIN faster), and its fastest variant at a lone row (the default
    variant unless another is MIN_GAIN faster)."""
    family = _fastest(seconds, default, "decode")
    timings = seconds[family]
    if variant_key(*DECODE_VARIANTS[0]) not in timings:  # the variants were timed elsewhere
        return family, DECODE_VARIANTS[0]
    runs = {variant: timings[variant_key(*variant)] for variant in DECODE_VARIANTS}
    best = min(runs, key=runs.__getitem__)
    keep = runs[DECODE_VARIANTS[0]] < MIN_GAIN * runs[best]
    return family, DECODE_VARIANTS[0] if keep else best


def _read_cache(path: Path, families: list[str]) -> GemmChoice | None:
    try:
        data = json.loads(path.read_text())
        if data.get("version") != CALIBRATION_VERSION or data.get("families") != families:
            return None
        choice = data["choice"]
        return GemmChoice(
            choice["decode"],
            choice["prefill"],
            "cached",
            tuple(families),
            bool(choice["prefetch"]),
            int(choice["one_row_panels"]),
            choice.get("seconds"),
            tuple(choice.get("rejected", ())),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(path: Path, families: list[str], choice: GemmChoice) -> None:
    info = cpuinfo()
    data = {
        "version": CALIBRATION_VERSION,
        "cpu": info.get("model name", ""),
        "flags": info.get("flags", info.get("Features", "")),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "families": families,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "choice": asdict(choice),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _forced(value: str, families: list[str], module: Any = None) -> GemmChoice:
    """The choice PREFIXSERVE_GEMM_TILES names ("off": the build's FMA tiles). With `module`,
    a named family must give the build's tiles' bits here too (the measurement's own check)."""
    if value == "off":
        return GemmChoice(families[0], families[0], "off", tuple(families))
    decode, _, prefill = (part.strip() for part in value.partition(","))
    prefill = prefill or decode
    for name in (decode, prefill):
        if name not in families:
            raise ValueError(
                f"PREFIXSERVE_GEMM_TILES names {name!r}, which does not run here; this host's "
                f"families are {', '.join(families)} (or 'off', or 'auto')"
            )
        if module is not None and name != families[0] and not _agrees(module, name, families[0]):
            raise ValueError(
                f"PREFIXSERVE_GEMM_TILES names {name!r}, whose bits differ from the "
                f"{families[0]} tiles' on this CPU: it would break batch invariance"
            )
    return GemmChoice(decode, prefill, "PREFIXSERVE_GEMM_TILES", tuple(families))


def _calibrated(module: Any, families: list[str]) -> GemmChoice:
    """The cached choice for this CPU and build, else a new measurement (written to the cache;
    where the cache cannot be written, measured for this process alone, with a warning)."""
    path = _cache_path()
    cached = _read_cache(path, families)
    if cached is not None:
        return cached
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(file_lock(path.with_suffix(".lock")))
        except OSError as exc:
            logger.warning("the calibration's cache %s is not writable (%s)", path, exc)
            return _measured(module, families)
        cached = _read_cache(path, families)  # another process may have measured meanwhile
        if cached is not None:
            return cached
        choice = _measured(module, families)
        try:
            _write_cache(path, families, choice)
        except OSError as exc:
            logger.warning("the calibration's cache %s is not writable (%s)", path, exc)
        return choice


def _measured(module: Any, families: list[str]) -> GemmChoice:
    """A new measurement: the families that give the build's bits, timed."""
    reference = families[0]
    rejected = tuple(f for f in families[1:] if not _agrees(module, f, reference))
    for family in rejected:
        logger.warning(
            "the native GEMM's %s tiles do not give the %s tiles' bits on this CPU; they "
            "are not used",
            family,
            reference,
        )
    candidates = [f for f in families if f not in rejected]
    seconds = _measure(module, candidates)
    decode, (prefetch, panels) = _fastest_decode(seconds, reference)
    return GemmChoice(
        decode,
        _fastest(seconds, reference, "prefill"),
        "measured",
        tuple(families),
        prefetch,
        panels,
        seconds,
        rejected,
    )


@functools.cache
def calibrate_gemm() -> GemmChoice | None:
    """The native GEMM's families for this process, chosen once (forced, cached or measured)
    and selected in the kernel (`gemm_bf16_select`); None without the native kernels."""
    module = _module()
    if module is None:
        return None
    families = list(module.gemm_bf16_families())
    forced = gemm_tiles()
    if forced is not None:
        choice = _forced(forced, families, module)
    elif len(families) == 1:
        choice = GemmChoice(families[0], families[0], "one family", tuple(families))
    else:
        choice = _calibrated(module, families)
    module.gemm_bf16_select(
        choice.decode, choice.prefill, int(choice.prefetch), choice.one_row_panels
    )
    logger.info("%s", describe_choice(choice))
    return choice


def describe_choice(choice: GemmChoice) -> str:
    """One line: the families chosen, how, and the measured ratios against the build's tiles."""
    prefetch = "with" if choice.prefetch else "without"
    text = (
        f"native GEMM tiles: decode {choice.decode} ({prefetch} software prefetch, a lone row "
        f"on {choice.one_row_panels} panels), prefill {choice.prefill} ({choice.source}"
    )
    if choice.seconds:
        base = choice.seconds[choice.families[0]]
        decode = base["decode"] / choice.seconds[choice.decode]["decode"]
        prefill = base["prefill"] / choice.seconds[choice.prefill]["prefill"]
        text += f"; decode {decode:.2f}x, prefill {prefill:.2f}x the {choice.families[0]} tiles"
        timings = choice.seconds[choice.decode]
        default = variant_key(*DECODE_VARIANTS[0])
        if default in timings:
            picked = timings[variant_key(choice.prefetch, choice.one_row_panels)]
            text += f"; a lone row {timings[default] / picked:.2f}x the default variant"
    if choice.rejected:
        text += f"; rejected for differing bits: {', '.join(choice.rejected)}"
    return text + ")"


def describe_calibration() -> str:
    """`describe_choice` of this process's choice, or why there is none."""
    choice = calibrate_gemm()
    return "native GEMM unavailable" if choice is None else describe_choice(choice)
