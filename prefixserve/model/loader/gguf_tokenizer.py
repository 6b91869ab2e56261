"""Repairs to the tokenizer transformers converts from a GGUF file.

transformers' GGUF converter gets some tokenizers wrong: Gemma's vocabulary becomes a Unigram
model (it is BPE), special-token roles can be lost, and `tokenizer.ggml.add_bos_token` is
ignored. These functions rebuild or fix what the file itself says.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from prefixserve.model.loader.gguf_reader import open_gguf

# The scalar metadata the conversion reads besides what transformers reads. Opening a GGUF file
# parses every field, the vocabulary's arrays included (about 6 s for SmolLM2's 49,152 tokens and
# their merges), so the architecture check and the tokenizer repairs share one read of a file.
_METADATA_KEYS = (
    "general.architecture",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
)


def gguf_metadata(gguf_path: Path) -> dict[str, Any]:
    """The file's general.architecture and tokenizer.ggml special-token ids and add flags (the
    keys it has of them), read once per file version (path, size and mtime) in a process."""
    stat = gguf_path.stat()
    return dict(_read_metadata(str(gguf_path.resolve()), stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _read_metadata(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    fields = open_gguf(path).fields
    return {key: fields[key].contents() for key in _METADATA_KEYS if key in fields}


def gemma_tokenizer_from_gguf(gguf_path: Path, special: dict[str, int]) -> Any:
    """Gemma's SentencePiece-BPE tokenizer rebuilt from a GGUF file's vocabulary.

    transformers' GGUF converter (4.57) turns Gemma's vocabulary into a Unigram model, but the
    scores llama.cpp stores for Gemma are BPE merge ranks, not log-probabilities, so it
    tokenizes "capital" as "c ap it al". This builds what transformers' own GemmaConverter
    builds from the SentencePiece file: a byte-fallback BPE whose merges are ordered by the
    piece scores (`generate_merges`), control and user-defined pieces as added tokens.
    """
    from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import generate_merges

    fields = open_gguf(gguf_path).fields
    pieces = [str(p) for p in fields["tokenizer.ggml.tokens"].contents()]
    scores = [float(s) for s in fields["tokenizer.ggml.scores"].contents()]
    # 3 = control (<bos>, <start_of_turn>), 4 = user-defined (newline runs, <start_of_image>).
    types = [int(t) for t in fields["tokenizer.ggml.token_type"].contents()]
    vocab_scores = [
        (piece, 0.0 if kind in (3, 4) else score)
        for piece, score, kind in zip(pieces, scores, types, strict=True)
    ]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    if "\t" not in vocab and "<0x09>" in vocab:
        vocab["\t"] = vocab["<0x09>"]
    merges = generate_merges(vocab, vocab_scores)
    unk = pieces[special["unk"]] if "unk" in special else None
    raw = RawTokenizer(
        BPE(
            {piece: i for i, piece in enumerate(pieces)},
            merges,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    turn_markers = {"<start_of_turn>", "<end_of_turn>"}
    raw.add_tokens(
        [
            AddedToken(piece, normalized=False, special=kind == 3 or piece in turn_markers)
            for piece, kind in zip(pieces, types, strict=True)
            if kind in (3, 4)
        ]
    )
    raw.normalizer = normalizers.Replace(" ", "\u2581")
    raw.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    raw.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    names = {role: pieces[i] for role, i in special.items()}
    if "bos" in names:  # Gemma expects BOS first (tokenizer.ggml.add_bos_token)
        bos = names["bos"]
        raw.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, special["bos"])],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=names.get("bos"),
        eos_token=names.get("eos"),
        unk_token=names.get("unk"),
        pad_token=names.get("pad"),
    )


def parsed_special_token_ids(gguf_path: Path) -> dict[str, int]:
    """bos/eos/unk/pad ids as stored in the GGUF metadata (missing roles are left out)."""
    metadata = gguf_metadata(gguf_path)
    ids: dict[str, int] = {}
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            ids[role] = int(value)
    return ids


def gguf_add_special_token_flags(gguf_path: Path) -> dict[str, bool]:
    """tokenizer.ggml.add_bos_token / add_eos_token as {"bos": ..., "eos": ...} (absent ones
    are left out)."""
    metadata = gguf_metadata(gguf_path)
    flags: dict[str, bool] = {}
    for role in ("bos", "eos"):
        value = metadata.get(f"tokenizer.ggml.add_{role}_token")
        if value is not None:
            flags[role] = bool(value)
    return flags


def set_text_special_tokens(
    tokenizer: Any, special: dict[str, int], flags: dict[str, bool]
) -> dict[str, bool]:
    """Make `tokenizer` (a fast HF tokenizer) put BOS before and EOS after an encoded text as
    `flags` say; a role missing from `flags` keeps what the tokenizer already does. Returns
    what it adds now, {"bos": bool, "eos": bool}.

    The post-processor is replaced only where it disagrees, so one that already agrees (Gemma's
    BOS, Qwen's byte-level one) is kept as it is.
    """
    from tokenizers import processors

    backend = tokenizer.backend_tokenizer
    probe = "a"
    plain = backend.encode(probe, add_special_tokens=False).ids
    full = backend.encode(probe).ids
    ids = {role: special.get(role) for role in ("bos", "eos")}
    extra = len(full) > len(plain)
    current = {
        "bos": extra and ids["bos"] is not None and full[0] == ids["bos"],
        "eos": extra and ids["eos"] is not None and full[-1] == ids["eos"],
    }
    wanted = {
        role: bool(flags.get(role, current[role])) and ids[role] is not None for role in current
    }

    def expected() -> list[int]:
        return [ids["bos"]] * wanted["bos"] + plain + [ids["eos"]] * wanted["eos"]

    if not flags or full == expected():
        return wanted
    tokens = {
        role: tokenizer.convert_ids_to_tokens(token_id)
        for role, token_id in ids.items()
        if wanted[role]
    }

    def seq(name: str, type_id: int) -> list[str]:
        before = [f"{tokens['bos']}:{type_id}"] if "bos" in tokens else []
        after = [f"{tokens['eos']}:{type_id}"] if "eos" in tokens else []
        return [*before, f"${name}:{type_id}", *after]

    backend.post_processor = processors.TemplateProcessing(
        single=seq("A", 0),
        pair=seq("A", 0) + seq("B", 1),
        special_tokens=[(tokens[role], ids[role]) for role in tokens],
    )
    if backend.encode(probe).ids != expected():
        raise ValueError(f"could not make the tokenizer add {wanted} to a text")
    return wanted
