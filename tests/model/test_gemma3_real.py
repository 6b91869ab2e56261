"""Gemma 3 270M (the packaged GGUF, converted once): tokenizer, a chat answer, and logits that
match transformers' on a prompt longer than its 512-token sliding window."""

import pytest
import torch

from prefixserve.core.request import Request
from prefixserve.core.sched.output import ScheduledRequest, SchedulerOutput
from prefixserve.model.loader.loading import load_model
from prefixserve.sampling_params import SamplingParams
from prefixserve.worker.model_runner import ModelRunner

pytestmark = pytest.mark.slow

# An English text that tokenizes to well over 512 tokens with Gemma's vocabulary.
PARAGRAPH = (
    "Prefix caching keeps the key and value vectors of earlier requests in fixed-size blocks, "
    "so that a new request whose prompt begins with the same tokens can skip recomputing them. "
    "Each full block is identified by a hash of its tokens and of the hash of the block before "
    "it, which makes the hash of a block stand for the whole prefix that ends with it. "
)


@pytest.fixture(scope="module")
def gemma_dir():
    from prefixserve.model.loader.default_model import ensure_gemma3_270m

    return ensure_gemma3_270m()


def test_gemma_config_is_hybrid_with_a_512_window(gemma3_fp32):
    config = gemma3_fp32.config
    assert config.architecture == "Gemma3ForCausalLM"
    assert config.sliding_window == 512
    assert len(config.kv_cache_groups()) == 2  # full and sliding-window layers


def test_gemma_tokenizer_is_sentencepiece_bpe(gemma3_fp32):
    tokenizer = gemma3_fp32.tokenizer
    ids = tokenizer.encode("The capital of France is")
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "<bos>",
        "The",
        "\u2581capital",
        "\u2581of",
        "\u2581France",
        "\u2581is",
    ]
    text = "Tabs\tand  spaces\n\nnewlines, 日本語 😀"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_gemma_text_encoding_adds_bos_as_its_gguf_says(gemma_dir, gemma3_fp32):
    """Unlike SmolLM2's, Gemma 3's GGUF says tokenizer.ggml.add_bos_token = True (and
    add_eos_token = False): every text starts with <bos> (id 2) and ends without <eos>."""
    import json

    tokenizer = gemma3_fp32.tokenizer
    ids = tokenizer.encode("Hello")
    assert ids == [2, *tokenizer.encode("Hello", add_special_tokens=False)]
    assert ids[-1] not in tokenizer.eos_token_ids
    tok_config = json.loads((gemma_dir / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is True and tok_config["add_eos_token"] is False


def test_gemma_chat_template_and_end_of_turn(gemma3_fp32):
    tokenizer = gemma3_fp32.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = tokenizer.decode(prompt, skip_special_tokens=False)
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    end_of_turn = tokenizer.hf_tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in tokenizer.eos_token_ids


def test_gemma_greedy_answer_is_sensible(gemma_dir, greedy):
    """The packaged file is the base (pretrained) gemma-3-270m, not the -it model: under the
    chat template it repeats the question (transformers' own model does the same), so the
    sensible-answer check uses a question/answer completion prompt."""
    loaded = load_model(gemma_dir, dtype="bfloat16")
    prompt = loaded.tokenizer.encode("Question: What is the capital of France?\nAnswer:")
    answer = loaded.tokenizer.decode(greedy(loaded, prompt, 8))
    assert answer.startswith(" Paris"), answer


class _Recorder:
    """Greedy sampler that keeps the logits rows it was given."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def __call__(self, logits, requests, generators):
        self.rows.extend(row.clone() for row in logits)
        return [(int(row.argmax()), None) for row in logits]


def test_gemma_logits_match_transformers_past_the_sliding_window(gemma3_fp32, gemma_dir):
    from transformers import AutoModelForCausalLM

    tokenizer = gemma3_fp32.tokenizer
    ids = tokenizer.encode(PARAGRAPH * 12)
    assert len(ids) > 700
    ids = ids[:700]
    num_decode = 4
    prefill_len = len(ids) - num_decode

    # Ours: the prompt in two chunks (the second one crossing the window), then decode steps
    # that feed the true next tokens, so every position is compared with the same reference.
    recorder = _Recorder()
    block_size = 16
    num_blocks = len(ids) // block_size + 2
    runner = ModelRunner(
        gemma3_fp32.model,
        gemma3_fp32.config,
        num_blocks=num_blocks + 1,
        block_size=block_size,
        sampler=recorder,
    )
    block_ids = tuple(list(range(1, num_blocks + 1)) for _ in gemma3_fp32.config.kv_cache_groups())
    request = Request("g", ids[:prefill_len], SamplingParams(temperature=0.0))
    chunks = [(0, 300), (300, prefill_len - 300)]
    for start, count in chunks:
        runner.execute(SchedulerOutput([ScheduledRequest(request, start, count, block_ids)]))
    for k in range(num_decode):
        request.append_output_token_ids(ids[prefill_len + k])
        step = ScheduledRequest(request, prefill_len + k, 1, block_ids)
        runner.execute(SchedulerOutput([step]))
    ours = torch.stack(recorder.rows)  # positions prefill_len - 1 ... len(ids) - 1
    assert ours.shape[0] == num_decode + 1

    reference_model = AutoModelForCausalLM.from_pretrained(
        gemma_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        reference = (
            reference_model(torch.tensor([ids]), logits_to_keep=num_decode + 1).logits[0].float()
        )
    del reference_model

    scale = reference.abs().max().item()
    err = (ours - reference).abs().max().item()
    assert err <= 2e-3 * scale, f"max abs error {err:.3g} at logit scale {scale:.3g}"
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
