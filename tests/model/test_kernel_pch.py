"""The kernel build's precompiled `torch_lite.h` (prefixserve/model/kernels/pch.py): GCC takes it
only where it comes first in a file compiled with the options it was made with, and otherwise
parses the header silently, so these check both conditions rather than trust the build's
speed."""

from __future__ import annotations

import logging
import re
import shlex

import pytest

from prefixserve.model.kernels import build, pch

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


def test_each_kernel_file_includes_a_torch_header_first():
    """A precompiled header is used only as the first include of the file compiled (not from
    inside another header): every source names torch_lite.h first, but bindings.cpp, which
    binds to Python on torch's pybind11 glue; none parses torch/extension.h (torch's C++
    frontend, 50-60 s a file)."""
    for source in build._SOURCES:
        text = source.read_text()
        first = INCLUDE.search(text)
        assert first is not None, source
        expected = "torch/csrc/utils/pybind.h" if source.name == "bindings.cpp" else "torch_lite.h"
        assert first.group(2) == expected, (source, first.group(2))
        assert "torch/extension.h" not in [m.group(2) for m in INCLUDE.finditer(text)], source


def test_the_precompiled_header_is_made_with_the_flags_torch_compiles_each_file_with():
    """The flags `pch.compile_flags` gives GCC are the ones torch wrote into this build's ninja
    file for every source, with the precompiled header's directory first on the include path."""
    if build._module() is None:
        pytest.skip("the kernels could not be built here")
    build_dir = build._build_dir()
    pch_dir = build_dir / "pch"
    if not (pch_dir / "torch_lite.h").is_file():  # the header copy marks a compile done
        assert not pch._is_gcc(_compiler()), "GCC builds precompile torch_lite.h"
        pytest.skip("no precompiled header with this compiler")
    # Released once the build was done (385 MB no later start reads).
    assert not (pch_dir / "torch_lite.h.gch").exists()
    ninja = (build_dir / "build.ninja").read_text()
    [line] = [row for row in ninja.splitlines() if row.startswith("cflags = ")]
    written = shlex.split(line.removeprefix("cflags = "))
    includes = [pch_dir, *(build._CSRC / group for group in build._GROUPS)]
    expected = pch.compile_flags(build._NAME, includes, [*build._cflags(), "-Winvalid-pch"])
    assert written == expected


def test_a_header_that_does_not_compile_leaves_the_build_without_one(tmp_path, caplog):
    """A failed precompile is a warning and no directory: nothing half-written stays where GCC
    would look."""
    if not pch._is_gcc(_compiler()):
        pytest.skip("the precompiled header is made by GCC only")
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "torch_lite.h").write_text("#error not a header\n")
    with caplog.at_level(logging.WARNING, logger=pch.__name__):
        got = pch.precompile(tmp_path / "build", tmp_path / "common", "x", [], [])
    assert got is None
    assert "not a header" in caplog.text
    assert list((tmp_path / "build" / "pch").iterdir()) == []


def _compiler() -> str:
    from torch.utils import cpp_extension

    return cpp_extension.get_cxx_compiler()
