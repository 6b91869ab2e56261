"""The Hermes tool-call parser: calls come out as (name, arguments object), text around them as
content, and anything that does not parse as a call stays text (never an error)."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from prefixserve.entrypoints.chat.tool_parsers.hermes import (
    HermesStreamParser,
    parse_hermes,
    render_calls,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_call_parses_to_its_name_and_arguments_object():
    content, calls = parse_hermes(CALL)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_text_before_a_call_is_the_content_and_parallel_calls_keep_their_order():
    text = "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome")
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [c.arguments["city"] for c in calls] == ["Paris", "Rome"]


def test_text_that_does_not_parse_as_a_call_stays_text():
    for text in (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {}}',  # never closed
        "plain answer",
    ):
        content, calls = parse_hermes(text)
        assert calls == [] and content == text


def test_a_closing_tag_inside_an_arguments_string_is_part_of_the_call():
    """A sampled argument held the tag (`"query": "Cuisine</tool_call> Paris"`): the call ends at
    the tag after its JSON object, whole and streamed, early or not."""
    arguments = {"query": "Cuisine</tool_call> Paris, <tool_call> 2022-"}
    text = render_calls(None, [("search", json.dumps(arguments))])
    content, calls = parse_hermes(text)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("search", arguments)]
    for cuts in ([], [20], list(range(0, len(text), 3))):
        assert _stream(text, cuts) == ("", [("search", arguments)])
        events = _early_events(text, cuts)
        assert "".join(e.text for e in events if e.kind == "text") == ""
        pieces = "".join(e.text for e in events if e.kind == "call_arguments")
        assert json.loads(pieces) == arguments


def test_an_object_that_never_closes_is_text_up_to_its_first_tag_whole_and_streamed():
    text = '<tool_call>{"name": "f", "arguments": {"a": "x</tool_call> then <tool_call>' + (
        '{"name": "g", "arguments": {}}</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert [c.name for c in calls] == ["g"]
    assert content == '<tool_call>{"name": "f", "arguments": {"a": "x</tool_call> then'
    for cuts in ([], [30], list(range(0, len(text), 7))):
        streamed_content, streamed_calls = _stream(text, cuts)
        assert streamed_calls == [("g", {})]
        assert streamed_content.replace(" ", "") == content.replace(" ", "")


def _stream(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, dict]]]:
    parser = HermesStreamParser()
    events = []
    start = 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[start:cut])
        start = cut
    events += parser.finish()
    content = "".join(e.text for e in events if e.kind == "text")
    names = {e.index: e.name for e in events if e.kind == "call_start"}
    arguments: dict[int, str] = {}
    for e in events:
        if e.kind == "call_arguments":
            arguments[e.index] = arguments.get(e.index, "") + e.text
    return content, [(names[i], json.loads(arguments[i])) for i in sorted(names)]


@given(st.lists(st.integers(0, 400), max_size=30), st.sampled_from(["", "Sure. ", "x <tool"]))
def test_streaming_in_any_pieces_gives_what_the_whole_text_gives(cuts, prefix):
    text = prefix + CALL + "\n" + CALL.replace("Paris", "Oslo") + " <tool_call>{bad}</tool_call>"
    content, calls = parse_hermes(text)
    streamed_content, streamed_calls = _stream(text, [c % (len(text) + 1) for c in cuts])
    assert streamed_calls == [(c.name, c.arguments) for c in calls]
    assert streamed_content.replace(" ", "").replace("\n", "") == (content or "").replace(
        " ", ""
    ).replace("\n", "")


def test_a_tools_objects_are_closed_unless_the_schema_opens_them():
    from prefixserve.entrypoints.chat.tool_grammar import closed_objects

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "c": {"type": "object", "properties": {}, "additionalProperties": True},
            "d": {"type": "array", "items": {"properties": {"e": {}}}},
        },
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True
    assert closed["properties"]["d"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is untouched


def _early_events(text: str, cuts: list[int]) -> list:
    parser = HermesStreamParser(early=True)
    events, start = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[start:cut])
        start = cut
    return events + parser.finish()


def test_an_early_call_releases_its_name_once_its_head_is_written():
    parser = HermesStreamParser(early=True)
    head = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    events = parser.feed("Sure.\n" + head)
    assert [(e.kind, e.name or e.text) for e in events] == [
        ("text", "Sure."),
        ("call_start", "get_weather"),
        ("call_arguments", '{"ci'),
    ]
    events = parser.feed('ty": "Paris"}}\n</tool_call>') + parser.finish()
    assert [(e.kind, e.text) for e in events] == [("call_arguments", 'ty": "Paris"}')]


ARGUMENTS = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=8)
    | st.sampled_from(["</tool_call>", "a<tool_call>b", "}</tool_call>"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["f", "get_weather", 'q"uote']),
            st.dictionaries(st.text(max_size=5), ARGUMENTS, max_size=3),
        ),
        min_size=1,
        max_size=3,
    ),
    st.text(alphabet='ab <>\n{}"', max_size=12),
    st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_early_calls_stream_as_the_whole_answer_parses_them(calls, prefix, cuts):
    """Calls as the grammar writes them (json.dumps), cut anywhere: the streamed names and the
    concatenated argument pieces are the whole answer's calls."""
    rendered = [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    text = prefix.replace("<tool_call>", "") + "\n" + render_calls(None, rendered)
    content, parsed = parse_hermes(text)
    events = _early_events(text, [c % (len(text) + 1) for c in cuts])
    names = {e.index: e.name for e in events if e.kind == "call_start"}
    pieces: dict[int, str] = {}
    for e in events:
        if e.kind == "call_arguments":
            pieces[e.index] = pieces.get(e.index, "") + e.text
    assert [(names[i], json.loads(pieces[i])) for i in sorted(names)] == [
        (c.name, c.arguments) for c in parsed
    ]
    streamed = "".join(e.text for e in events if e.kind == "text")
    assert streamed.replace(" ", "").replace("\n", "") == (content or "").replace(" ", "").replace(
        "\n", ""
    )


def test_an_early_call_cut_by_max_tokens_streams_as_far_as_it_was_written():
    events = _early_events('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', [5, 30])
    assert [e.kind for e in events if e.kind != "call_arguments"] == ["call_start"]
    assert "".join(e.text for e in events if e.kind == "call_arguments") == '{"a": [1, 2'
