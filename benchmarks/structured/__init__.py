"""Structured-output benchmarks: the JSON Schema corpus they and the tests draw on."""
