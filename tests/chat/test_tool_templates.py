"""The packaged tool templates and the call grammar, on the packaged models' tokenizers and the
default model: a model whose own template renders no tools gets its family's packaged one, the
history of calls and results renders, and a call held to the grammar parses and validates."""

from __future__ import annotations

import jsonschema
import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.entrypoints.chat.tool_grammar import (
    ToolSpec,
    auto_call_grammar,
    forced_call_grammar,
)
from prefixserve.entrypoints.chat.tool_parsers import parse_hermes
from prefixserve.entrypoints.chat.tool_templates import renders_tools, tool_template
from prefixserve.model.loader.default_model import ensure_gemma3_270m
from prefixserve.model.tokenizer import Tokenizer
from prefixserve.sampling_params import StructuredOutputsParams

WEATHER = ToolSpec(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
SEARCH = ToolSpec(
    "search", {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
)
TOOLS = [
    {"type": "function", "function": {"name": t.name, "parameters": t.parameters}}
    for t in (WEATHER, SEARCH)
]
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tokenizer(request, default_model_dir):
    path = default_model_dir if request.param == "smollm2" else ensure_gemma3_270m()
    return Tokenizer.from_pretrained(path)


def test_a_model_whose_template_renders_no_tools_gets_its_familys_packaged_one(tokenizer):
    own = tokenizer.chat_template
    assert not renders_tools(tokenizer.hf_tokenizer, own)
    template = tool_template(tokenizer.hf_tokenizer, own)
    assert template is not None and template != own
    assert renders_tools(tokenizer.hf_tokenizer, template)


def test_a_history_of_calls_and_results_renders_with_the_tools(tokenizer):
    template = tool_template(tokenizer.hf_tokenizer, tokenizer.chat_template)
    text = tokenizer.hf_tokenizer.apply_chat_template(
        HISTORY, tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    for piece in (
        '"name": "search"',
        "Be brief.",
        '"arguments": {"city": "Paris"}',
        '{"temp": 21}',
    ):
        assert piece in text
    content, calls = parse_hermes(text[text.index("<tool_call>\n{") :])
    assert [c.name for c in calls][:1] == ["get_weather"]


@pytest.fixture(scope="module")
def llm(default_model_exact):
    return LLM(dtype=default_model_exact.config.dtype, loaded_model=default_model_exact)


def _answer(llm: LLM, grammar: str, temperature: float = 0.0) -> str:
    tok = llm.llm_engine.tokenizer
    template = tool_template(tok.hf_tokenizer, tok.chat_template)
    prompt = tok.hf_tokenizer.apply_chat_template(
        HISTORY[:2], tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    params = SamplingParams(
        max_tokens=80,
        temperature=temperature,
        seed=4,
        structured_outputs=StructuredOutputsParams(grammar=grammar),
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" or "<tool_call>" not in out.text, out
    return out.text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_forced_call_parses_and_its_arguments_validate(llm, temperature):
    for tools in ([WEATHER], [WEATHER, SEARCH]):
        content, calls = parse_hermes(_answer(llm, forced_call_grammar(tools, False), temperature))
        assert content is None and len(calls) == 1
        spec = next(t for t in tools if t.name == calls[0].name)
        jsonschema.validate(calls[0].arguments, spec.parameters)


def test_auto_lets_the_model_answer_in_text_and_holds_a_call_it_opens_to_the_schema(llm):
    grammar = auto_call_grammar([WEATHER, SEARCH], parallel=False)
    content, calls = parse_hermes(_answer(llm, grammar))
    for call in calls:
        spec = next(t for t in (WEATHER, SEARCH) if t.name == call.name)
        jsonschema.validate(call.arguments, spec.parameters)
    assert content or calls
