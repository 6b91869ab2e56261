"""The structured-output schema corpus (benchmarks/structured/schemas.py): every schema is valid
JSON Schema with a prompt and a unique name, and every refusal case names what its error says.
Compiling them is the engine's tests' business (tests of prefixserve/structured_output)."""

from __future__ import annotations

import jsonschema
import pytest

from benchmarks.structured.schemas import PROMPTS, SCHEMAS, UNSUPPORTED


@pytest.mark.parametrize(("name", "schema"), SCHEMAS, ids=[name for name, _ in SCHEMAS])
def test_every_schema_is_valid_json_schema(name, schema):
    jsonschema.validators.validator_for(schema).check_schema(schema)


def test_the_corpus_holds_at_least_50_schemas_with_unique_names():
    names = [name for name, _ in SCHEMAS]
    assert len(names) >= 50
    assert len(set(names)) == len(names)


def test_every_schema_has_a_prompt_and_every_prompt_a_schema():
    assert set(PROMPTS) == {name for name, _ in SCHEMAS}
    assert all(isinstance(p, str) and p.strip() for p in PROMPTS.values())


def test_every_schema_is_a_non_empty_object():
    # No `true`/`false` schema and no `{}`: each one constrains the answer.
    assert all(isinstance(schema, dict) and schema for _, schema in SCHEMAS)


def test_every_unsupported_case_names_a_lowercase_substring_of_its_error():
    names = [name for name, _, _ in UNSUPPORTED]
    assert len(names) >= 8
    assert len(set(names)) == len(names)
    assert not set(names) & {name for name, _ in SCHEMAS}
    for name, schema, expected in UNSUPPORTED:
        assert isinstance(schema, dict), name
        assert expected.strip() and expected == expected.lower(), name


@pytest.mark.parametrize(
    ("name", "schema", "expected"), UNSUPPORTED, ids=[name for name, _, _ in UNSUPPORTED]
)
def test_only_the_not_valid_cases_fail_check_schema(name, schema, expected):
    """The engine's "not a valid json schema" is what check_schema refuses; each other refusal
    is valid JSON Schema that the grammar engine does not compile."""
    validator = jsonschema.validators.validator_for(schema)
    if expected == "not a valid json schema":
        with pytest.raises(jsonschema.SchemaError):
            validator.check_schema(schema)
    else:
        validator.check_schema(schema)
