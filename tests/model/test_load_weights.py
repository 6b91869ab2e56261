"""model.load_weights: Hugging Face names into fused projections, tying, prefixes, errors."""

from __future__ import annotations

import pytest
import torch

from prefixserve.core.request import Request
from prefixserve.core.sched.output import ScheduledRequest, SchedulerOutput
from prefixserve.model.loader.hf_config import model_config_from_hf
from prefixserve.model.models.registry import create_model
from prefixserve.sampling_params import SamplingParams
from prefixserve.worker.model_runner import ModelRunner
from tests.helpers.models import VOCAB, assert_close, build_hf_model, build_ours


def last_logits(model, config, prompt: list[int]) -> torch.Tensor:
    seen = []

    def sampler(logits, requests, generators):
        seen.append(logits.clone())
        return [(0, None)] * len(requests)

    runner = ModelRunner(model, config, num_blocks=16, block_size=4, sampler=sampler)
    ids = tuple(list(range(1, 7)) for _ in config.kv_cache_groups())
    req = Request("x", prompt, SamplingParams(temperature=0))
    runner.execute(SchedulerOutput([ScheduledRequest(req, 0, len(prompt), ids)]))
    return seen[0][0]


def test_missing_lm_head_is_tied_to_the_embedding(tmp_path):
    hf_model, config_json = build_hf_model("llama", tmp_path)  # untied
    config = model_config_from_hf(config_json, "float32")
    model = create_model(config)
    weights = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    model.load_weights(weights.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tied_checkpoint_with_a_redundant_lm_head_loads(tmp_path):
    hf_model, config_json = build_hf_model("llama_tied", tmp_path)
    model, config = build_ours(hf_model, config_json)  # state_dict carries lm_head.weight too
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = list(range(10))
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0, -1]
    assert_close(last_logits(model, config, prompt), ref)


def test_rotary_inv_freq_buffers_are_skipped(tmp_path):
    hf_model, config_json = build_hf_model("qwen3", tmp_path)
    model = create_model(model_config_from_hf(config_json, "float32"))
    weights = list(hf_model.state_dict().items())
    weights.append(("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8)))
    model.load_weights(weights)


def test_missing_weight_is_named(tmp_path):
    hf_model, config_json = build_hf_model("qwen2", tmp_path)
    model = create_model(model_config_from_hf(config_json, "float32"))
    weights = {
        k: v
        for k, v in hf_model.state_dict().items()
        if k != "model.layers.1.self_attn.k_proj.bias"
    }
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.bias"):
        model.load_weights(weights.items())


def test_unknown_or_misshapen_tensors_are_refused(tmp_path):
    hf_model, config_json = build_hf_model("llama", tmp_path)
    model = create_model(model_config_from_hf(config_json, "float32"))
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        model.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(96, 64))])
    with pytest.raises(ValueError, match=r"shape \(3, 64\)"):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 64))])


def test_gemma3_multimodal_checkpoint_names_load_the_text_model(tmp_path):
    hf_model, config_json = build_hf_model("gemma3", tmp_path)
    hf_text = dict(hf_model.state_dict())
    # Names as published Gemma 3 multimodal checkpoints hold them.
    weights = [(k.replace("model.", "language_model.model.", 1), v) for k, v in hf_text.items()]
    weights.append(("vision_tower.vision_model.embeddings.patch_embedding.weight", torch.ones(2)))
    weights.append(("multi_modal_projector.mm_input_projection_weight", torch.ones(2)))
    config_json = {**config_json, "architectures": ["Gemma3ForConditionalGeneration"]}
    config_json["model_type"] = "gemma3_text"
    config = model_config_from_hf(config_json, "float32")
    model = create_model(config)
    model.load_weights(weights)
    prompt = torch.randint(0, VOCAB, (13,)).tolist()
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0, -1]
    assert_close(last_logits(model, config, prompt), ref)
