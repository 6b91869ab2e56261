"""Reading a PEFT LoRA adapter directory into the low-rank weights our fused linears apply.

A PEFT adapter is a directory with `adapter_config.json` and `adapter_model.safetensors`, whose
tensors are named `...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight`. Every tensor is
checked against the model before any is used: the module must be one of the seven projections
this engine runs (q/k/v/o, gate/up/down), the layer must exist, A must be `[r, in]` and B
`[out, r]` for that module of this model, r at most `max_lora_rank`, the values floating point
and finite once scaled and rounded to the model's dtype. Anything else (PEFT options that change
what the adapter computes: DoRA, LoRA biases, aLoRA, layer replication, `modules_to_save`,
per-module rank or alpha patterns...; pickle checkpoints) is refused with a ValueError that names
what does not fit.

Our q/k/v and gate/up projections are fused (`qkv_proj`, `gate_up_proj`), so one adapter's
slices of a fused linear become one pair: `A` stacks the slices' A matrices (`[sum r, in]`) and
`B` places each slice's B (times the adapter's scaling, `lora_alpha / r`, or `/ sqrt(r)` with
rsLoRA) in its rows and its columns of the stack (`[out, sum r]`, zero elsewhere), so that
`out += (x @ A.T) @ B.T` is the adapter's whole contribution in two matmuls.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from prefixserve.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20

# PEFT module name -> (our linear, slice index within it).
MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# PEFT LoraConfig options that make an adapter compute something other than plain LoRA's
# `scaling * B @ A` on the base model's own layers, refused whenever set (not null, false or
# empty), and why.
REFUSED_OPTIONS: dict[str, str] = {
    "use_dora": "DoRA rescales each updated weight by a learned magnitude",
    "fan_in_fan_out": "weights stored transposed, for Conv1D layers",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "fully trained modules",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "alora_invocation_tokens": "Activated LoRA applies only from its invocation tokens on",
    "layer_replication": "it is for a model with repeated layers",
    "trainable_token_indices": "trained token embeddings",
    "target_parameters": "LoRA on raw parameters such as MoE experts",
    "use_qalora": "QALoRA pools its input in groups",
    "use_bdlora": "block-diagonal LoRA factors",
    "arrow_config": "Arrow routing between LoRA experts",
    "kasa_config": "KaSA's learned diagonal between A and B",
    "monteclora_config": "MonteCLoRA's variational sampling",
}
# init_lora_weights whose training also changed the base model's weights: the adapter is a delta
# against those, not against this model (PEFT converts it to a plain one on request).
_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$"
)


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each PEFT module name in this model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def fused_slices(config: ModelConfig) -> dict[str, list[int]]:
    """Output widths of each of our linears' slices, in order."""
    shapes = module_shapes(config)
    return {
        "qkv_proj": [shapes["q_proj"][1], shapes["k_proj"][1], shapes["v_proj"][1]],
        "o_proj": [shapes["o_proj"][1]],
        "gate_up_proj": [shapes["gate_proj"][1], shapes["up_proj"][1]],
        "down_proj": [shapes["down_proj"][1]],
    }


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One adapter's update of one of our linears, in the model's dtype.

    `a` [sum r, in] stacks the slices' A; `b` [out, sum r] places each slice's scaled B in its
    rows and columns, zero elsewhere (the PyTorch path's one matmul). For the native kernel
    (csrc/linear/lora.cpp), which skips the zero blocks: `blocks` holds each slice's B in blocks of
    64 output columns (`expand_blocks`), slices one after the other, and `meta` int64 [S, 4] gives
    per slice (first output column, first column of x @ a.T, width, offset in `blocks`)."""

    a: torch.Tensor
    b: torch.Tensor
    blocks: torch.Tensor
    meta: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes + self.blocks.nbytes


def expand_blocks(b: torch.Tensor) -> torch.Tensor:
    """One slice's B [width, r] as csrc/linear/lora.cpp reads it: [ceil(width / 64), r, 64], block k
    holding output columns 64k..64k+63 (zero past width), each block's r rows one after the
    other, so the kernel reads it front to back."""
    width, rank = b.shape
    blocks = -(-width // 64)
    padded = torch.zeros(blocks * 64, rank, dtype=b.dtype)
    padded[:width] = b
    return padded.view(blocks, 64, rank).transpose(1, 2).contiguous()


def lora_weights(
    a: torch.Tensor, b: torch.Tensor, slices: list[tuple[int, int, int]]
) -> LoRAWeights:
    """LoRAWeights of stacked `a`, placed `b` and its slices `(first output column, first
    column of x @ a.T, width)`, in h's column order."""
    parts, meta, offset = [], [], 0
    for s, (out_col, h_col, width) in enumerate(slices):
        h_end = slices[s + 1][1] if s + 1 < len(slices) else a.shape[0]
        block = expand_blocks(b[out_col : out_col + width, h_col:h_end]).reshape(-1)
        parts.append(block)
        meta.append((out_col, h_col, width, offset))
        offset += block.numel()
    return LoRAWeights(a, b, torch.cat(parts), torch.tensor(meta, dtype=torch.int64))


@dataclass(slots=True)
class LoRAAdapter:
    """One loaded adapter: `weights[(layer, linear)]` its `LoRAWeights` for that linear. `digest`
    fingerprints the files (it joins the name in every block hash, so an adapter reloaded under
    the same name with other weights never hits the old one's K/V)."""

    name: str
    path: Path
    rank: int
    scaling: float
    digest: bytes
    base_model: str | None
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], LoRAWeights] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())


def _fail(path: Path, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {why}")


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise _fail(path, f"{what} (expected a PEFT directory with {CONFIG_FILE})")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise _fail(path, f"no {CONFIG_FILE}")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise _fail(path, f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(path, f"{CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _fail(path, f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_options(path: Path, config: dict) -> None:
    """Refuse, by name, the PEFT options that change what the adapter computes."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail(path, f"peft_type {peft_type!r} is not supported (only LORA)")
    for key, why in REFUSED_OPTIONS.items():
        value = config.get(key)
        if value not in (None, False, [], {}):
            raise _fail(path, f"{key}={reprlib.repr(value)} is not supported ({why})")
    if config.get("bias", "none") != "none":
        raise _fail(path, f"bias={config.get('bias')!r} is not supported (only 'none')")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise _fail(
            path,
            f"init_lora_weights={init!r} is not supported (it changed the base model's weights "
            "too; convert it to a plain LoRA adapter with PEFT's save_pretrained("
            "path_initial_model_for_weight_conversion=...))",
        )
    if config.get("use_rslora") not in (None, False, True):
        raise _fail(path, f"use_rslora must be true or false, got {config.get('use_rslora')!r}")


def _scaling(path: Path, config: dict, max_rank: int) -> tuple[int, float]:
    """The configured rank and the scaling PEFT applies (lora_alpha / r, or / sqrt(r))."""
    _check_options(path, config)
    # PEFT's LoraConfig defaults: lora_alpha 8.
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _fail(path, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _fail(path, f"rank {rank} is above max_lora_rank={max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise _fail(path, f"lora_alpha must be a finite number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _check_targets(path: Path, config: dict) -> None:
    targets = config.get("target_modules")
    if targets is None or isinstance(targets, str):  # "all-linear" or a regex: tensors decide
        return
    if not isinstance(targets, list):
        raise _fail(path, f"target_modules must be a list or a string, got {targets!r}")
    unknown = [t for t in targets if not isinstance(t, str) or t.rsplit(".", 1)[-1] not in MODULES]
    if unknown:
        raise _fail(
            path,
            f"unknown target module(s) {unknown}: supported are {', '.join(MODULES)}",
        )


def adapter_digest(path: Path) -> bytes:
    """sha256 of an adapter's config and weights files: what its cache keys carry."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(name.encode() + b"\0")
        with open(path / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.digest()


def load_adapter(name: str, path: str | Path, model: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check the PEFT adapter at `path` for `model`; ValueError naming what does not
    fit (missing or unreadable files, unsupported options, unknown modules, shapes of another
    model, ranks above `max_rank`, non-finite values)."""
    path = Path(path).expanduser()
    try:
        return _load(name, path, model, max_rank)
    except OSError as exc:  # permissions, a file removed while it was read
        raise _fail(path, f"cannot be read ({type(exc).__name__}: {exc.strerror or exc})") from None


def _load(name: str, path: Path, model: ModelConfig, max_rank: int) -> LoRAAdapter:
    config = _read_config(path)
    rank, scale = _scaling(path, config, max_rank)
    _check_targets(path, config)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        extra = (
            " (pickle .bin checkpoints are not loaded)"
            if (path / "adapter_model.bin").exists()
            else ""
        )
        raise _fail(path, f"no {WEIGHTS_FILE}{extra}")
    # Before the tensors: they are those of the files it fingerprints unless the files are
    # replaced while being read (an operator's business; the server never writes them).
    digest = adapter_digest(path)
    base = config.get("base_model_name_or_path")
    base = base if isinstance(base, str) else None
    trained_for = f" (it was trained for {base!r})" if base else ""
    shapes = module_shapes(model)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                m = _KEY.search(key)
                if m is None:
                    raise _fail(path, f"tensor {key!r} is not a LoRA A/B weight of a decoder layer")
                layer, module, which = int(m.group(1)), m.group(2), m.group(3)
                if module not in MODULES:
                    raise _fail(
                        path,
                        f"unknown target module {module!r} in {key!r}: supported are "
                        f"{', '.join(MODULES)}",
                    )
                if layer >= model.num_layers:
                    raise _fail(
                        path,
                        f"{key!r} is for layer {layer}, the model has {model.num_layers} "
                        f"layers{trained_for}",
                    )
                in_f, out_f = shapes[module]
                shape = tuple(f.get_slice(key).get_shape())
                want = "[r, in_features]" if which == "A" else "[out_features, r]"
                ok = (
                    len(shape) == 2
                    and (shape[1] == in_f if which == "A" else shape[0] == out_f)
                    and 1 <= (shape[0] if which == "A" else shape[1]) <= max_rank
                )
                if not ok:
                    expect = (
                        f"[r<={max_rank}, {in_f}]" if which == "A" else f"[{out_f}, r<={max_rank}]"
                    )
                    raise _fail(
                        path,
                        f"{key!r} has shape {list(shape)}, this model's {module} needs {want} = "
                        f"{expect}{trained_for}",
                    )
                slot = pairs.setdefault((layer, module), {})
                if which in slot:
                    raise _fail(path, f"two lora_{which} tensors for layer {layer} {module}")
                slot[which] = _floating(path, key, f.get_tensor(key))
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt file, whatever safetensors raises
        raise _fail(path, f"{WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None
    if not pairs:
        raise _fail(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = _fuse(path, pairs, model, scale)
    return LoRAAdapter(
        name=name,
        path=path,
        rank=rank,
        scaling=scale,
        digest=digest,
        base_model=base,
        target_modules=tuple(sorted({m for _, m in pairs})),
        weights=weights,
    )


def _floating(path: Path, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` if its dtype is a float one LoRA weights are saved in (an int8 tensor would be
    quantized weights without their scales, read as if they were the values)."""
    if tensor.dtype not in WEIGHT_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in WEIGHT_DTYPES)
        raise _fail(
            path,
            f"tensor {key!r} has dtype {str(tensor.dtype).removeprefix('torch.')}: LoRA weights "
            f"must be {allowed}",
        )
    return tensor


def _check_fits(path: Path, where: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
    """Refuse an update that overflows the model's dtype (that of `a` and of `b`, which is B
    times the scaling as kept): `a` and `b` must be finite, and so must `x @ a.T` and
    `(x @ a.T) @ b.T` for any `x` whose entries are at most 1 in magnitude, bounded in float64
    by the absolute row sums. Otherwise every request naming the adapter fails on non-finite
    logits, long after its load succeeded."""
    dtype = str(a.dtype).removeprefix("torch.")
    if not bool(torch.isfinite(a).all()):
        raise _fail(path, f"{where}: lora_A overflows {dtype}")
    if not bool(torch.isfinite(b).all()):
        raise _fail(path, f"{where}: lora_B times the scaling {scale:g} overflows {dtype}")
    limit = torch.finfo(a.dtype).max
    bound_h = a.double().abs().sum(dim=1)
    bound_out = float((b.double().abs() @ bound_h).max())
    if float(bound_h.max()) > limit or bound_out > limit:
        raise _fail(
            path,
            f"{where}: the update overflows {dtype} (max {limit:.3g}) for inputs of magnitude 1 "
            f"(|x @ A.T| up to {float(bound_h.max()):.3g}, |update| up to {bound_out:.3g})",
        )


def _fuse(
    path: Path,
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]],
    model: ModelConfig,
    scale: float,
) -> dict[tuple[int, str], LoRAWeights]:
    """Per (layer, our linear): the stacked A, the placed and scaled B, and B's slices
    (module docstring), each module's update checked to fit the model's dtype."""
    dtype = model.torch_dtype
    slices = fused_slices(model)
    grouped: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise _fail(path, f"layer {layer} {module} has no lora_{missing} weight")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != b.shape[1]:
            raise _fail(
                path, f"layer {layer} {module}: lora_A has rank {a.shape[0]}, lora_B {b.shape[1]}"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise _fail(path, f"layer {layer} {module} has non-finite weights")
        # What the model keeps, checked as it is kept (B scaled in fp32, as always).
        a, b = a.float().to(dtype), (b.float() * scale).to(dtype)
        _check_fits(path, f"layer {layer} {module}", a, b, scale)
        linear, index = MODULES[module]
        grouped.setdefault((layer, linear), []).append((index, a, b))
    fused: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, linear), parts in grouped.items():
        widths = slices[linear]
        parts.sort(key=lambda p: p[0])  # A's rows and B's columns in the same slice order
        total_rank = sum(a.shape[0] for _, a, _ in parts)
        big_a = torch.cat([a for _, a, _ in parts]).contiguous()
        big_b = torch.zeros(sum(widths), total_rank, dtype=dtype)
        b_slices = []
        col = 0
        for index, a, b in parts:
            row = sum(widths[:index])
            big_b[row : row + widths[index], col : col + a.shape[0]] = b
            b_slices.append((row, col, widths[index]))
            col += a.shape[0]
        fused[(layer, linear)] = lora_weights(big_a, big_b, b_slices)
    return fused
