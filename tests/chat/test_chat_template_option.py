"""`--chat-template` / `LLM(chat_template=...)`: the operator's template renders every chat of
that engine (and tool calls, where it renders tools), never another engine's over the same
loaded model; a path that cannot be read is a ValueError naming the option. `LLM.chat(tools=)`
renders the tools with the tool-capable template."""

from __future__ import annotations

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.entrypoints.chat.tool_grammar import ToolSpec, forced_call_grammar
from prefixserve.entrypoints.chat.tool_parsers import parse_hermes
from prefixserve.sampling_params import StructuredOutputsParams

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]


def test_the_operators_chat_template_renders_that_engines_chats_only(default_model_exact, tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    dtype = default_model_exact.config.dtype
    custom = LLM(dtype=dtype, loaded_model=default_model_exact, chat_template=str(path))
    plain = LLM(dtype=dtype, loaded_model=default_model_exact)
    hi = [{"role": "user", "content": "hi"}]
    assert custom.get_tokenizer().apply_chat_template_text(hi) == "[user] hi\n[assistant] "
    assert plain.get_tokenizer().apply_chat_template_text(hi).startswith("<|im_start|>")
    inline = LLM(dtype=dtype, loaded_model=default_model_exact, chat_template=TEMPLATE)
    assert inline.get_tokenizer().chat_template == TEMPLATE


def test_a_chat_template_path_that_cannot_be_read_is_refused_naming_it(default_model_exact):
    with pytest.raises(ValueError, match="chat_template: cannot read"):
        LLM(loaded_model=default_model_exact, chat_template="/no/such/template.jinja")


def test_offline_chat_renders_tools_and_a_forced_call_parses(default_model_exact):
    llm = LLM(dtype=default_model_exact.config.dtype, loaded_model=default_model_exact)
    grammar = forced_call_grammar([ToolSpec("get_weather", PARAMETERS)], parallel=False)
    params = SamplingParams(
        max_tokens=60, temperature=0, structured_outputs=StructuredOutputsParams(grammar=grammar)
    )
    out = llm.chat(
        [{"role": "user", "content": "Weather in Rome?"}], params, tools=TOOLS, use_tqdm=False
    )
    content, calls = parse_hermes(out[0].outputs[0].text)
    assert [c.name for c in calls] == ["get_weather"] and "city" in calls[0].arguments
    assert '"name": "get_weather"' in out[0].prompt
