"""Start a real `smolforge serve` process: a model dir, a token file, a free port, one torch thread
(CI machines here have two cores). A uniquely named module, so tests import it without clashing
with tests/conftest.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    token: str
    model: str
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=self.token, max_retries=0, timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def embedded_env(home: Path, ray_tmp: Path) -> dict[str, str]:
    """The environment of `smolforge serve --stages N` on an embedded cluster of its own: its own home
    and Ray temp dir, and no coordinator, token or Ray address inherited from the caller's."""
    env = {**os.environ, "SMOLFORGE_HOME": str(home), "RAY_TMPDIR": str(ray_tmp), "RAY_USAGE_STATS_ENABLED": "0"}
    for k in ("SMOLFORGE_TOKEN", "SMOLFORGE_COORDINATOR", "RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(k, None)
    return env


def start_server(tmp: Path, model_dir: Path, token: str = "serve-test-token-123", extra: tuple[str, ...] = ()) -> Server:
    token_file = tmp / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    port = free_port()
    log = tmp / "serve.log"
    env = {**os.environ, "SMOLFORGE_HOME": str(tmp / "home")}
    env.pop("SMOLFORGE_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "smolforge.cli.main", "serve", "--model", str(model_dir),
                             "--model-name", "tiny", "--port", str(port), "--token-file", str(token_file),
                             "--num-threads", "1", "--device", "cpu", *extra],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 90
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"smolforge serve did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    return Server(proc, port, token, "tiny", log)


