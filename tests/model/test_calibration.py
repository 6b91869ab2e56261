"""The host calibration of the native GEMM's tile families (model/kernels/calibration.py): a
family is chosen only after it gives the build's bits here, the choice is cached per CPU and
build, PREFIXSERVE_GEMM_TILES overrides it, and the kernel runs what was chosen."""

from __future__ import annotations

import json

import pytest
import torch

from prefixserve.model.kernels import build, calibration

MODULE = build._module()
pytestmark = pytest.mark.skipif(MODULE is None, reason="native kernels unavailable")


def families() -> list[str]:
    return list(MODULE.gemm_bf16_families())


class OneBitOff:
    """The real kernel module, except that `family` returns its outputs with the lowest bit of
    the first element flipped: a family whose bits differ from the build's."""

    def __init__(self, family: str) -> None:
        self.family = family

    def __getattr__(self, name: str):
        return getattr(MODULE, name)

    def linear_bf16_packed_on(self, out, x, packed, n, bias, threads, tiles, residual=None):
        MODULE.linear_bf16_packed_on(out, x, packed, n, bias, threads, tiles, residual)
        if tiles == self.family:
            out.view(torch.int16).view(-1)[0] ^= 1


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PREFIXSERVE_GEMM_TILES", raising=False)
    return tmp_path


def test_every_family_here_gives_the_builds_bits_on_the_calibration_problems():
    reference = families()[0]
    for family in families():
        assert calibration._agrees(MODULE, family, reference), family


def test_a_family_whose_bits_differ_is_never_chosen(cache_dir):
    names = families()
    if len(names) < 2:
        pytest.skip("one tile family here")
    odd = names[1]
    choice = calibration._calibrated(OneBitOff(odd), names)
    assert choice.rejected == (odd,)
    assert odd not in (choice.decode, choice.prefill)
    assert odd not in choice.seconds


def test_the_choice_is_measured_once_then_read_from_the_cache(cache_dir):
    names = families()
    first = calibration._calibrated(MODULE, names)
    assert first.source == "measured"
    assert set(first.seconds) == set(names)
    variants = {calibration.variant_key(*v) for v in calibration.DECODE_VARIANTS}
    for family, timings in first.seconds.items():
        extra = variants if family == first.decode or variants <= set(timings) else set()
        measured = {"decode", "decode_prefetch0", "decode_prefetch1", "prefill"}
        assert measured <= set(timings) <= measured | variants
        assert timings["decode"] == min(timings["decode_prefetch0"], timings["decode_prefetch1"])
        assert extra <= set(timings), family
    for shape in ("decode", "prefill"):
        picked = getattr(first, shape)
        own, base = first.seconds[picked][shape], first.seconds[names[0]][shape]
        assert own * calibration.MIN_GAIN <= base or picked == names[0], shape
    path = calibration._cache_path()
    assert path.parent == cache_dir / "calibration"
    data = json.loads(path.read_text())
    assert data["families"] == names and data["choice"]["decode"] == first.decode
    assert "flags" in data and "cpu" in data
    again = calibration._calibrated(MODULE, names)
    assert again.source == "cached"
    assert (again.decode, again.prefill, again.prefetch, again.one_row_panels) == (
        first.decode,
        first.prefill,
        first.prefetch,
        first.one_row_panels,
    )
    data["version"] = calibration.CALIBRATION_VERSION + 1  # an older or newer format: measure
    path.write_text(json.dumps(data))
    assert calibration._calibrated(MODULE, names).source == "measured"
    path.write_text("{not json")  # a torn file is measured again, not an error
    assert calibration._calibrated(MODULE, names).source == "measured"


def test_a_tie_keeps_the_builds_tiles():
    seconds = {"avx512": {"decode": 1.0}, "avx512_bf16": {"decode": 0.97}, "avx2": {"decode": 2}}
    assert calibration._fastest(seconds, "avx512", "decode") == "avx512"
    seconds["avx512_bf16"]["decode"] = 0.5
    assert calibration._fastest(seconds, "avx512", "decode") == "avx512_bf16"


def test_a_family_is_ranked_at_decode_by_its_faster_prefetch_setting():
    """The build's tiles faster than another family with prefetch on, slower than it off: the
    other family's decode without prefetch wins (an AVX2 build on Zen 4: the portable loop
    never prefetches, the AVX2 tiles decode faster without)."""
    key = calibration.decode_key
    decodes = {key("avx2", True): 1.2, key("avx2", False): 0.8}
    decodes |= {key("portable", True): 1.0, key("portable", False): 1.0}
    seconds = {t: calibration._decode_timings(decodes, t) for t in ("portable", "avx2")}
    assert seconds["avx2"] == {"decode": 0.8, "decode_prefetch1": 1.2, "decode_prefetch0": 0.8}
    assert calibration._fastest(seconds, "portable", "decode") == "avx2"
    decodes[key("avx2", False)] = 1.2  # slower both ways: the build's tiles stay
    seconds = {t: calibration._decode_timings(decodes, t) for t in ("portable", "avx2")}
    assert calibration._fastest(seconds, "portable", "decode") == "portable"


def test_decode_keeps_the_default_variant_unless_another_is_faster():
    key = calibration.variant_key
    seconds = {"avx512": {"decode": 1.0}, "avx2": {"decode": 0.99}}
    seconds["avx512"].update({key(*v): 1.0 for v in calibration.DECODE_VARIANTS})
    seconds["avx512"][key(False, 4)] = 0.99  # ties: the default family and variant stay
    assert calibration._fastest_decode(seconds, "avx512") == ("avx512", (True, 4))
    seconds["avx512"][key(False, 2)] = 0.8
    assert calibration._fastest_decode(seconds, "avx512") == ("avx512", (False, 2))
    seconds["avx2"]["decode"] = 0.5  # a faster family whose variants were not timed
    assert calibration._fastest_decode(seconds, "avx512") == ("avx2", (True, 4))


def test_the_switch_forces_the_families_or_refuses_one_that_cannot_run(cache_dir):
    names = families()
    last = names[-1]
    both = calibration._forced(f"{names[0]},{last}", names)
    assert (both.decode, both.prefill, both.source) == (names[0], last, "PREFIXSERVE_GEMM_TILES")
    one = calibration._forced(last, names)
    assert (one.decode, one.prefill) == (last, last)
    off = calibration._forced("off", names)
    assert (off.decode, off.prefill, off.source) == (names[0], names[0], "off")
    with pytest.raises(ValueError, match="does not run here"):
        calibration._forced("amx_tiles", names)
    spaced = calibration._forced(f"{names[0]} , {last}", names)
    assert (spaced.decode, spaced.prefill) == (names[0], last)
    if len(names) > 1:  # a family whose bits differ here is refused even when named
        with pytest.raises(ValueError, match="bits differ"):
            calibration._forced(names[1], names, OneBitOff(names[1]))
        assert calibration._forced(names[1], names, MODULE).decode == names[1]


def test_a_family_whose_gated_epilogue_differs_is_not_in_agreement():
    names = families()
    if len(names) < 2:
        pytest.skip("one tile family here")

    class GatedOff(OneBitOff):
        def linear_bf16_packed_on(self, *args, **kwargs):
            return MODULE.linear_bf16_packed_on(*args, **kwargs)

        def linear_bf16_packed_gated(self, out, *args):
            MODULE.linear_bf16_packed_gated(out, *args)
            if MODULE.gemm_bf16_selected()[0] == self.family:
                out.view(torch.int16).view(-1)[0] ^= 1

    assert calibration._agrees(MODULE, names[1], names[0])
    assert not calibration._agrees(GatedOff(names[1]), names[1], names[0])


def test_an_unwritable_cache_measures_for_this_process_alone(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(blocker))  # a file: no directory under it
    choice = calibration._calibrated(MODULE, families())
    assert choice.source == "measured" and choice.decode in families()


def test_the_kernel_runs_the_selected_families_and_says_which():
    choice = calibration.calibrate_gemm()
    decode, prefill, split, prefetch, panels = MODULE.gemm_bf16_selected()
    assert (decode, prefill, prefetch, panels) == (
        choice.decode,
        choice.prefill,
        choice.prefetch,
        choice.one_row_panels,
    )
    assert split >= 16
    names = families()
    try:
        MODULE.gemm_bf16_select(names[-1], "")  # "" keeps the prefill class's family
        assert MODULE.gemm_bf16_selected()[:2] == (names[-1], choice.prefill)
        with pytest.raises(RuntimeError, match="unknown GEMM tile family"):
            MODULE.gemm_bf16_select("sse", "")
        with pytest.raises(RuntimeError, match="2 or 4"):
            MODULE.gemm_bf16_select("", "", -1, 3)
    finally:
        MODULE.gemm_bf16_select(
            choice.decode, choice.prefill, int(choice.prefetch), choice.one_row_panels
        )
    text = calibration.describe_choice(choice)
    assert choice.decode in text and choice.prefill in text


def test_a_change_to_the_kernel_sources_measures_again(cache_dir, monkeypatch):
    """The cache file is per CPU, torch, Python and kernel sources: new tiles are timed anew."""
    path = calibration._cache_path()
    assert build.sources_digest() in path.name
    monkeypatch.setattr(calibration, "sources_digest", lambda: "another-build")
    assert calibration._cache_path() != path


def test_what_is_compared_is_timed_in_turns():
    """Each round takes one sample of every candidate before the next round begins, so a host
    that slows down while they are measured slows each alike (one after the other, the
    candidate timed last takes all of a late slowdown)."""
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    seconds = calibration._time_each(fns, repeats=3, min_seconds=0.0)
    assert calls == ["a", "b", "c"] * 4  # a warm-up call each, then one sample each a round
    assert set(seconds) == {"a", "b", "c"} and all(s >= 0 for s in seconds.values())
