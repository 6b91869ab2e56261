"""Model loading: a Hugging Face directory or a GGUF file -> our model, tokenizer and config.

A directory holds config.json and safetensors (one file, or shards listed in
model.safetensors.index.json); tensors are streamed into `model.load_weights` one at a time,
cast to the requested dtype. They are memory maps of the files, which parameters take as they
are where no fusing or cast is needed, so a later start reads instead of copying.
A GGUF file is first converted once, with transformers' GGUF support (name mapping,
dequantization, tokenizer conversion), into such a directory in the cache; later loads read the
directory. A converted directory carries `prefixserve_conversion.json` with the conversion's
format version; one written by an older conversion (or none) is converted again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefixserve.model.tokenizer import Tokenizer

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
}
_FP16_NAMES = ("float16", "fp16", "half")

# Chat-turn end markers: when one of these appears in a model's chat template it ends a reply,
# so the conversion lists it in generation_config's eos ids beside the tokenizer's eos.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")

# The format of a converted GGUF directory. Bump it whenever convert_gguf's output changes, so
# directories converted before are converted again on their next use (ensure_converted).
# 1 (no marker file): the tokenizer added BOS to every text whatever the GGUF said.
# 2: the tokenizer adds BOS / EOS to text exactly as tokenizer.ggml.add_{bos,eos}_token say.
CONVERSION_VERSION = 2
CONVERSION_MARKER = "prefixserve_conversion.json"

# Gemma 3's chat template (google/gemma-3-*-it tokenizer_config.json, text parts only), for GGUF
# files that ship without one (the packaged Gemma 3 270M does).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate '
    'user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)
# Templates for GGUF files without tokenizer.chat_template, by GGUF architecture.
FALLBACK_CHAT_TEMPLATES = {"gemma3": GEMMA3_CHAT_TEMPLATE}


class ModelLoadError(ValueError):
    """A model path that cannot be loaded: missing, unreadable, or an unsupported architecture."""


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    config: Any  # prefixserve.model.config.ModelConfig
    path: Path  # the HF directory the weights came from (the converted one for GGUF)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name to torch; fp16 is refused (this CPU has no fast fp16 matmul)."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.bfloat16, torch.float32):
            return dtype
        dtype = str(dtype).removeprefix("torch.")
    name = str(dtype).lower()
    if name in _FP16_NAMES:
        raise ValueError(
            f"dtype {dtype!r} is not supported: this CPU has no fast float16 matmul (under "
            "3 GFLOP/s against ~400 in bfloat16); use 'bfloat16' (default) or 'float32'"
        )
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return "bfloat16" if dtype == torch.bfloat16 else "float32"


def supported_architectures() -> list[str]:
    from prefixserve.model.registry import SUPPORTED_ARCHITECTURES

    return sorted(SUPPORTED_ARCHITECTURES)


def _load_error(path: Path | str, problem: str) -> ModelLoadError:
    try:
        supported = ", ".join(supported_architectures())
    except ImportError:  # the registry is not importable: say so rather than hide the problem
        supported = "(model registry unavailable)"
    return ModelLoadError(
        f"cannot load model {str(path)!r}: {problem}. Expected a Hugging Face model directory "
        f"(config.json + *.safetensors) or a .gguf file of a supported architecture: {supported}"
    )


# --- Hugging Face directories -------------------------------------------------------------------


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """config.json of a model directory, as a dict (ModelLoadError if missing or broken)."""
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise _load_error(model_dir, "config.json is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _load_error(model_dir, f"config.json is unreadable ({exc})") from exc
    if not isinstance(config, dict):
        raise _load_error(model_dir, "config.json is not a JSON object")
    return config


def safetensors_files(model_dir: Path) -> list[Path]:
    """Weight files: the shards named by model.safetensors.index.json, or every *.safetensors."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise _load_error(model_dir, f"{index_path.name} is unreadable ({exc})") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise _load_error(
                model_dir, f"shards listed in {index_path.name} are missing: {missing}"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise _load_error(model_dir, "no *.safetensors weight files")
    return files


def iter_safetensors_weights(
    model_dir: Path, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_param_name, tensor) for every tensor, floating ones cast to `dtype`.

    One tensor is materialized at a time, so peak memory stays near one copy of the model.
    """
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensor = f.get_tensor(name)
                    if tensor.is_floating_point() and tensor.dtype != dtype:
                        tensor = tensor.to(dtype)
                    yield name, tensor
        except (OSError, SafetensorError) as exc:
            raise _load_error(model_dir, f"{path.name} is unreadable ({exc})") from exc


def load_hf_dir(
    model_dir: Path, dtype: torch.dtype, max_model_len: int | None = None
) -> LoadedModel:
    """Build our model from a HF directory and stream its safetensors into it."""
    from prefixserve.model.config import ModelConfig
    from prefixserve.model.registry import create_model

    hf_config = read_hf_config(model_dir)
    try:
        config = ModelConfig.from_hf_config(hf_config, dtype_name(dtype))
    except (ValueError, KeyError, TypeError) as exc:
        names = hf_config.get("architectures") or hf_config.get("model_type")
        raise _load_error(model_dir, f"unsupported architecture {names!r} ({exc})") from exc
    safetensors_files(model_dir)  # fail on missing weights before building anything
    if max_model_len is not None:
        limit = config.max_model_len
        if not isinstance(max_model_len, int) or not 0 < max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be an integer in [1, {limit}] for {model_dir}, "
                f"got {max_model_len!r}"
            )
        config.max_model_len = max_model_len
    try:
        tokenizer = Tokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise _load_error(model_dir, f"tokenizer files are missing or unreadable ({exc})") from exc
    model = create_model(config)
    # The tensors are fresh memory maps of the files (copy-on-write), so parameters may take
    # them as they are: no copy of the unfused weights (the cache dir is replaced atomically).
    model.load_weights(iter_safetensors_weights(model_dir, dtype), assign=True)
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=model_dir)


# --- GGUF -----------------------------------------------------------------------------------------


def convert_gguf(gguf_path: Path, out_dir: Path, chat_template: str | None = None) -> None:
    """Write a HF directory (bf16 model.safetensors, config, tokenizer, generation config).

    transformers does the GGUF work: config and tokenizer conversion, tensor-name mapping and
    dequantization (through the `gguf` package). `chat_template` is used when the file carries
    none. Embeddings stay tied when the file has no separate output matrix.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src_dir, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    config.dtype = torch.bfloat16
    with torch.device("meta"):  # only for the parameter names; no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]  # GGUF configs come without it
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    expected = set(skeleton.state_dict())
    tensors = {
        key: value.to(torch.bfloat16).contiguous()
        for key, value in parsed["tensors"].items()
        if key in expected
    }
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    missing = (
        expected - set(tensors) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    )
    missing = {k for k in missing if "rotary_emb" not in k}
    if missing:
        raise _load_error(gguf_path, f"GGUF conversion left weights missing: {sorted(missing)[:5]}")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors, parsed
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


def gemma_tokenizer_from_gguf(gguf_path: Path, special: dict[str, int]) -> Any:
    """Gemma's SentencePiece-BPE tokenizer rebuilt from a GGUF file's vocabulary.

    transformers' GGUF converter (4.57) turns Gemma's vocabulary into a Unigram model, but the
    scores llama.cpp stores for Gemma are BPE merge ranks, not log-probabilities, so it
    tokenizes "capital" as "c ap it al". This builds what transformers' own GemmaConverter
    builds from the SentencePiece file: a byte-fallback BPE whose merges are ordered by the
    piece scores (`generate_merges`), control and user-defined pieces as added tokens.
    """
    from gguf import GGUFReader
    from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import generate_merges

    fields = GGUFReader(str(gguf_path)).fields
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
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    ids: dict[str, int] = {}
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        field = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            ids[role] = int(field.contents())
    return ids


def gguf_add_special_token_flags(gguf_path: Path) -> dict[str, bool]:
    """tokenizer.ggml.add_bos_token / add_eos_token as {"bos": ..., "eos": ...} (absent ones
    are left out)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    flags: dict[str, bool] = {}
    for role in ("bos", "eos"):
        field = fields.get(f"tokenizer.ggml.add_{role}_token")
        if field is not None:
            flags[role] = bool(field.contents())
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


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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


def cache_root() -> Path:
    """Root of converted models: $PREFIXSERVE_CACHE_DIR or ~/.cache/prefixserve."""
    env = os.environ.get("PREFIXSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prefixserve"


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where a user-given GGUF file is converted: keyed by its resolved path, size and mtime."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def _check_gguf_architecture(gguf_path: Path) -> str:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf_path))
        arch = str(reader.fields["general.architecture"].contents())
    except (OSError, ValueError, KeyError) as exc:
        raise _load_error(gguf_path, f"not a readable GGUF file ({exc})") from exc
    supported = {name.lower() for name in supported_architectures()}
    # GGUF names the family ("llama", "gemma3"); the registry may list HF class names.
    if not any(name == arch or name.startswith(arch) for name in supported):
        raise _load_error(gguf_path, f"unsupported GGUF architecture {arch!r}")
    return arch


# --- entry point ----------------------------------------------------------------------------------


def load_model(
    model: str | Path | None = None,
    dtype: str = "bfloat16",
    max_model_len: int | None = None,
) -> LoadedModel:
    """Load a model: None = the default model, a HF directory, or a .gguf file.

    Raises ModelLoadError (a ValueError) naming the path and the supported architectures when
    the path is missing, unreadable or of an unsupported architecture; ValueError for a bad
    dtype or max_model_len.
    """
    torch_dtype = resolve_dtype(dtype)
    if model is None:
        from prefixserve.model.default_model import ensure_default_model

        return load_hf_dir(ensure_default_model(), torch_dtype, max_model_len)
    path = Path(model).expanduser()
    if not path.exists():
        raise _load_error(path, "no such file or directory")
    if path.is_dir():
        return load_hf_dir(path, torch_dtype, max_model_len)
    if path.suffix.lower() == ".gguf":
        arch = _check_gguf_architecture(path)
        try:
            converted = ensure_converted(
                path, gguf_cache_dir(path), FALLBACK_CHAT_TEMPLATES.get(arch)
            )
        except ModelLoadError:
            raise
        except (OSError, ValueError, KeyError) as exc:
            raise _load_error(path, f"GGUF conversion failed ({exc})") from exc
        return load_hf_dir(converted, torch_dtype, max_model_len)
    raise _load_error(path, "a file that is not .gguf")
