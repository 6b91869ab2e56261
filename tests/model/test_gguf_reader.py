"""GGUF files opened through `GGUFFileReader` (model/loader/gguf_reader.py): the `gguf` package's
reader over plain array views, the same fields and tensors; and a converted file is not opened
again to be loaded."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from prefixserve.model.loader import gguf_convert, loading
from prefixserve.model.loader.default_model import default_model_gguf
from prefixserve.model.loader.gguf_reader import GGUFFileReader, open_gguf
from tests.helpers.gguf_files import finish_gguf


@pytest.fixture
def small_gguf(tmp_path):
    """A small GGUF file: a few metadata fields, a vocabulary, two tensors."""
    import gguf

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.count", 7)
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_tensor("a", np.arange(64, dtype=np.float32).reshape(4, 16))
    writer.add_tensor("b", np.ones((2, 32), dtype=np.float16))
    finish_gguf(writer)
    return path


def _same_field(mine, field, spot: int = 50) -> None:
    assert (mine.offset, mine.name, mine.types, len(mine.parts)) == (
        field.offset,
        field.name,
        field.types,
        len(field.parts),
    ), field.name
    if len(field.data) <= spot:
        assert mine.data == field.data and mine.contents() == field.contents(), field.name
        return
    # A vocabulary: its indices, and the values at both ends (contents() of 49,152 strings twice
    # would be most of this test's time).
    assert mine.data == field.data, field.name
    for index in (*range(spot), *range(len(field.data) - spot, len(field.data))):
        assert mine.contents(index) == field.contents(index), (field.name, index)


def test_the_reader_gives_the_gguf_packages_fields_and_tensors():
    path = default_model_gguf()
    ours, theirs = open_gguf(path), GGUFReader(path)
    assert isinstance(ours, GGUFFileReader) and type(ours.data) is np.ndarray
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        _same_field(ours.fields[name], field)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.tensor_type, list(mine.shape), mine.data_offset) == (
            tensor.tensor_type,
            list(tensor.shape),
            tensor.data_offset,
        )
        assert type(mine.data) is np.ndarray and np.array_equal(mine.data, tensor.data)


def test_the_reader_reads_a_small_file_whole_and_read_only(small_gguf):
    ours, theirs = open_gguf(small_gguf), GGUFReader(small_gguf)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        _same_field(ours.fields[name], field, spot=1000)
    assert ours.fields["test.count"].contents() == 7
    assert [np.asarray(t.data).tolist() for t in ours.tensors] == [
        np.asarray(t.data).tolist() for t in theirs.tensors
    ]
    with pytest.raises(ValueError, match="read-only"):
        ours.data[0] = 0


def test_a_converted_file_is_loaded_without_reading_its_metadata_again(
    tmp_path, monkeypatch, default_model_dir
):
    """The architecture is checked before a file is converted; loading a converted one does not
    parse the file again (Gemma 3's 262,144-token vocabulary took seconds on every load)."""
    gguf = tmp_path / "model.gguf"
    gguf.symlink_to(default_model_gguf())
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    target = gguf_convert.gguf_cache_dir(gguf)
    target.mkdir(parents=True)
    for name in ("config.json", gguf_convert.CONVERSION_MARKER):
        (target / name).write_text((default_model_dir / name).read_text())

    def parsed(path):
        raise AssertionError(f"{path} was parsed again")

    monkeypatch.setattr(loading, "check_gguf_architecture", parsed)
    assert loading.resolve_model_dir(gguf) == target
    target.joinpath(gguf_convert.CONVERSION_MARKER).unlink()  # not converted: checked first
    with pytest.raises(AssertionError, match="parsed again"):
        loading.resolve_model_dir(gguf)


def test_inside_a_conversion_every_reader_of_a_file_is_one(small_gguf):
    import gguf

    from prefixserve.model.loader.gguf_reader import one_reader_per_file

    path = small_gguf
    original = gguf.GGUFReader
    with one_reader_per_file():
        first = open_gguf(path)
        assert gguf.GGUFReader(str(path)) is first  # transformers' reads too
        assert open_gguf(path) is first
    assert gguf.GGUFReader is original
    assert open_gguf(path) is not first


def test_conversions_on_two_threads_take_turns_and_restore_the_package_class(small_gguf):
    """Two files converted at once in one process (their file locks differ): each block has its
    own shared readers, and the package's class is back once both are done."""
    import threading

    import gguf

    from prefixserve.model.loader.gguf_reader import one_reader_per_file

    original, seen, errors = gguf.GGUFReader, [], []

    def convert() -> None:
        try:
            with one_reader_per_file():
                first = open_gguf(small_gguf)
                seen.append(gguf.GGUFReader(str(small_gguf)) is first)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and seen == [True, True]
    assert gguf.GGUFReader is original
