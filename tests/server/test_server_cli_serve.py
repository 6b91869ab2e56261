"""`prefixserve serve` as a user runs it: a subprocess on a free port, its logs, a request."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx

from tests.helpers import free_port


def test_prefixserve_serve_starts_logs_its_setup_and_answers(tmp_path):
    from prefixserve.model.loader.default_model import ensure_default_model

    model_path = str(ensure_default_model())  # served from a path, which no client may see
    port = free_port()
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-one acme\n")
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefixserve.cli",
                "serve",
                model_path,
                "--port",
                str(port),
                "--num-kv-blocks",
                "64",
                "--max-model-len",
                "512",
                "--block-size",
                "16",
                "--api-key-file",
                str(keys),
                "--served-model-name",
                "smol",
                "--timeout-request-headers",
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        headers = {"Authorization": "Bearer sk-one"}
        response = httpx.post(
            f"{url}/v1/completions",
            headers=headers,
            json={"model": "smol", "prompt": "Hello", "max_tokens": 3},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
        assert [(m["id"], m["root"]) for m in models.json()["data"]] == [("smol", "smol")]
        assert model_path not in models.text
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Half: ")
            data = b""
            while chunk := sock.recv(4096):  # closed after 1 s (the socket's timeout: 10 s)
                data += chunk
            assert data.startswith(b"HTTP/1.1 408 "), data
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text()
    assert "dtype bfloat16" in text
    assert "block size 16" in text
    assert "pool 64 blocks = 1024 tokens" in text
    assert "prefix caching: on" in text
    assert "1 tenant(s)" in text
