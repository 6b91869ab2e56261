"""The Messages API's content blocks of an answer with tools, without a server: streamed in any
pieces, the events rebuild the blocks the whole answer has (text, then each call as a tool_use
whose input is the call's arguments), each block opened, filled and closed in order."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from prefixserve.entrypoints.anthropic.tools import StreamedBlocks, ToolPlan, answer_content
from prefixserve.entrypoints.chat.tool_parsers.hermes import HermesStreamParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PLAN = ToolPlan(constraint=None, parse_calls=True)


def _rebuild(text: str, cuts: list[int]) -> list[dict]:
    """The content blocks a client rebuilds from the events of `text` streamed in pieces."""
    blocks = StreamedBlocks(HermesStreamParser())
    events = blocks.opening()
    start = 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += blocks.feed(text[start:cut])
        start = cut
    events += blocks.finish()
    content: list[dict] = []
    partial: dict[int, str] = {}
    open_index = None
    for name, data in events:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(content)
            content.append(dict(data["content_block"]))
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
            delta = data["delta"]
            if delta["type"] == "text_delta":
                content[open_index]["text"] += delta["text"]
            else:
                partial[open_index] = partial.get(open_index, "") + delta["partial_json"]
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert open_index is None
    for index, piece in partial.items():
        content[index]["input"] = json.loads(piece)
    return content


def _shape(blocks: list[dict]) -> list[tuple]:
    return [
        ("text", b["text"].strip()) if b["type"] == "text" else ("tool_use", b["name"], b["input"])
        for b in blocks
    ]


@given(
    st.lists(st.integers(0, 300), max_size=20),
    st.sampled_from(["", "Let me check. ", "a <tool"]),
    st.integers(1, 2),
)
def test_streamed_blocks_in_any_pieces_are_the_whole_answers_blocks(cuts, text, num_calls):
    answer = text + "\n".join([CALL] * num_calls)
    whole, has_calls = answer_content(PLAN, answer)
    assert has_calls
    streamed = _rebuild(answer, cuts)
    assert _shape(streamed) == _shape([b.model_dump() for b in whole])
    assert all(b["id"].startswith("toolu_") for b in streamed if b["type"] == "tool_use")


def test_an_answer_with_nothing_in_it_is_one_empty_text_block_whole_and_streamed():
    whole, has_calls = answer_content(PLAN, "")
    assert not has_calls and [b.model_dump() for b in whole] == [{"type": "text", "text": ""}]
    assert _rebuild("", []) == [{"type": "text", "text": ""}]
