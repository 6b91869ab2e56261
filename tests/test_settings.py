"""Environment switches: read in one module, with one meaning of on and off."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import prefixserve
from prefixserve import settings

PACKAGE = Path(prefixserve.__file__).parent


@pytest.mark.parametrize(
    "value,want",
    [
        ("1", True),
        (" On ", True),
        ("yes", True),
        ("0", False),
        ("OFF", False),
        ("", None),
        ("maybe", None),
    ],
)
def test_env_switches_read_on_off_words_and_leave_the_rest_to_the_default(value, want, monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_TEST_SWITCH", value)
    assert settings.env_flag("PREFIXSERVE_TEST_SWITCH") is want
    monkeypatch.setenv("PREFIXSERVE_KERNELS", value)
    assert settings.kernels_enabled() is (want is not False)
    monkeypatch.setenv("PREFIXSERVE_FP32_PREFILL", value)
    assert settings.fp32_prefill() is want


def test_cache_root_follows_the_environment_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    assert settings.cache_root() == tmp_path
    monkeypatch.delenv("PREFIXSERVE_CACHE_DIR")
    assert settings.cache_root() == Path.home() / ".cache" / "prefixserve"


def _environment_reads(path: Path) -> list[int]:
    """Lines of `path` that touch os.environ / os.getenv / os.putenv."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("environ", "getenv", "putenv", "unsetenv")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(a.name in ("environ", "getenv", "putenv") for a in node.names):
                lines.append(node.lineno)
    return sorted(lines)


def test_only_the_settings_module_reads_the_environment():
    offenders = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "settings.py" and (lines := _environment_reads(path))
    }
    assert not offenders, f"environment read outside prefixserve/settings.py: {offenders}"


def test_the_environment_check_sees_a_read(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nx = os.environ.get('A')\ny = os.getenv('B')\n")
    assert _environment_reads(module) == [2, 3]
