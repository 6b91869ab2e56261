"""Small GGUF files written in tests with gguf-py's writer."""

from __future__ import annotations

import gguf


def finish_gguf(writer: gguf.GGUFWriter) -> None:
    """Write the header, the metadata and the tensors added to `writer`, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
