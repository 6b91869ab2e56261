"""GGUF file -> Hugging Face directory in the cache, converted once per file and version.

transformers does the GGUF work (config and tokenizer conversion, tensor-name mapping,
dequantization through the `gguf` package), tensor by tensor (`iter_gguf_tensors`: RAM holds
one fp32 tensor and the bf16 ones of one shard, the block weights being written one at a time,
`block_file.py`; never the whole model in fp32); `gguf_tokenizer.py` repairs the tokenizer. A
converted directory carries `prefixserve_conversion.json` with the conversion's format version;
one written by an older conversion (or none) is converted again, in place and atomically.
A file with a tensor type the `gguf` package cannot dequantize is refused before any weight is
read (`check_gguf_tensor_types`).
Chat templates for files that ship without one are `templates/<gguf architecture>.jinja`.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from prefixserve.model.errors import load_error
from prefixserve.model.loader.block_file import BlockFileWriter
from prefixserve.model.loader.gguf_reader import one_reader_per_file, open_gguf
from prefixserve.model.loader.gguf_rope import RopeFreqsError, rope_scaling_from_gguf
from prefixserve.model.loader.gguf_tokenizer import (
    gemma_tokenizer_from_gguf,
    gguf_add_special_token_flags,
    gguf_metadata,
    parsed_special_token_ids,
    set_text_special_tokens,
)
from prefixserve.model.models.registry import SUPPORTED_ARCHITECTURES
from prefixserve.model.quant.weights import (
    GGUF_BLOCKS_FILE,
    Int8Weight,
    q4_k_from_raw,
    q6_k_from_raw,
    recover_gguf_blocks,
)
from prefixserve.settings import cache_root, file_lock

# Chat-turn end markers: when one of these appears in a model's chat template it ends a reply,
# so the conversion lists it in generation_config's eos ids beside the tokenizer's eos.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")

# The format of a converted GGUF directory. Bump it whenever convert_gguf's output changes, so
# directories converted before are converted again on their next use (ensure_converted).
# 1 (no marker file): the tokenizer added BOS to every text whatever the GGUF said.
# 2: the tokenizer adds BOS / EOS to text exactly as tokenizer.ggml.add_{bos,eos}_token say.
# 3: a file's Q8_0 weights are also kept as codes and scales.
# 4: so are its Q5_0 and Q4_0 weights (GGUF_BLOCKS_FILE, each tensor's type named).
# 5: and its Q6_K weights (a scale per 16) and Q4_K / Q4_1 ones (`<hf name>.mins` too).
# 6: not Q4_1 ones (the default model's file: its numerics stay its bf16 values).
# 7: Q4_K and Q6_K weights with their super-blocks (`<hf name>.super_scales`), read from the
#    file's blocks.
# 8: Llama 3's rope scaling, from the file's rope_freqs.weight, in config.json (gguf_rope.py).
CONVERSION_VERSION = 8
CONVERSION_MARKER = "prefixserve_conversion.json"

# Chat templates for GGUF files that ship without one, by GGUF architecture, in templates/.
# gemma3.jinja is Gemma 3's (google/gemma-3-*-it tokenizer_config.json, text parts only): the
# packaged Gemma 3 270M carries none.
_TEMPLATES_DIR = Path(__file__).parent / "templates"
_FALLBACK_TEMPLATES = {"gemma3": "gemma3.jinja"}


def fallback_chat_template(gguf_architecture: str) -> str | None:
    """The chat template for a GGUF file of this architecture that carries none; None for an
    architecture we have none for. A listed template missing from the install is an error (a
    conversion without it would be cached as complete)."""
    name = _FALLBACK_TEMPLATES.get(gguf_architecture)
    if name is None:
        return None
    return (_TEMPLATES_DIR / name).read_text(encoding="utf-8")


def convert_gguf(gguf_path: Path, out_dir: Path, chat_template: str | None = None) -> None:
    """Write a HF directory (bf16 model.safetensors, config, tokenizer, generation config).

    transformers does the GGUF work: config and tokenizer conversion, tensor-name mapping and
    dequantization (through the `gguf` package). `chat_template` is used when the file carries
    none. Embeddings stay tied when the file has no separate output matrix.
    """
    with one_reader_per_file():
        _convert_gguf(gguf_path, out_dir, chat_template)


def _convert_gguf(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    check_gguf_tensor_types(gguf_path)  # before transformers is imported or any weight is read
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src_dir, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    config.dtype = torch.bfloat16
    _read_rope_scaling(gguf_path, config)
    with torch.device("meta"):  # only for the parameter names; no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]  # GGUF configs come without it
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_weights(gguf_path, skeleton, expected, out_dir)
    config.save_pretrained(str(out_dir))

    special = parsed_special_token_ids(gguf_path)
    if config.model_type.startswith("gemma"):
        tokenizer = gemma_tokenizer_from_gguf(gguf_path, special)
    else:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    # transformers' GGUF converter does not always keep the file's special-token roles
    # (SmolLM2 comes out with eos = <|im_start|>); the ids in the file are authoritative.
    for role in ("bos", "eos", "unk", "pad"):
        token_id = special.get(role)
        if token_id is not None and token_id < len(tokenizer):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    # transformers ignores tokenizer.ggml.add_bos_token (SmolLM2 says False, yet came out adding
    # <|im_start|> to every text); the file's flags decide what is added to a text.
    adds = set_text_special_tokens(tokenizer, special, gguf_add_special_token_flags(gguf_path))
    if not tokenizer.chat_template and chat_template:
        tokenizer.chat_template = chat_template
    # The template goes into tokenizer_config.json (older readers ignore chat_template.jinja).
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)
    # tokenizer.json holds the whole pipeline (incl. BOS insertion); the generic fast class
    # reads it as is, while the converter's class name (LlamaTokenizer even for SmolLM2's GPT-2
    # BPE) would only draw a class-mismatch warning. add_{bos,eos}_token say the same as the
    # post-processor, for readers that rebuild it from them.
    tok_config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config["add_bos_token"] = adds["bos"]
    tok_config["add_eos_token"] = adds["eos"]
    tok_config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")

    eos_ids = [special["eos"]] if special.get("eos") is not None else []
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    vocab = tokenizer.get_vocab()
    for marker in _END_OF_TURN_TOKENS:
        if marker in template and marker in vocab and vocab[marker] not in eos_ids:
            eos_ids.append(vocab[marker])
    GenerationConfig(
        bos_token_id=special.get("bos"),
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        pad_token_id=special.get("pad"),
    ).save_pretrained(str(out_dir))


def _read_rope_scaling(gguf_path: Path, config: Any) -> None:
    """Llama 3's rope scaling into `config` from the file's `rope_freqs.weight`, which
    transformers' GGUF loader drops (gguf_rope.py); a file whose divisors are not Llama 3's
    scaling is refused."""
    if getattr(config, "rope_scaling", None):
        return  # the metadata said it (linear, yarn): transformers read it
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    try:
        scaling = rope_scaling_from_gguf(open_gguf(gguf_path), head_dim, config.rope_theta)
    except RopeFreqsError as exc:
        raise load_error(gguf_path, str(exc)) from exc
    if scaling is not None:
        config.rope_scaling = scaling


def _write_weights(
    gguf_path: Path, skeleton: torch.nn.Module, expected: set[str], out_dir: Path
) -> None:
    """The `expected` weights in bf16 (`ShardWriter`) and those the file stores in a block type
    the kernel reads as codes and scales (`GGUF_BLOCKS_FILE`), one fp32 tensor at a time: Q4_K
    and Q6_K in their super-blocks (`KQuantRows`), else as `recover_by_rows` finds them."""
    kquants = KQuantRows(gguf_path)
    with (
        ShardWriter(out_dir) as writer,
        BlockFileWriter(out_dir / GGUF_BLOCKS_FILE, expected) as blocks,
    ):
        for key, value in iter_gguf_tensors(gguf_path, skeleton):
            if key not in expected:
                continue
            if value.dim() == 2:
                weight = kquants.recover(value) or recover_by_rows(value)
                if weight is not None:
                    blocks.add(key, weight)
                del weight
            writer.add(key, value.to(torch.bfloat16).contiguous())
            del value
    missing = {k for k in expected - writer.names if "rotary_emb" not in k}
    if missing:
        raise load_error(gguf_path, f"GGUF conversion left weights missing: {sorted(missing)[:5]}")


def check_gguf_tensor_types(gguf_path: Path) -> None:
    """ModelLoadError naming the file, each tensor type in it the conversion cannot dequantize
    (with one tensor of that type) and the types it can; nothing when it can read them all."""
    unreadable: dict[str, str] = {}
    for tensor in open_gguf(gguf_path).tensors:
        if not _dequantizable(tensor.tensor_type):
            unreadable.setdefault(tensor.tensor_type.name, tensor.name)
    if unreadable:
        found = ", ".join(f"{qtype} (tensor {name!r})" for qtype, name in unreadable.items())
        noun = "type" if len(unreadable) == 1 else "types"
        readable = ", ".join(t.name for t in GGMLQuantizationType if _dequantizable(t))
        raise load_error(
            gguf_path,
            f"unsupported GGUF tensor {noun} {found}; the GGUF tensor types prefixserve "
            f"converts: {readable}",
        )


@functools.cache
def _dequantizable(qtype: GGMLQuantizationType) -> bool:
    """Whether the installed `gguf` package dequantizes this type, asked with one zero block:
    transformers dequantizes every tensor through it, and its set of types grows by version."""
    from gguf.quants import dequantize

    if qtype not in GGML_QUANT_SIZES:
        return False
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def iter_gguf_tensors(gguf_path: Path, skeleton: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, fp32 tensor) of each of the file's tensors, one at a time: the loop of
    transformers' `load_gguf_checkpoint(return_tensors=True)` (dequantization through the `gguf`
    package, the architecture's tensor processor, e.g. Llama's q/k permutation undone, the name
    map of `skeleton`), without holding every tensor at once (an 8B model's are 32 GB of fp32)."""
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
    parsed["tensors"] = {}  # where a processor may put tensors of its own (MoE experts)
    reader = open_gguf(gguf_path)
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(skeleton)
    for tensor in reader.tensors:
        result = processor.process(
            weights=dequantize(tensor.data, tensor.tensor_type),
            name=tensor.name,
            tensor_key_mapping=names,
            parsed_parameters=parsed,
        )
        if result.name in names:
            weights = result.weights
            if not (weights.flags.writeable and weights.flags.c_contiguous):
                weights = np.array(weights, order="C")  # a copy, off the file's memory map
            yield names[result.name], torch.from_numpy(weights)
        while parsed["tensors"]:
            yield parsed["tensors"].popitem()


# Bytes of bf16 tensors a conversion holds before writing them out as one safetensors shard.
SHARD_BYTES = 1 << 30
# Values `recover_by_rows` recovers at once: its search holds a few fp32 copies of them.
RECOVER_CHUNK = 1 << 24


def recover_by_rows(values: torch.Tensor) -> Int8Weight | None:
    """`recover_gguf_blocks(values)`, computed over chunks of rows where they all come back in
    one format (its every rule is per block, and the chunks' first row is the tensor's), so its
    search holds a few copies of a chunk, not of a vocabulary-sized embedding; where they do not
    (a chunk declined, formats differing), over the whole tensor, whose answer it is then."""
    rows = max(1, RECOVER_CHUNK // max(1, values.shape[1]))
    if values.shape[0] <= rows:
        return recover_gguf_blocks(values)
    parts = []
    for start in range(0, values.shape[0], rows):
        part = recover_gguf_blocks(values[start : start + rows])
        if part is None or (parts and (part.fmt, part.group) != (parts[0].fmt, parts[0].group)):
            return recover_gguf_blocks(values)  # declined at row 0 for a plain tensor: cheap
        parts.append(part)
    return Int8Weight(
        torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), parts[0].fmt
    )


class ShardWriter:
    """The converted bf16 tensors, written `SHARD_BYTES` at a time: one model.safetensors for a
    model that fits one shard, else model-0000i-of-0000n.safetensors and the index that names
    them (`hf_dir.safetensors_files` reads either)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.names: set[str] = set()
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.add(name)
        self._pending[name] = tensor
        self._pending_bytes += tensor.numel() * tensor.element_size()
        if self._pending_bytes >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._pending:
            return
        path = self.out_dir / f".shard-{len(self._shards)}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._total += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            return
        self._flush()
        if len(self._shards) == 1:
            os.rename(self._shards[0][0], self.out_dir / "model.safetensors")
            return
        count = len(self._shards)
        weight_map = {}
        for i, (path, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.rename(path, self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _row_digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(row.tobytes(), digest_size=16).digest()


# The K-quant types kept with their super-blocks, and how their raw rows become weights.
_KQUANTS = {GGMLQuantizationType.Q4_K: q4_k_from_raw, GGMLQuantizationType.Q6_K: q6_k_from_raw}


class KQuantRows:
    """A file's Q4_K and Q6_K tensors, found by their rows' values: transformers hands over each
    tensor dequantized and renamed, some with rows reordered (Llama's q and k, un-permuted from
    llama.cpp's rotary order), so a value tensor is matched to the file's blocks row by row (a
    digest of each row's fp32 values) and kept only if every value comes back exactly. Rows are
    dequantized _CHUNK_ROWS at a time (a 1B model's Q6_K embedding is 1 GB in fp32)."""

    _CHUNK_ROWS = 4096

    def __init__(self, gguf_path: Path) -> None:
        self._tensors = [
            t
            for t in open_gguf(gguf_path).tensors
            if t.tensor_type in _KQUANTS and len(t.data.shape) == 2
        ]
        # digest of a row's values -> [(tensor, row), ...]; built on the first recover().
        self._rows: dict[bytes, list[tuple[int, int]]] | None = None

    def _index(self) -> dict[bytes, list[tuple[int, int]]]:
        if self._rows is None:
            self._rows = {}
            for index, tensor in enumerate(self._tensors):
                for start in range(0, tensor.data.shape[0], self._CHUNK_ROWS):
                    rows = np.arange(start, min(tensor.data.shape[0], start + self._CHUNK_ROWS))
                    values = self._weight(index, rows).dequantize().numpy()
                    for row, value in zip(rows.tolist(), values, strict=True):
                        self._rows.setdefault(_row_digest(value), []).append((index, row))
        return self._rows

    def _weight(self, index: int, rows: np.ndarray) -> Int8Weight:
        """Tensor `index`'s rows `rows` (in that order) as a weight."""
        tensor = self._tensors[index]
        raw = np.asarray(tensor.data)[rows]
        return _KQUANTS[tensor.tensor_type](torch.from_numpy(raw))

    def recover(self, values: torch.Tensor) -> Int8Weight | None:
        """The Q4_K or Q6_K weight these fp32 values [N, K] are, exactly; None when they are not
        one tensor's rows."""
        if not self._tensors or values.dtype != torch.float32 or values.shape[1] % 256:
            return None
        index = self._index()
        rows = values.contiguous().numpy()
        if _row_digest(rows[0]) not in index:
            return None
        hits = [index.get(_row_digest(row), []) for row in rows]
        for tensor in dict.fromkeys(t for t, _ in hits[0]):
            order = [next((r for t, r in found if t == tensor), None) for found in hits]
            if None in order:
                continue
            weight = self._weight(tensor, np.array(order))
            if self._gives_back(weight, values):
                return weight
        return None

    def _gives_back(self, weight: Int8Weight, values: torch.Tensor) -> bool:
        """Whether the weight's values are these, exactly (compared a chunk of rows at a time)."""
        for start in range(0, values.shape[0], self._CHUNK_ROWS):
            part = slice(start, start + self._CHUNK_ROWS)
            mins = None if weight.mins is None else weight.mins[part]
            rows = Int8Weight(weight.codes[part], weight.scales[part], weight.fmt, mins)
            if not torch.equal(rows.dequantize(), values[part]):
                return False
        return True


def is_converted(target_dir: Path) -> bool:
    """Whether `target_dir` holds a complete conversion of the current CONVERSION_VERSION."""
    if not (target_dir / "config.json").is_file():
        return False
    try:
        marker = json.loads((target_dir / CONVERSION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("version") == CONVERSION_VERSION


def _exchange_dirs(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # fall back to two renames
        return False
    raise OSError(err, os.strerror(err), str(b))


def ensure_converted(gguf_path: Path, target_dir: Path, chat_template: str | None = None) -> Path:
    """Convert `gguf_path` into `target_dir` unless it is already there; return `target_dir`.

    Safe when several processes race: a file lock lets one convert while the others wait, and
    the result is written to a temporary sibling directory and renamed into place, so
    `target_dir` either does not exist or is complete (a crash leaves only a temp dir behind).
    A directory from an older conversion (no current CONVERSION_MARKER) is converted again and
    swapped in atomically; processes that already loaded the old one keep their memory maps.
    """
    if is_converted(target_dir):
        return target_dir
    with file_lock(target_dir.parent / f".{target_dir.name}.lock"):
        if is_converted(target_dir):  # another process finished meanwhile
            return target_dir
        tmp = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}.tmp-", dir=target_dir.parent))
        try:
            convert_gguf(gguf_path, tmp, chat_template)
            marker = {"version": CONVERSION_VERSION, "source": gguf_path.name}
            (tmp / CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            tmp.chmod(0o755)  # mkdtemp (and safetensors) make it private
            for file in tmp.iterdir():
                file.chmod(0o644)
            if not target_dir.exists():
                os.rename(tmp, target_dir)
            # An older conversion: swapped with tmp in one step (tmp, removed below, then holds
            # it), or where that is unsupported, moved aside just before the rename.
            elif not _exchange_dirs(tmp, target_dir):
                old = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}.old-", dir=tmp.parent))
                os.rename(target_dir, old / target_dir.name)
                os.rename(tmp, target_dir)
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target_dir


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where a user-given GGUF file is converted: keyed by its resolved path, size and mtime."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def check_gguf_architecture(gguf_path: Path) -> str:
    """The file's GGUF architecture (\"llama\", \"gemma3\"); ModelLoadError when unreadable or
    not one we support."""
    try:
        arch = str(gguf_metadata(gguf_path)["general.architecture"])
    except (OSError, ValueError, KeyError) as exc:
        raise load_error(gguf_path, f"not a readable GGUF file ({exc})") from exc
    supported = {name.lower() for name in SUPPORTED_ARCHITECTURES}
    # GGUF names the family ("llama", "gemma3"); the registry may list HF class names.
    if not any(name == arch or name.startswith(arch) for name in supported):
        raise load_error(gguf_path, f"unsupported GGUF architecture {arch!r}")
    return arch
