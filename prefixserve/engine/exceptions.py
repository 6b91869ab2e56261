"""The engine's errors, in one place the server, the cluster and the CLI import (never the step
loop's or a replica's implementation files): what an engine client raises, and what a reader of
a request's stream may get. The stream itself is `request_stream.RequestStream`."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine's step loop failed or was shut down; no request can be served."""


class StreamStalledError(RuntimeError):
    """The request was aborted because its reader took no output for the stall timeout."""


class NotSupportedByEngine(Exception):  # noqa: N818 - reads as the sentence it raises
    """This engine client cannot do what was asked (e.g. pins with replicas): a typed refusal."""
