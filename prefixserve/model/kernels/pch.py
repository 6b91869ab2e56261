"""A precompiled `torch_lite.h` for the kernel build (GCC only). Twelve of csrc/'s thirteen files
begin with it, and parsing ATen's headers is most of their compile time (about 12 s of 15-35 s
each on the hosts measured). It is compiled once per build directory before torch's ninja
build; its directory goes first on the include path, where GCC finds `torch_lite.h.gch` (and a
copy of the header, for headers that include it again) before csrc/common's. The compiled
form (385 MB) is removed once the build is done (`release`).

Not precompiled: torch's pybind11 glue, which bindings.cpp alone includes. Precompiling
`torch/extension.h` (what bindings.cpp and decoder_layer.cpp included then) gave a 790 MB file
and a slower build on the AVX2 host measured (162 s against 143 s with torch_lite.h alone).

GCC uses a precompiled header only where it is the first include of the file compiled (not
from inside another header) and the file is compiled with the options it was made with;
otherwise it parses the header as usual. A mismatch costs time, never correctness. The options
here are the ones torch's `cpp_extension.load` gives every source (`compile_flags`; a test
checks them against the build's ninja file), and `-Winvalid-pch` in the build's flags names a
file that could not use it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

logger = logging.getLogger(__name__)

HEADER = "torch_lite.h"
# The compile takes about 20 s on one core.
TIMEOUT_S = 600


def compile_flags(name: str, include_dirs: list[Path], cflags: list[str]) -> list[str]:
    """The flags torch's `cpp_extension.load(name, extra_include_paths=include_dirs,
    extra_cflags=cflags)` compiles each source with on Linux (`_write_ninja_file_to_build_library`
    in torch 2.13): the extension's two defines, the user then the system include paths, PIC and
    C++20, then the caller's flags."""
    return [
        f"-DTORCH_EXTENSION_NAME={name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-I{os.path.abspath(path)}" for path in include_dirs),
        *(flag for path in _system_includes() for flag in ("-isystem", path)),
        "-fPIC",
        "-std=c++20",
        *cflags,
    ]


def _system_includes() -> list[str]:
    from torch.utils import cpp_extension

    paths = list(cpp_extension.include_paths("cpu"))
    python_include = sysconfig.get_path("include", scheme="posix_prefix")
    if python_include is not None:
        paths.append(python_include)
    return paths


def _is_gcc(compiler: str) -> bool:
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return version.returncode == 0 and "Free Software Foundation" in version.stdout


def precompile(
    build_dir: Path, common_dir: Path, name: str, include_dirs: list[Path], cflags: list[str]
) -> Path | None:
    """The directory of this build's precompiled `torch_lite.h`, compiled now unless this
    build made it before (its header copy is there: `release` may have removed the compiled
    form since); None where the compiler is not GCC or the compile failed (the build then
    parses the header in each file, as before: a warning says why)."""
    from torch.utils import cpp_extension

    out_dir = build_dir / "pch"
    target = out_dir / f"{HEADER}.gch"
    if (out_dir / HEADER).is_file():
        return out_dir
    compiler = cpp_extension.get_cxx_compiler()
    if not _is_gcc(compiler):
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / f"{HEADER}.gch.partial"
    flags = compile_flags(name, include_dirs, cflags)
    command = [compiler, *flags, "-x", "c++-header", str(common_dir / HEADER), "-o", str(partial)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
        failure = None if done.returncode == 0 else done.stderr.strip()[-400:]
    except (OSError, subprocess.TimeoutExpired) as exc:
        failure = str(exc)
    if failure is not None:
        logger.warning("no precompiled %s (%s); each kernel file parses it", HEADER, failure)
        partial.unlink(missing_ok=True)
        return None
    # The header beside its compiled form: a header that includes it again after the file's
    # first include finds it here, already guarded. Written last: it marks the compile done.
    os.replace(partial, target)
    shutil.copyfile(common_dir / HEADER, out_dir / HEADER)
    return out_dir


def release(pch_dir: Path) -> None:
    """Removes the compiled header once the build is done: 385 MB, needed by no later start
    (ninja's dependencies name the header copy beside it, not the compiled form, and a file
    compiled again without it parses the copy)."""
    (pch_dir / f"{HEADER}.gch").unlink(missing_ok=True)
