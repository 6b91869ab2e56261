"""Which chat template renders a request with tools: the model's own when it renders them, else
the packaged one for its family (`templates/`: ChatML in the Hermes style for SmolLM2 and other
ChatML models, Gemma 3's with the same call format), or the operator's `--chat-template FILE`.

A template "renders tools" when a probe conversation with one tool comes out naming that tool.
The call format of the packaged templates is Hermes', read by `tool_parsers/hermes.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).parent / "templates"
# A template's family, by a marker its text contains -> the packaged tool template.
_FAMILIES = (("<|im_start|>", "chatml_tools.jinja"), ("<start_of_turn>", "gemma3_tools.jinja"))
_PROBE_TOOL = "prefixserve_probe_tool"


def renders_tools(hf_tokenizer: Any, template: str) -> bool:
    """Whether `template` puts a request's tools into the prompt (probed once per template)."""
    known = _RENDERS_TOOLS.get(template)
    if known is None:
        known = _RENDERS_TOOLS[template] = _probe(hf_tokenizer, template)
    return known


# template text -> whether it renders tools (a server has one or two templates; bounded anyway).
_RENDERS_TOOLS: dict[str, bool] = {}


def _probe(hf_tokenizer: Any, template: str) -> bool:
    if len(_RENDERS_TOOLS) > 64:
        _RENDERS_TOOLS.clear()
    tools = [
        {
            "type": "function",
            "function": {"name": _PROBE_TOOL, "parameters": {"type": "object"}},
        }
    ]
    try:
        text = hf_tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}],
            tools=tools,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception:  # noqa: BLE001 - a template that cannot take tools renders none
        return False
    return _PROBE_TOOL in text


def packaged_tool_template(template: str | None) -> str | None:
    """The packaged tool template of the family `template` belongs to (None: unknown family)."""
    if not template:
        return None
    for marker, name in _FAMILIES:
        if marker in template:
            return (TEMPLATES / name).read_text()
    return None


def tool_template(hf_tokenizer: Any, own: str | None) -> str | None:
    """The template that renders tools for a model whose template is `own`: itself when it
    renders them, else the packaged one of its family, else None (tools are refused)."""
    if own and renders_tools(hf_tokenizer, own):
        return own
    return packaged_tool_template(own)
