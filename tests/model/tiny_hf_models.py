"""Random-weight tiny transformers models of each family, and a runner harness around ours.

Each model is saved with `save_pretrained` and its config.json read back, so our config parsing
sees exactly what a real checkpoint directory holds (values equal to defaults are left out).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from prefixserve.core.request import Request
from prefixserve.core.sched.output import PositionLogprobs, ScheduledRequest, SchedulerOutput
from prefixserve.model.config import ModelConfig
from prefixserve.model.loader.hf_config import model_config_from_hf
from prefixserve.model.models.registry import create_model
from prefixserve.sampling_params import SamplingParams
from prefixserve.worker.model_runner import ModelRunner

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
SLIDING_WINDOW = 8


def hf_config(family: str) -> transformers.PretrainedConfig:
    if family == "llama":
        return transformers.LlamaConfig(**_COMMON, tie_word_embeddings=False)
    if family == "llama_tied":
        return transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True)
    if family == "mistral":
        return transformers.MistralConfig(**_COMMON, sliding_window=SLIDING_WINDOW)
    if family == "qwen2":
        return transformers.Qwen2Config(**_COMMON)
    if family == "qwen3":
        return transformers.Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=True)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **_COMMON,
            head_dim=16,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            rope_theta=10_000.0,
            rope_local_base_freq=100.0,
        )
    raise KeyError(family)


def build_hf_model(family: str, tmp_path: Path, seed: int = 0) -> tuple[torch.nn.Module, dict]:
    """A random-weight transformers model in fp32 eval mode and its saved config.json."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(family), attn_implementation="eager", torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():
        # Larger than the init's 0.02 so that every block visibly moves the logits.
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model, json.loads((tmp_path / "config.json").read_text())


def build_ours(hf_model: torch.nn.Module, config_json: dict, dtype: str = "float32"):
    config = model_config_from_hf(config_json, dtype)
    model = create_model(config)
    model.load_weights(hf_model.state_dict().items())
    return model, config


def reference_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `token_ids`, [len, vocab] float32."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


class RecordingSampler:
    """Greedy sampler that keeps the logits it was given, per request id, in call order."""

    def __init__(self) -> None:
        self.sampled: dict[str, list[torch.Tensor]] = {}
        self.prompt: list[torch.Tensor] = []

    def __call__(self, logits, requests, generators) -> list[tuple[int, PositionLogprobs | None]]:
        assert logits.dtype == torch.float32 and logits.shape[0] == len(requests)
        assert len(generators) == len(requests)
        out = []
        for row, req in zip(logits, requests, strict=True):
            self.sampled.setdefault(req.request_id, []).append(row.clone())
            out.append((int(row.argmax()), None))
        return out

    def compute_prompt_logprobs(self, logits, target_ids, num_top) -> list[PositionLogprobs]:
        assert logits.shape[0] == len(target_ids)
        self.prompt.append(logits.clone())
        lp = torch.log_softmax(logits, dim=-1)
        return [[(t, float(lp[i, t]), 1)] for i, t in enumerate(target_ids)]


class BlockAllocator:
    """Hands out distinct block ids per KV-cache group (block 0 is the null block)."""

    def __init__(self, num_groups: int) -> None:
        self.next = [1] * num_groups

    def take(self, group: int, count: int) -> list[int]:
        ids = list(range(self.next[group], self.next[group] + count))
        self.next[group] += count
        return ids


@dataclass
class Harness:
    model: torch.nn.Module
    config: ModelConfig
    runner: ModelRunner
    sampler: RecordingSampler
    block_size: int

    @property
    def num_groups(self) -> int:
        return len(self.config.kv_cache_groups())


def make_harness(
    hf_model: torch.nn.Module, config_json: dict, block_size: int = 4, num_blocks: int = 64
) -> Harness:
    model, config = build_ours(hf_model, config_json)
    sampler = RecordingSampler()
    runner = ModelRunner(
        model, config, num_blocks=num_blocks, block_size=block_size, sampler=sampler
    )
    # Poison the null block: any read of it would turn logits into NaN.
    for k, v in runner.kv_caches:
        k[0].fill_(float("nan"))
        v[0].fill_(float("nan"))
    return Harness(model, config, runner, sampler, block_size)


def greedy_request(req_id: str, prompt: list[int], prompt_logprobs: int | None = 0) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=32, prompt_logprobs=prompt_logprobs)
    return Request(req_id, prompt, params)


def step(h: Harness, entries: list[tuple[Request, int, int, tuple[list[int], ...]]]):
    """Run one step of (request, num_computed, num_new, block_ids) entries."""
    scheduled = [ScheduledRequest(r, c, n, ids) for r, c, n, ids in entries]
    return h.runner.execute(SchedulerOutput(scheduled))


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert torch.isfinite(ours).all()
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * scale + 1e-6, f"max abs error {err:.3g} at logit scale {scale:.3g}"
