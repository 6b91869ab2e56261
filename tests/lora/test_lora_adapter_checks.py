"""Adapters are checked as the model keeps them and read with PEFT's meaning or not at all: a
scaling or weights that overflow the model's dtype once scaled, PEFT options that make the
adapter compute something other than plain LoRA, and integer tensors are each a ValueError at
load (the server's 400) naming what does not fit, never an adapter that loads and then fails
every request on non-finite logits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixserve import SamplingParams
from prefixserve.lora.adapter import load_adapter
from prefixserve.lora.config import LoRARequest
from prefixserve.model.loader.hf_config import model_config_from_hf
from tests.helpers.lora import build_hf_model, make_adapter, our_llm

Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama (hidden 64) and one good adapter of it (rank 4 on q/v, alpha 8)."""
    root = tmp_path_factory.mktemp("lora_checks")
    hf, config = build_hf_model("llama", root / "base")
    make_adapter(hf, root / "good", rank=4, targets=["q_proj", "v_proj"])
    return hf, config, root / "good"


def copy_adapter(
    good: Path,
    path: Path,
    config: Callable[[dict], None] | None = None,
    weights: Callable[[Tensors], Tensors] | None = None,
) -> Path:
    """The good adapter copied to `path`, its config and tensors edited in place."""
    path.mkdir()
    settings = json.loads((good / "adapter_config.json").read_text())
    if config is not None:
        config(settings)
    (path / "adapter_config.json").write_text(json.dumps(settings))
    tensors = load_file(str(good / "adapter_model.safetensors"))
    save_file(weights(tensors) if weights else tensors, str(path / "adapter_model.safetensors"))
    return path


def load(path: Path, hf_config: dict, dtype: str = "float32"):
    return load_adapter("x", path, model_config_from_hf(hf_config, dtype), 32)


def first(tensors: Tensors, kind: str) -> str:
    return next(k for k in sorted(tensors) if f"lora_{kind}" in k)


def with_value(kind: str, value: float) -> Callable[[Tensors], Tensors]:
    def edit(tensors: Tensors) -> Tensors:
        key = first(tensors, kind)
        return {**tensors, key: torch.full_like(tensors[key], value)}

    return edit


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("alpha", [1e300, -1e300, 1e40])
def test_scaling_that_overflows_the_scaled_weights_is_refused_at_load(
    alpha, dtype, llama, tmp_path
):
    """The weights are finite as saved; times lora_alpha / r, in the model's dtype, not."""
    _, hf_config, good = llama
    path = copy_adapter(good, tmp_path / "a", config=lambda c: c.update(lora_alpha=alpha))
    with pytest.raises(ValueError, match=f"lora_B times the scaling .* overflows {dtype}"):
        load(path, hf_config, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_weights_whose_product_overflows_are_refused_at_load(dtype, llama, tmp_path):
    """3e38 is finite in both dtypes, but x @ A.T sums 64 of them."""
    _, hf_config, good = llama
    path = copy_adapter(good, tmp_path / "a", weights=with_value("A", 3e38))
    with pytest.raises(
        ValueError, match=f"the update overflows {dtype} .* for inputs of magnitude 1"
    ):
        load(path, hf_config, dtype)


def test_scaled_b_is_checked_in_the_dtype_the_model_keeps_it_in(llama, tmp_path):
    """3.4e38 is finite in float32 and rounds to inf in bfloat16 (whose largest is 3.39e38)."""
    _, hf_config, good = llama
    scaled = 3.4e38 / 2  # lora_alpha 8 / r 4
    path = copy_adapter(
        good, tmp_path / "a", weights=lambda t: with_value("A", 0.0)(with_value("B", scaled)(t))
    )
    with pytest.raises(ValueError, match="lora_B times the scaling 2 overflows bfloat16"):
        load(path, hf_config, "bfloat16")
    assert load(path, hf_config, "float32").scaling == 2.0  # A = 0: the update is 0 in float32


def test_overflowing_adapter_is_refused_by_the_engine_which_goes_on_serving(
    llama, default_model_fp32, tmp_path
):
    hf, hf_config, good = llama
    llm = our_llm(hf, hf_config, default_model_fp32.tokenizer)
    path = copy_adapter(good, tmp_path / "a", config=lambda c: c.update(lora_alpha=1e300))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match="overflows float32"):
        llm.generate(
            [{"prompt_token_ids": [1, 2, 3]}],
            params,
            use_tqdm=False,
            lora_request=LoRARequest("huge", 1, str(path)),
        )
    assert "huge" not in llm.llm_engine.lora.adapters
    lora = LoRARequest("good", 1, str(good))
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False, lora_request=lora)
    assert len(out[0].outputs[0].token_ids) == 2
    llm.llm_engine.check_no_leaks()


@pytest.mark.parametrize(
    "key,value",
    [
        ("alora_invocation_tokens", [101, 102]),
        ("layer_replication", [[0, 2], [1, 3]]),
        ("lora_bias", True),
        ("use_dora", True),
        ("fan_in_fan_out", True),
        ("modules_to_save", ["lm_head"]),
        ("rank_pattern", {"q_proj": 8}),
        ("alpha_pattern", {"q_proj": 16}),
        ("trainable_token_indices", [5, 6]),
        ("target_parameters", ["mlp.experts.down_proj"]),
        ("use_qalora", True),
        ("use_bdlora", {"target_modules_bd_a": ["q_proj"]}),
        ("arrow_config", {"top_k": 2}),
        ("kasa_config", {"beta": 0.1}),
        ("monteclora_config", {"num_samples": 4}),
    ],
)
def test_peft_options_that_change_the_computation_are_refused_by_name(key, value, llama, tmp_path):
    _, hf_config, good = llama
    path = copy_adapter(good, tmp_path / "a", config=lambda c: c.update({key: value}))
    with pytest.raises(ValueError, match=rf"{key}=.* is not supported \("):
        load(path, hf_config)


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga"])
def test_adapters_trained_against_changed_base_weights_are_refused(init, llama, tmp_path):
    _, hf_config, good = llama
    path = copy_adapter(good, tmp_path / "a", config=lambda c: c.update(init_lora_weights=init))
    with pytest.raises(ValueError, match=f"init_lora_weights='{init}' is not supported"):
        load(path, hf_config)


def test_use_rslora_must_be_a_boolean(llama, tmp_path):
    _, hf_config, good = llama
    path = copy_adapter(good, tmp_path / "a", config=lambda c: c.update(use_rslora="no"))
    with pytest.raises(ValueError, match="use_rslora must be true or false, got 'no'"):
        load(path, hf_config)


@pytest.mark.parametrize(
    "edits",
    [
        {"layer_replication": None, "alora_invocation_tokens": None, "lora_bias": False},
        {"layer_replication": [], "trainable_token_indices": {}, "use_bdlora": None},
        {"init_lora_weights": "gaussian", "velora_config": {"rank": 4}},
        {"init_lora_weights": "mica", "use_rslora": False},
    ],
)
def test_options_left_at_peft_defaults_or_only_about_training_load(edits, llama, tmp_path):
    _, hf_config, good = llama
    path = copy_adapter(good, tmp_path / "a", config=lambda c: c.update(edits))
    assert load(path, hf_config).scaling == 2.0


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.bool], ids=str)
@pytest.mark.parametrize("kind", ["A", "B"])
def test_integer_tensors_are_refused_naming_the_tensor_and_its_dtype(kind, dtype, llama, tmp_path):
    _, hf_config, good = llama

    def to_int(tensors: Tensors) -> Tensors:
        key = first(tensors, kind)
        return {**tensors, key: tensors[key].mul(100).to(dtype)}

    path = copy_adapter(good, tmp_path / "a", weights=to_int)
    key = first(load_file(str(path / "adapter_model.safetensors")), kind)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError) as info:
        load(path, hf_config)
    message = str(info.value)
    assert f"tensor {key!r} has dtype {name}" in message
    assert "must be float16, bfloat16, float32, float64" in message


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_float_tensors_of_any_width_load(dtype, llama, tmp_path):
    _, hf_config, good = llama
    path = copy_adapter(
        good, tmp_path / "a", weights=lambda t: {k: v.to(dtype) for k, v in t.items()}
    )
    adapter = load(path, hf_config)
    assert all(w.a.dtype == torch.float32 for w in adapter.weights.values())
