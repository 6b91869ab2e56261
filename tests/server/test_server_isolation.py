"""cache_salt and tenant isolation: what may and may not share prefix-cache blocks; API keys."""

from __future__ import annotations

import json
import uuid

import openai
import pytest

from prefixserve.core.kv_cache.salts import derive_cache_salt, validate_cache_salt
from prefixserve.entrypoints.server.auth import ApiKeys, parse_bearer, read_api_key_file
from tests.helpers.server import KEY_ALPHA, KEY_ALPHA_2, KEY_BETA, MODEL_NAME

SHARED_TEXT = (
    " is a prompt long enough to fill a few KV-cache blocks, so that a second request with "
    "the same words would find them in the prefix cache if it were allowed to."
)


def unique_prompt() -> str:
    # A fresh prefix per test, so nothing earlier in the session can have cached it.
    return f"Request {uuid.uuid4().hex}" + SHARED_TEXT


def cached_tokens(client: openai.OpenAI, prompt: str, **extra_body) -> int:
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra_body or None
    )
    return response.usage.prompt_tokens_details.cached_tokens


# ------------------------------------------------------------------------------ cache_salt
def test_same_cache_salt_shares_blocks_and_a_different_one_does_not(server):
    client = server.client()
    prompt = unique_prompt()
    assert cached_tokens(client, prompt, cache_salt="team-1") == 0
    assert cached_tokens(client, prompt, cache_salt="team-1") > 0
    assert cached_tokens(client, prompt, cache_salt="team-2") == 0
    assert cached_tokens(client, prompt) == 0  # no salt is its own namespace too


def test_without_keys_the_client_salt_subdivides_the_open_namespace(open_server):
    client = open_server.client()
    prompt = unique_prompt()
    assert cached_tokens(client, prompt) == 0
    assert cached_tokens(client, prompt) > 0
    assert cached_tokens(client, prompt, cache_salt="s") == 0
    assert cached_tokens(client, prompt, cache_salt="s") > 0


def test_a_keyless_client_cannot_forge_a_tenant_salt_on_a_shared_cache(server, open_server):
    # The two servers share one engine: a stronger sharing than a disk store both open.
    alpha, anyone = server.client(api_key=KEY_ALPHA), open_server.client()
    prompt = unique_prompt()
    assert cached_tokens(alpha, prompt) == 0
    forged = derive_cache_salt("alpha", None)
    assert cached_tokens(anyone, prompt, cache_salt=forged) == 0
    assert cached_tokens(anyone, prompt) == 0
    # ... nor can a tenant reach a keyless client's namespace.
    assert cached_tokens(anyone, prompt, cache_salt="open") == 0
    assert cached_tokens(alpha, prompt, cache_salt=derive_cache_salt(None, "open")) == 0
    assert cached_tokens(alpha, prompt) > 0


# --------------------------------------------------------------------------------- tenants
def test_another_tenant_never_hits_whatever_salt_it_sends(server):
    alpha, alpha_2, beta = (server.client(api_key=k) for k in (KEY_ALPHA, KEY_ALPHA_2, KEY_BETA))
    prompt = unique_prompt()
    assert cached_tokens(alpha, prompt) == 0
    # Another key of the same tenant shares its namespace ...
    assert cached_tokens(alpha_2, prompt) > 0
    # ... another tenant does not, with no salt or with any salt it could guess.
    assert cached_tokens(beta, prompt) == 0
    for salt in ("alpha", '["prefixserve.tenant.v1","alpha",null]', "null", "default"):
        assert cached_tokens(beta, prompt, cache_salt=salt) == 0
    # The tenant's own cached blocks are still there.
    assert cached_tokens(alpha, prompt) > 0


def test_a_tenant_salt_subdivides_only_its_own_namespace(server):
    alpha, beta = server.client(api_key=KEY_ALPHA), server.client(api_key=KEY_BETA)
    prompt = unique_prompt()
    assert cached_tokens(alpha, prompt, cache_salt="shared-salt") == 0
    assert cached_tokens(beta, prompt, cache_salt="shared-salt") == 0
    assert cached_tokens(beta, prompt, cache_salt="shared-salt") > 0
    assert cached_tokens(alpha, prompt, cache_salt="shared-salt") > 0


def test_tenant_isolation_holds_for_chat_too(server):
    alpha, beta = server.client(api_key=KEY_ALPHA), server.client(api_key=KEY_BETA)
    messages = [{"role": "system", "content": unique_prompt()}, {"role": "user", "content": "ok"}]

    def chat_cached(client):
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=1, temperature=0
        )
        return response.usage.prompt_tokens_details.cached_tokens

    assert chat_cached(alpha) == 0
    assert chat_cached(beta) == 0
    assert chat_cached(alpha) > 0


# ------------------------------------------------------------------------------------ keys
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-key"},
        {"Authorization": KEY_ALPHA},
        {"Authorization": "Basic " + KEY_ALPHA},
        {"Authorization": "Bearer"},
    ],
    ids=["missing", "wrong", "no-scheme", "basic", "empty-bearer"],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/metrics"),
        ("POST", "/reset_prefix_cache"),
    ],
)
def test_a_request_without_a_valid_key_gets_401(server, headers, method, path):
    import httpx

    body = {"model": MODEL_NAME, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    response = httpx.request(method, server.url + path, headers=headers, json=body, timeout=60)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key"


def test_an_unauthenticated_bad_body_is_still_a_401(server):
    import httpx

    response = httpx.post(server.url + "/v1/completions", content=b"{broken", timeout=60)
    assert response.status_code == 401


def test_the_openai_client_sees_an_authentication_error(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="sk-nobody").models.list()


# ---------------------------------------------------------------------- salt derivation unit
def test_derived_salts_differ_for_every_distinct_tenant_and_salt_pair():
    pairs = [
        ("a", None),
        ("a", "b"),
        ("ab", None),
        ("a", "bc"),
        ("ab", "c"),
        ("a,b", None),
        ("a", ",b"),
        ('a"', None),
        ("a", '"'),
        ("b", "a"),
        ("a", "null"),
        ("a", ""),
    ]
    salts = [derive_cache_salt(t, s) for t, s in pairs]
    assert len(set(salts)) == len(pairs)
    # Reversible: the encoding is JSON, so the pair can be read back.
    for (tenant, salt), derived in zip(pairs, salts, strict=True):
        assert json.loads(derived)[1:] == [tenant, salt]


def test_without_a_tenant_the_client_salt_lives_in_the_open_namespace():
    assert derive_cache_salt(None, None) is None
    assert json.loads(derive_cache_salt(None, "x")) == ["prefixserve.open.v1", "x"]


def test_no_keyless_client_salt_can_be_forged_into_a_tenant_namespace():
    tenant_salt = derive_cache_salt("tenant-a", None)
    # A keyless client sending tenant-a's derived salt gets it wrapped again, not tenant-a's.
    assert derive_cache_salt(None, tenant_salt) != tenant_salt
    assert derive_cache_salt(None, tenant_salt) not in {derive_cache_salt(t, None) for t in "ab"}


def test_a_tenant_without_a_salt_still_gets_its_own_namespace():
    assert derive_cache_salt("t", None) not in (None, "t", derive_cache_salt("u", None))


@pytest.mark.parametrize("bad", ["", "x" * 257, 5])
def test_validate_cache_salt_rejects_empty_oversize_and_non_strings(bad):
    with pytest.raises(ValueError, match="cache_salt"):
        validate_cache_salt(bad)


def test_validate_cache_salt_accepts_none_and_up_to_256_chars():
    validate_cache_salt(None)
    validate_cache_salt("x" * 256)


def test_api_key_file_maps_keys_to_tenants(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\nk1 acme\n\nk2   acme\nk3 globex\n")
    assert read_api_key_file(path) == [("k1", "acme"), ("k2", "acme"), ("k3", "globex")]
    keys = ApiKeys.from_options(api_key="solo", api_key_file=path)
    assert keys.tenant_for("k2") == "acme"
    assert keys.tenant_for("k3") == "globex"
    assert keys.tenant_for("solo") == "default"
    assert keys.tenant_for("k4") is None
    assert keys.tenants == {"acme", "globex", "default"}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("k1\n", "two words"),
        ("k1 a b\n", "two words"),
        ("k1 a\nk1 b\n", "twice"),
        ("# only\n", "no keys"),
    ],
)
def test_a_bad_api_key_file_is_an_error_naming_the_problem(tmp_path, text, match):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        ApiKeys.from_options(api_key_file=path)


def test_no_key_options_means_no_auth():
    assert ApiKeys.from_options() is None


def test_parse_bearer():
    assert parse_bearer("Bearer abc") == "abc"
    assert parse_bearer("bearer  abc ") == "abc"
    assert parse_bearer("Basic abc") is None
    assert parse_bearer(None) is None
    assert parse_bearer("Bearer") is None
