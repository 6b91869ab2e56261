"""Tool-call parsers, by the names vLLM gives them (`--tool-call-parser`)."""

from prefixserve.entrypoints.chat.tool_parsers.hermes import (
    HermesStreamParser,
    ParsedToolCall,
    parse_hermes,
)

TOOL_CALL_PARSERS = ("hermes",)

__all__ = ["TOOL_CALL_PARSERS", "HermesStreamParser", "ParsedToolCall", "parse_hermes"]
