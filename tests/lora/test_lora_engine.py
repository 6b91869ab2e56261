"""LoRA adapters through the whole engine (fp32, tiny random-weight models, adapters saved by
peft): outputs equal transformers + peft, mixed batches equal each request alone, caches stay
apart per adapter, and every bad adapter or request is refused with a clear error.

Tolerance for prompt logprobs: 1e-4 absolute. Ours and transformers' compute the same fp32
arithmetic in another order (fused q/k/v and gate/up, paged attention, the low-rank update's
scaling folded into B), which moves a logprob by ~1e-6 here; an adapter moves them by > 1e-2
(each test checks that it does), so the bound separates "same model" from "another model".
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from prefixserve import SamplingParams
from prefixserve.core.kv_cache.events import BlockStored
from prefixserve.lora.config import LoRARequest, LoRASlotsBusyError
from prefixserve.lora.manager import LoRAInUseError
from tests.helpers.lora import (
    build_hf_model,
    hf_config,
    hf_greedy,
    hf_logprobs,
    make_adapter,
    our_llm,
)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 33, 2, 90, 11, 7, 64, 3, 99, 41, 8, 19]
TOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer(default_model_fp32):
    return default_model_fp32.tokenizer


def greedy(max_tokens: int = 10, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def prompt_lps(output) -> list[float]:
    token_ids = output.prompt_token_ids
    return [pos[token_ids[i]].logprob for i, pos in enumerate(output.prompt_logprobs) if i]


def run(llm, prompt, params, lora=None):
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora)
    llm.llm_engine.check_no_leaks()
    return out[0]


@pytest.mark.parametrize(
    "family,rank,targets,rslora",
    [
        ("llama", 4, ["q_proj", "v_proj"], False),
        ("llama", 16, ALL, True),
        ("qwen3", 8, ALL, False),
        ("qwen3", 2, ["k_proj", "o_proj", "down_proj"], False),
        ("gemma3", 8, "all-linear", False),
    ],
)
def test_lora_outputs_match_transformers_with_peft(
    family, rank, targets, rslora, tokenizer, tmp_path
):
    hf, config = build_hf_model(family, tmp_path / "base")
    peft_model = make_adapter(
        hf, tmp_path / "adapter", rank=rank, targets=targets, use_rslora=rslora
    )
    llm = our_llm(hf, config, tokenizer)
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    params = greedy(prompt_logprobs=0)
    ours = run(llm, PROMPT, params, lora)
    assert list(ours.outputs[0].token_ids) == hf_greedy(peft_model, PROMPT, 10)
    ref = hf_logprobs(peft_model, PROMPT)
    assert max(abs(a - b) for a, b in zip(prompt_lps(ours), ref, strict=True)) < TOL
    # The adapter really changes the model, and the base model is untouched beside it.
    base = run(llm, PROMPT, params)
    with peft_model.disable_adapter():
        base_ref = hf_logprobs(peft_model, PROMPT)
        assert list(base.outputs[0].token_ids) == hf_greedy(peft_model, PROMPT, 10)
    assert max(abs(a - b) for a, b in zip(prompt_lps(base), base_ref, strict=True)) < TOL
    assert max(abs(a - b) for a, b in zip(ref, base_ref, strict=True)) > 1e-2


@pytest.fixture(scope="module")
def llama_with_adapters(tokenizer, tmp_path_factory):
    """A tiny Llama, three adapters of different ranks and targets, and peft models of each."""
    root = tmp_path_factory.mktemp("lora_llama")
    hf, config = build_hf_model("llama", root / "base")
    specs = {"a": (4, ["q_proj", "v_proj"]), "b": (8, ALL), "c": (2, ["gate_proj", "down_proj"])}
    peft_models = {
        name: make_adapter(hf, root / name, rank=r, targets=t, seed=i)
        for i, (name, (r, t)) in enumerate(specs.items())
    }
    return hf, config, root, peft_models


def request_of(root, name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, 1, str(root / name))


def test_mixed_batch_gives_each_request_its_alone_output(llama_with_adapters, tokenizer):
    hf, config, root, _ = llama_with_adapters
    llm = our_llm(hf, config, tokenizer)
    # "a" twice, apart: its rows are not contiguous in the step (the gathered path).
    names = ["a", None, "b", "a", "c"]
    prompts = [PROMPT[: 6 + i] + [i] for i in range(len(names))]
    params = greedy(prompt_logprobs=0)
    batched = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        use_tqdm=False,
        lora_request=[request_of(root, n) for n in names],
    )
    llm.llm_engine.check_no_leaks()
    for name, prompt, out in zip(names, prompts, batched, strict=True):
        alone = run(llm, prompt, params, request_of(root, name))
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        for x, y in zip(prompt_lps(out), prompt_lps(alone), strict=True):
            assert abs(x - y) < TOL


def test_cache_is_kept_apart_per_adapter_and_shared_within_one(llama_with_adapters, tokenizer):
    hf, config, root, _ = llama_with_adapters
    llm = our_llm(hf, config, tokenizer, enable_kv_events=True)
    prompt = list(range(1, 21))  # 5 full blocks of 4
    params = greedy(max_tokens=2)
    assert run(llm, prompt, params, request_of(root, "a")).num_cached_tokens == 0
    assert run(llm, prompt, params, request_of(root, "b")).num_cached_tokens == 0
    assert run(llm, prompt, params).num_cached_tokens == 0
    assert run(llm, prompt, params, request_of(root, "a")).num_cached_tokens == 16
    stored = [e for e in llm.take_kv_events() if isinstance(e, BlockStored)]
    assert {e.lora_name for e in stored} == {"a", "b", None}
    for event in stored:
        for keys in event.extra_keys:
            if event.lora_name is not None:
                assert keys[0] == event.lora_name  # the adapter name is the first extra key


def test_same_name_with_other_weights_never_hits_the_old_blocks(
    llama_with_adapters, tokenizer, tmp_path
):
    hf, config, root, _ = llama_with_adapters
    llm = our_llm(hf, config, tokenizer)
    prompt = list(range(30, 50))
    run(llm, prompt, greedy(max_tokens=1), request_of(root, "a"))
    llm.llm_engine.unload_lora_adapter("a")
    other = tmp_path / "a"
    make_adapter(hf, other, rank=4, targets=["q_proj", "v_proj"], seed=99)
    again = run(llm, prompt, greedy(max_tokens=1), LoRARequest("a", 1, str(other)))
    assert again.num_cached_tokens == 0


def test_adapter_slots_are_reused_and_in_use_adapters_never_unloaded(
    llama_with_adapters, tokenizer
):
    hf, config, root, _ = llama_with_adapters
    llm = our_llm(hf, config, tokenizer, max_loras=2)
    engine = llm.llm_engine
    for name in ("a", "b", "c"):  # the third load unloads the least recently used idle one
        run(llm, PROMPT, greedy(max_tokens=1), request_of(root, name))
    assert sorted(engine.lora.adapters) == ["b", "c"]
    engine.add_request("r1", PROMPT, greedy(), lora_request=request_of(root, "b"))
    engine.add_request("r2", PROMPT, greedy(), lora_request=request_of(root, "c"))
    with pytest.raises(LoRASlotsBusyError, match="max_loras=2"):
        engine.add_request("r3", PROMPT, greedy(), lora_request=request_of(root, "a"))
    with pytest.raises(LoRAInUseError, match="used by 1 unfinished request"):
        engine.unload_lora_adapter("b")
    engine.abort_request(["r1", "r2"])
    engine.unload_lora_adapter("b")
    with pytest.raises(KeyError):
        engine.unload_lora_adapter("b")
    engine.check_no_leaks()


def _bad(tmp_path, hf, edit_config=None, edit_weights=None, **kwargs):
    path = tmp_path / "bad"
    make_adapter(hf, path, **kwargs)
    if edit_config is not None:
        config = json.loads((path / "adapter_config.json").read_text())
        edit_config(config)
        (path / "adapter_config.json").write_text(json.dumps(config))
    if edit_weights is not None:
        tensors = load_file(str(path / "adapter_model.safetensors"))
        save_file(edit_weights(tensors), str(path / "adapter_model.safetensors"))
    return LoRARequest("bad", 1, str(path))


def _first(tensors, kind):
    return next(k for k in tensors if f"lora_{kind}" in k)


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing", "does not exist"),
        ("rank", "rank 64 is above max_lora_rank=32"),
        ("dora", "use_dora=True is not supported"),
        ("bias", "bias='all' is not supported"),
        ("target", r"unknown target module\(s\) \['lm_head'\]"),
        ("shape", r"has shape \[4, 32\], this model's q_proj needs"),
        ("nan", "non-finite weights"),
        ("stray", "is not a LoRA A/B weight"),
        ("missing_b", "has no lora_B weight"),
    ],
)
def test_bad_adapters_are_refused_naming_what_does_not_fit(
    case, match, llama_with_adapters, tokenizer, tmp_path
):
    hf, config, root, _ = llama_with_adapters
    llm = our_llm(hf, config, tokenizer)
    if case == "missing":
        lora = LoRARequest("bad", 1, str(tmp_path / "nowhere"))
    elif case == "rank":
        lora = _bad(tmp_path, hf, rank=64)
    elif case == "dora":
        lora = _bad(tmp_path, hf, edit_config=lambda c: c.update(use_dora=True))
    elif case == "bias":
        lora = _bad(tmp_path, hf, edit_config=lambda c: c.update(bias="all"))
    elif case == "target":
        lora = _bad(tmp_path, hf, edit_config=lambda c: c.update(target_modules=["lm_head"]))
    elif case == "shape":  # an adapter trained for a model with another hidden size
        config = hf_config("llama")
        config.hidden_size, config.intermediate_size = 32, 48
        other = transformers.LlamaForCausalLM(config)
        lora = _bad(tmp_path, other)
    elif case == "nan":
        lora = _bad(
            tmp_path,
            hf,
            edit_weights=lambda t: {**t, _first(t, "B"): t[_first(t, "B")] * float("nan")},
        )
    elif case == "stray":
        lora = _bad(tmp_path, hf, edit_weights=lambda t: {**t, "lm_head.weight": torch.ones(2)})
    else:
        lora = _bad(
            tmp_path, hf, edit_weights=lambda t: {k: v for k, v in t.items() if "lora_B" not in k}
        )
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": PROMPT}], greedy(), use_tqdm=False, lora_request=lora)
    llm.llm_engine.check_no_leaks()
    assert "bad" not in llm.llm_engine.lora.adapters
    # The engine goes on serving.
    assert run(llm, PROMPT, greedy(max_tokens=2), request_of(root, "a")).outputs[0].token_ids


def test_scaling_follows_peft_alpha_default_and_rslora(llama_with_adapters, tmp_path):
    hf, config, _, _ = llama_with_adapters
    from prefixserve.lora.adapter import load_adapter
    from prefixserve.model.loader.hf_config import model_config_from_hf

    ours = model_config_from_hf(config, "float32")
    plain = _bad(tmp_path, hf, rank=4, edit_config=lambda c: c.pop("lora_alpha"))
    assert load_adapter("p", plain.lora_path, ours, 32).scaling == 8 / 4  # PEFT's default alpha
    make_adapter(hf, tmp_path / "rs", rank=16, alpha=8.0, use_rslora=True)
    assert load_adapter("r", tmp_path / "rs", ours, 32).scaling == 8 / 16**0.5


def test_lora_request_without_enable_lora_is_refused(llama_with_adapters, tokenizer):
    hf, config, root, _ = llama_with_adapters
    llm = our_llm(hf, config, tokenizer, enable_lora=False)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate(
            [{"prompt_token_ids": PROMPT}], use_tqdm=False, lora_request=request_of(root, "a")
        )
    llm.llm_engine.check_no_leaks()


def test_bf16_adapter_through_the_native_kernel_tracks_the_fp32_adapter(
    default_model_fp32, default_model_bf16, tmp_path
):
    """The packaged model in bf16, where LoRA runs in csrc/linear/lora.cpp (decode rows and prompts
    of up to 64 tokens): its prompt logprobs with the adapter sit near fp32's with the adapter
    (bf16 rounding) and far from the base model's."""
    from prefixserve import LLM
    from prefixserve.bench.lora_adapters import ALL_MODULES, write_random_adapter

    path = write_random_adapter(tmp_path / "a", default_model_fp32.config, 8, ALL_MODULES, seed=1)
    lora = LoRARequest("a", 1, str(path))
    prompt = list(range(1000, 1040))
    params = greedy(max_tokens=4, prompt_logprobs=0)
    lps = {}
    for dtype, model in (("float32", default_model_fp32), ("bfloat16", default_model_bf16)):
        llm = LLM(
            dtype=dtype,
            loaded_model=model,
            enable_lora=True,
            num_kv_blocks=64,
            enable_kv_store=False,
        )
        for tag, request in (("lora", lora), ("base", None)):
            lps[dtype, tag] = torch.tensor(prompt_lps(run(llm, prompt, params, request)))
    near = (lps["bfloat16", "lora"] - lps["float32", "lora"]).abs().mean()
    far = (lps["bfloat16", "lora"] - lps["float32", "base"]).abs().mean()
    assert near < far / 4, (near, far)
