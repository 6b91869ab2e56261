"""Random-weight checkpoints of the model shapes CPU users run, and their GGUF files by llama.cpp.

    .venv/bin/python benchmarks/real_shapes.py --shape llama-3.2-1b [--files bf16,q8_0,q4_k_m]
        [--keep] [--list] [--no-checks]

Each shape is a published model's config (hidden, intermediate, layers, heads, K/V heads, head
dim, vocabulary, RoPE, tied embeddings, Qwen2's q/k/v biases) with seeded random weights (normal,
std 0.02; norms 1) and the packaged default model's tokenizer (SmolLM2's 49,152 tokens: the
converter pads the vocabulary to the shape's size with unused `[PAD<i>]` tokens, and our loader
takes such a file). The steps, each skipped when its output exists, write into
`$PREFIXSERVE_CACHE_DIR/real_shapes/<shape>/`:

  hf/                          config.json, model.safetensors (written tensor by tensor: RAM
                               holds one chunk of one tensor), the tokenizer files
  <shape>-bf16.gguf            llama.cpp's convert_hf_to_gguf.py (--outtype bf16)
  <shape>-Q8_0.gguf            llama.cpp's quantizer (llama_model_quantize) from the bf16 file
  <shape>-Q4_K_M.gguf          the same, Q4_K_M
  steps.json                   each step's seconds, peak RSS and output bytes, as measured

The converter and quantizer are the llama.cpp peer's (scripts/peers/setup_llama_cpp.sh: its
venv and the llama.cpp tree of its sdist), as for the default model's GGUF files. What is not
asked for (`--files`) is an intermediate: the HF directory is removed once the bf16 file is
written and the bf16 file once the quantized ones are, unless `--keep`. Before each step the
free disk (its output) and the available RAM (its measured peak, scaled by parameters) are
checked; a step that would not fit is refused with what it needs (`--no-checks` skips that).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

GB = 1e9
FILES = ("bf16", "q8_0", "q4_k_m")
# The file names llama.cpp's tools give each type, and the file type asked of its quantizer.
FILE_SUFFIX = {"bf16": "bf16", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}
# Bytes per parameter of each output, for the disk check (Q4_K_M: Q4_K, with Q6_K for the
# output matrix, half of attn_v and ffn_down; measured 0.65 for llama-3.2-1b, 0.64 qwen2.5-1.5b).
BYTES_PER_PARAM = {"hf": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_k_m": 0.7}
# Peak anonymous RSS of each step (what the kernel cannot drop and read again: not the mapped
# input): a fixed part plus bytes per value of the largest tensor (the embedding), which each
# tool holds in fp32 and more while converting it; measured here (steps.json: 3.1, 2.0 and 1.9
# GB for llama-3.2-3b, 4.4, - and 2.6 GB for llama-3.1-8b's widths) with a margin. The RAM check
# asks MemAvailable for this.
PEAK_ANON = {
    "hf": (0.6 * GB, 0.0),
    "bf16": (1.0 * GB, 7.0),
    "q8_0": (0.5 * GB, 5.0),
    "q4_k_m": (0.5 * GB, 5.0),
}
SEED = 0
STD = 0.02
CHUNK = 1 << 24  # values generated at once: 64 MB of fp32


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's config as published (the values that decide its speed), and the files made
    when none are asked for."""

    name: str
    architecture: str  # "LlamaForCausalLM" or "Qwen2ForCausalLM"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    tie_word_embeddings: bool
    rms_norm_eps: float
    max_position_embeddings: int
    rope_scaling: dict | None = None
    files: tuple[str, ...] = FILES

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "Qwen2ForCausalLM"

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(Hugging Face name, shape) of every weight, in checkpoint order."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out.append((p + "input_layernorm.weight", (h,)))
            for proj, rows in (("q", q), ("k", kv), ("v", kv)):
                out.append((f"{p}self_attn.{proj}_proj.weight", (rows, h)))
                if self.qkv_bias:
                    out.append((f"{p}self_attn.{proj}_proj.bias", (rows,)))
            out.append((p + "self_attn.o_proj.weight", (h, q)))
            out.append((p + "post_attention_layernorm.weight", (h,)))
            out.append((p + "mlp.gate_proj.weight", (self.intermediate, h)))
            out.append((p + "mlp.up_proj.weight", (self.intermediate, h)))
            out.append((p + "mlp.down_proj.weight", (h, self.intermediate)))
        out.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab, h)))
        return out

    def params(self) -> int:
        total = 0
        for _, shape in self.tensors():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def largest(self) -> int:
        """Values of the largest tensor (the embedding)."""
        return self.vocab * self.hidden

    def hf_config(self, bos: int | None = None, eos: int | None = None) -> dict:
        config = {
            "architectures": [self.architecture],
            "model_type": "qwen2" if self.architecture == "Qwen2ForCausalLM" else "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "initializer_range": STD,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "torch_dtype": "bfloat16",
        }
        if self.architecture == "Qwen2ForCausalLM":
            # Qwen2.5's config says sliding_window 32768 with use_sliding_window false: no layer
            # slides; stated as none so no reader takes the window for one.
            config.update(use_sliding_window=False, sliding_window=None, max_window_layers=0)
        else:
            config.update(attention_bias=False, mlp_bias=False)
        return config


def _llama3_rope(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


# The published configs (meta-llama/Llama-3.2-1B, -3B, meta-llama/Llama-3.1-8B,
# Qwen/Qwen2.5-1.5B on the Hugging Face hub: config.json).
SHAPES = {
    s.name: s
    for s in (
        Shape(
            "llama-3.2-1b", "LlamaForCausalLM", 2048, 8192, 16, 32, 8, 64, 128256, 500000.0,
            True, 1e-5, 131072, _llama3_rope(32.0),
        ),
        Shape(
            "llama-3.2-3b", "LlamaForCausalLM", 3072, 8192, 28, 24, 8, 128, 128256, 500000.0,
            True, 1e-5, 131072, _llama3_rope(32.0),
        ),
        Shape(
            "qwen2.5-1.5b", "Qwen2ForCausalLM", 1536, 8960, 28, 12, 2, 128, 151936, 1000000.0,
            True, 1e-6, 32768,
        ),
        Shape(
            "llama-3.1-8b", "LlamaForCausalLM", 4096, 14336, 32, 32, 8, 128, 128256, 500000.0,
            False, 1e-5, 131072, _llama3_rope(8.0), files=("q4_k_m",),
        ),
    )
}  # fmt: skip


def tiny(shape: Shape, vocab: int = 49152 + 64) -> Shape:
    """`shape` at test size, through the same code: 2 layers, 4 heads of 64 (2 K/V heads where
    it has fewer K/V heads than heads), K a multiple of 256 (Q4_K's super-block), and a
    vocabulary just over the tokenizer's (padded by the converter, as the real ones)."""
    kv = 4 if shape.kv_heads == shape.heads else 2
    return replace(
        shape,
        name=f"{shape.name}-tiny",
        hidden=256,
        intermediate=512,
        layers=2,
        heads=4,
        kv_heads=kv,
        head_dim=64,
        vocab=vocab,
    )


def shape_dir(shape: Shape, root: Path | None = None) -> Path:
    if root is None:
        from prefixserve.settings import cache_root

        root = cache_root() / "real_shapes"
    return root / shape.name


def gguf_path(shape: Shape, file: str, root: Path | None = None) -> Path:
    """Where `file` ("bf16", "q8_0", "q4_k_m") of `shape` is written."""
    if file not in FILES:
        raise ValueError(f"file must be one of {', '.join(FILES)}, got {file!r}")
    return shape_dir(shape, root) / f"{shape.name}-{FILE_SUFFIX[file]}.gguf"


# ---- the HF directory: seeded random weights, streamed into one safetensors file.


def _tensor_chunks(name: str, shape: tuple[int, ...], index: int) -> Iterator[bytes]:
    """The bf16 bytes of one weight, a chunk of rows at a time: norms 1, the rest normal with
    std STD from a generator seeded by the tensor's index (the same bytes on every run)."""
    import torch

    if name.endswith("norm.weight"):
        yield torch.ones(shape, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
        return
    generator = torch.Generator().manual_seed(SEED * 100_003 + index)
    row = 1 if len(shape) == 1 else shape[1]
    rows_per_chunk = max(1, CHUNK // row)
    for start in range(0, shape[0], rows_per_chunk):
        rows = min(rows_per_chunk, shape[0] - start)
        size = (rows, *shape[1:])
        values = torch.randn(size, generator=generator).mul_(STD).to(torch.bfloat16)
        yield values.view(torch.uint8).numpy().tobytes()


def write_safetensors(
    path: Path, specs: list[tuple[str, tuple[int, ...]]], progress: Callable[[int], None]
) -> None:
    """One bf16 safetensors file of these weights, written tensor by tensor (the header first:
    every shape is known), through a temporary name."""
    header: dict = {}
    offset = 0
    for name, shape in specs:
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for index, (name, shape) in enumerate(specs):
            for chunk in _tensor_chunks(name, shape, index):
                f.write(chunk)
                progress(len(chunk))
    os.replace(tmp, path)


def converter_tokenizer(tokenizer: dict) -> dict:
    """The packaged tokenizer.json as convert_hf_to_gguf.py must see it (scripts/peers/
    setup_llama_cpp.sh says why): byte-level BPE without byte fallback, SmolLM's digit split,
    no BOS template; the converter then recognises it ("smollm")."""
    if tokenizer["model"]["type"] != "BPE":
        return tokenizer
    tokenizer = dict(tokenizer, model=dict(tokenizer["model"], byte_fallback=False))
    tokenizer["decoder"] = {
        "type": "ByteLevel",
        "add_prefix_space": True,
        "trim_offsets": True,
        "use_regex": True,
    }
    tokenizer["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": True,
            },
        ],
    }
    tokenizer["post_processor"] = None
    return tokenizer


def write_hf_dir(
    shape: Shape, out: Path, tokenizer_dir: Path | None = None, quiet: bool = False
) -> int:
    """config.json, model.safetensors and the tokenizer files of `shape` in `out` (written into a
    temporary sibling and renamed: `out` is complete or absent); returns this process's peak
    anonymous RSS while writing, sampled after each chunk."""
    if tokenizer_dir is None:
        from prefixserve.model.loader.default_model import ensure_default_model

        tokenizer_dir = ensure_default_model()
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    (tmp / "tokenizer.json").write_text(
        json.dumps(converter_tokenizer(tokenizer), ensure_ascii=False), encoding="utf-8"
    )
    for name in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, tmp / name)
    special = json.loads((tokenizer_dir / "config.json").read_text())
    config = shape.hf_config(special.get("bos_token_id"), special.get("eos_token_id"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    total = shape.params() * 2
    written, peak = [0], [_rss("self", "RssAnon")]

    def progress(n: int) -> None:
        written[0] += n
        peak[0] = max(peak[0], _rss("self", "RssAnon"))
        if not quiet:
            _status(f"[hf] {written[0] / GB:.2f}/{total / GB:.2f} GB, rss {_rss() / GB:.1f} GB")

    write_safetensors(tmp / "model.safetensors", shape.tensors(), progress)
    if not quiet:
        _status("", end="\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return peak[0]


# ---- llama.cpp's converter and quantizer (the peer's venv), in child processes.


def peer_python() -> Path:
    from prefixserve.settings import peers_dir

    return peers_dir() / "llama_cpp" / "bin" / "python"


def converter_script() -> Path:
    """convert_hf_to_gguf.py of the llama.cpp tree setup_llama_cpp.sh unpacked."""
    from prefixserve.settings import peers_dir

    found = sorted((peers_dir() / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    script = found[-1] / "convert_hf_to_gguf.py" if found else None
    if script is None or not script.is_file() or not peer_python().is_file():
        raise SystemExit(
            f"llama.cpp's converter and quantizer come from its peer: run "
            f"scripts/peers/setup_llama_cpp.sh first (looked in {peers_dir()})"
        )
    return script


QUANTIZE = """
import ctypes, os, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.nthread = os.cpu_count() or 1
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),
                                        ctypes.byref(params)))
"""


def convert_command(hf_dir: Path, out: Path) -> list[str]:
    return [str(peer_python()), str(converter_script()), str(hf_dir), "--outtype", "bf16",
            "--outfile", str(out)]  # fmt: skip


def quantize_command(bf16: Path, out: Path, file: str) -> list[str]:
    return [str(peer_python()), "-c", QUANTIZE, str(bf16), str(out), FILE_SUFFIX[file]]


@dataclass(slots=True)
class Step:
    """One step as measured: seconds, peak RSS in bytes (llama.cpp's tools: the child's own,
    mapped file pages included; the HF writer: this process's, sampled), the peak of its
    anonymous part (sampled twice a second), its output's bytes and the shape directory's bytes
    right after it."""

    name: str
    seconds: float
    peak_rss: int
    peak_anon: int
    output_bytes: int
    disk_after: int = 0


def run_tool(command: list[str], out: Path, expected: float, log: Path, label: str) -> Step:
    """Run one of llama.cpp's tools writing `out` (through a temporary name), showing its
    progress (output size against `expected` bytes, elapsed, the child's RSS); its output goes
    to `log`, whose tail is shown on failure."""
    tmp = out.with_name(f".{out.stem}.partial.gguf")
    command = [tmp if part == str(out) else part for part in command]
    command = [str(part) for part in command]
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    anon = 0
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            anon = max(anon, _rss(proc.pid, "RssAnon"))
            size = tmp.stat().st_size if tmp.exists() else 0
            _status(
                f"[{label}] {time.perf_counter() - start:.0f} s, {size / GB:.2f}/~"
                f"{expected / GB:.2f} GB written, rss {_rss(proc.pid) / GB:.1f} GB"
            )
            time.sleep(0.5)
    proc.returncode = os.waitstatus_to_exitcode(status)
    _status("", end="\n")
    if proc.returncode != 0 or not tmp.exists():
        tail = log.read_text(errors="replace")[-3000:]
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"{label} failed (exit {proc.returncode}); the end of {log}:\n{tail}")
    os.replace(tmp, out)
    seconds = time.perf_counter() - start
    return Step(label, seconds, usage.ru_maxrss * 1024, anon, out.stat().st_size)


# ---- checks, the plan, and the steps in order.


def _rss(pid: int | str = "self", field: str = "VmRSS") -> int:
    """A process's resident bytes (VmRSS), or with `field` "RssAnon" its anonymous ones (what
    is not a page of a mapped file, which the kernel can drop and read again)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _status(text: str, end: str = "") -> None:
    if sys.stderr.isatty():
        print(f"\r{text:<78}", end=end, file=sys.stderr, flush=True)
    elif end and text:
        print(text, file=sys.stderr, flush=True)


def check_disk(shape: Shape, plan: list[str], keep: bool, where: Path) -> None:
    """SystemExit naming the bytes `plan`'s steps need at their peak (the HF directory and the
    bf16 file side by side; the HF directory gone before the quantized files unless `keep`)
    when the free disk under `where` is less (with 1 GB spare)."""
    size = {step: BYTES_PER_PARAM[step] * shape.params() for step in plan}
    held = peak = 0.0
    for step in plan:
        held += size[step]
        peak = max(peak, held)
        if step == "bf16" and not keep:
            held -= size.get("hf", 0.0)
    free = shutil.disk_usage(where).free
    if free < peak + GB:
        raise SystemExit(
            f"{shape.name}: {', '.join(plan)} need ~{peak / GB:.1f} GB of disk at their peak "
            f"(+1 GB spare) but {where} has {free / GB:.1f} GB free; free some or pass "
            f"--no-checks"
        )


def check_room(step: str, shape: Shape, where: Path) -> None:
    """SystemExit naming what `step` needs when the free disk under `where` or the available
    RAM is less (each from BYTES_PER_PARAM and PEAK_ANON, disk with a 1 GB margin)."""
    params = shape.params()
    disk = BYTES_PER_PARAM[step] * params + GB
    free = shutil.disk_usage(where).free
    if free < disk:
        raise SystemExit(
            f"{shape.name}: the {step} step writes ~{disk / GB:.1f} GB (with 1 GB spare) but "
            f"{where} has {free / GB:.1f} GB free; free some or pass --no-checks"
        )
    fixed, per_value = PEAK_ANON[step]
    ram = fixed + per_value * shape.largest()
    available = mem_available()
    if available < ram:
        raise SystemExit(
            f"{shape.name}: the {step} step needs ~{ram / GB:.1f} GB of RAM (its peak measured "
            f"on the smaller shapes, scaled) but {available / GB:.1f} GB is available; pass "
            f"--no-checks to try anyway"
        )


def _existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (where its files will take their disk)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def ensure_files(
    shape: Shape,
    files: tuple[str, ...] | None = None,
    keep: bool = False,
    checks: bool = True,
    root: Path | None = None,
    tokenizer_dir: Path | None = None,
) -> dict[str, Path]:
    """The GGUF files of `shape` (default: `shape.files`), each made unless it exists; with
    `keep` False, the intermediates (the HF directory, a bf16 file not asked for) are removed
    after use. Returns {file: path}. Measured steps are appended to the directory's
    steps.json. `root` and `tokenizer_dir` are for tests: another directory than the cache's,
    and the tokenizer of another model than the packaged one."""
    files = tuple(files or shape.files)
    for file in files:
        gguf_path(shape, file, root)  # checks the name
    base = shape_dir(shape, root)
    wanted = {f: gguf_path(shape, f, root) for f in files}
    if all(p.is_file() for p in wanted.values()):
        return wanted
    hf, bf16 = base / "hf", gguf_path(shape, "bf16", root)
    quantized = [f for f in files if f != "bf16" and not wanted[f].is_file()]
    need_bf16 = not bf16.is_file() and ("bf16" in files or quantized)
    plan = ["hf"] if need_bf16 and not (hf / "config.json").is_file() else []
    plan += (["bf16"] if need_bf16 else []) + quantized
    if checks:
        check_disk(shape, plan, keep, _existing(base))
    (base / "logs").mkdir(parents=True, exist_ok=True)
    if need_bf16 and not (hf / "config.json").is_file():
        if checks:
            check_room("hf", shape, base)
        start = time.perf_counter()
        anon = write_hf_dir(shape, hf, tokenizer_dir)
        _record(base, shape, Step("hf", time.perf_counter() - start, _rss(), anon, _dir_bytes(hf)))
    if need_bf16:
        if checks:
            check_room("bf16", shape, base)
        expected = BYTES_PER_PARAM["bf16"] * shape.params()
        log = base / "logs" / "convert-bf16.log"
        _record(base, shape, run_tool(convert_command(hf, bf16), bf16, expected, log, "bf16"))
    if not keep and hf.exists():
        shutil.rmtree(hf)
    for file in quantized:
        if checks:
            check_room(file, shape, base)
        out = wanted[file]
        expected = BYTES_PER_PARAM[file] * shape.params()
        log = base / "logs" / f"quantize-{file}.log"
        _record(base, shape, run_tool(quantize_command(bf16, out, file), out, expected, log, file))
    if not keep and "bf16" not in files and bf16.exists():
        bf16.unlink()
    return wanted


def _record(base: Path, shape: Shape, step: Step) -> None:
    """Append a step to the directory's steps.json (with the directory's bytes now) and say it."""
    step.disk_after = _dir_bytes(base)
    path = base / "steps.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = {"shape": asdict(shape), "params": shape.params(), "steps": []}
    record["steps"].append(asdict(step))
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"{shape.name} {step.name}: {step.seconds:.0f} s, peak RSS {step.peak_rss / GB:.2f} GB "
        f"(anonymous {step.peak_anon / GB:.2f} GB), output {step.output_bytes / GB:.2f} GB, "
        f"directory {step.disk_after / GB:.2f} GB after",
        file=sys.stderr,
    )


def describe(shape: Shape) -> str:
    params = shape.params()
    sizes = ", ".join(f"{f} ~{BYTES_PER_PARAM[f] * params / GB:.1f} GB" for f in FILES)
    return (
        f"{shape.name:<14} {shape.architecture:<17} {params / 1e9:.2f} B params "
        f"(hidden {shape.hidden}, intermediate {shape.intermediate}, {shape.layers} layers, "
        f"{shape.heads}/{shape.kv_heads} heads of {shape.head_dim}, vocab {shape.vocab}); "
        f"{sizes}; made by default: {','.join(shape.files)}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", default=[], help=f"one of {', '.join(SHAPES)}")
    ap.add_argument("--files", default=None, help=f"comma-separated of {', '.join(FILES)} "
                    "(default: the shape's own: all three, Q4_K_M alone for 8B)")  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="keep the HF dir and the bf16 file")
    ap.add_argument("--no-checks", action="store_true", help="skip the disk and RAM checks")
    ap.add_argument("--list", action="store_true", help="list the shapes and exit")
    args = ap.parse_args(argv)
    if args.list or not args.shape:
        for shape in SHAPES.values():
            print(describe(shape))
        return
    files = tuple(args.files.split(",")) if args.files else None
    for name in args.shape:
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
        made = ensure_files(SHAPES[name], files, keep=args.keep, checks=not args.no_checks)
        for file, path in made.items():
            print(f"{name} {file}: {path} ({path.stat().st_size / GB:.2f} GB)")


if __name__ == "__main__":
    main()
