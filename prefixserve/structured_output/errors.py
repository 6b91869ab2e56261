"""What a structured-output request can be refused for, as exceptions the server maps to HTTP.

`GrammarError` is a ValueError (the client's constraint is bad: a 400 naming the reason);
`GrammarBusy` is not (the client's tenant has too much compile work in flight: a 429).
`reason` is the label the rejection is counted under in the engine's metrics.
"""

from __future__ import annotations

# Rejection reasons, as counted (`structured_output_rejections` in the engine's metrics).
REJECTION_REASONS = ("invalid_schema", "unsupported", "invalid_grammar", "timeout", "busy")


class GrammarError(ValueError):
    """The constraint cannot be compiled: not valid JSON Schema, a keyword or format the
    library does not support, a grammar or regex that does not parse, or a compile past the
    time bound."""

    def __init__(self, message: str, reason: str) -> None:
        assert reason in REJECTION_REASONS, reason
        super().__init__(message)
        self.reason = reason


class GrammarBusy(Exception):
    """The tenant already has as many grammar compiles in flight as it may: retry later."""

    reason = "busy"
