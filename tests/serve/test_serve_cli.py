"""`smolforge serve` on the command line: help with an example, one-line errors (exit 2) for a bad model,
adapter, port or token file, and a made token that is written 0600 and never printed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from types import SimpleNamespace

import httpx
import pytest

from servehelpers import free_port, front_of, gone, until

pytestmark = pytest.mark.timeout(300)


def smolforge(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "smolforge.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_help_has_an_example():
    out = smolforge("serve", "--help")
    assert out.returncode == 0 and "Example: smolforge serve --model" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model"], "model directory /nonexistent/model does not exist"),
    (["--adapter", "/nonexistent/adapter"], "adapter directory /nonexistent/adapter does not exist"),
    (["--token-file", "/nonexistent/token"], "cannot read the token file"),
    (["--max-batch", "0"], "--max-batch must be at least 1"),
    (["--port", "-1"], "--port -1 is not a port"),
    (["--port", "70000"], "--port 70000 is not a port"),
])
def test_bad_input_is_one_message_and_exit_2(model_copy, args, message):
    full = ["serve", "--model", str(model_copy), "--port", "0", *args] if args[0] != "--model" else ["serve", *args]
    out = smolforge(*full)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr + out.stdout
    assert "fix:" in out.stderr


def test_a_busy_port_is_one_message(model_copy):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        out = smolforge("serve", "--model", str(model_copy), "--port", str(s.getsockname()[1]), "--num-threads", "1")
    assert out.returncode == 2 and "cannot listen on 127.0.0.1" in out.stderr and "Traceback" not in out.stderr


def test_a_made_token_is_written_0600_and_only_its_path_printed(model_copy, tmp_path):
    port = free_port()
    env = {**os.environ, "SMOLFORGE_HOME": str(tmp_path)}
    env.pop("SMOLFORGE_TOKEN", None)
    env.pop("SMOLFORGE_TOKEN_FILE", None)
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "smolforge.cli.main", "serve", "--model", str(model_copy), "--port",
                             str(port), "--num-threads", "1", "--device", "cpu"], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 90
        while "chat page" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.3)
        token_file = tmp_path / "serve" / "token"
        token = token_file.read_text().strip()
        assert token_file.stat().st_mode & 0o777 == 0o600
        text = log.read_text()
        assert str(token_file) in text and token not in text
        assert f"http://127.0.0.1:{port}/v1" in text and f"http://127.0.0.1:{port}/chat#token=<token>" in text
        deadline = time.time() + 30
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {token}"})
                break
            except httpx.HTTPError:
                assert time.time() < deadline
                time.sleep(0.3)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == str(model_copy)
        front = front_of(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert token not in log.read_text()
    assert proc.returncode == 0 and until(lambda: gone(front), "the HTTP front's exit")  # SIGTERM ends both


def test_serve_with_an_adapter_answers_as_the_adapted_model(model_copy, tmp_path):
    """`--adapter` (what `smolforge train` writes): the server answers with the adapter's tokens."""
    import torch
    from peft import LoraConfig, get_peft_model

    from servehelpers import start_server
    from smolforge.models.loading import load_model
    from smolforge.serve.engine import Engine
    from smolforge.serve.model import ServedModel
    from smolforge.serve.sampling import SamplingParams

    torch.manual_seed(1)
    lora = get_peft_model(load_model(str(model_copy)), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                  init_lora_weights=False))
    lora.save_pretrained(tmp_path / "lora_adapter")
    local = ServedModel.load(str(model_copy), str(tmp_path / "lora_adapter"), device="cpu")
    plain = ServedModel.load(str(model_copy), device="cpu")
    ids = local.tokenizer("the of and to")["input_ids"]
    greedy = SamplingParams(max_tokens=12, temperature=0)
    engine, base = Engine(local).start(), Engine(plain).start()
    try:
        expected, unadapted = engine.generate(ids, greedy, timeout=60).text, base.generate(ids, greedy, timeout=60).text
    finally:
        engine.stop()
        base.stop()
    assert expected != unadapted
    srv = start_server(tmp_path, model_copy, extra=("--adapter", str(tmp_path / "lora_adapter")))
    try:
        got = srv.client().completions.create(model=srv.model, prompt="the of and to", temperature=0, max_tokens=12)
        assert got.choices[0].text == expected
    finally:
        srv.proc.terminate()
        srv.proc.wait(timeout=30)


@pytest.mark.parametrize("source", ["$SMOLFORGE_TOKEN", "--token-file"])
def test_serve_and_staged_serve_take_the_same_token(tmp_path, monkeypatch, source):
    """One rule (issue 28): `serve` and `serve --stages` on the embedded cluster take the token from
    --token-file, else $SMOLFORGE_TOKEN; the staged API reads it from a 0600 file the CLI names to the
    job's runner. With none given, one-process serve makes its own and the staged one keeps the
    embedded cluster's."""
    from smolforge.cli.serve import _embedded_api_token
    from smolforge.serve.server import ServeOptions, given_token, server_token

    for name in ("SMOLFORGE_TOKEN", "SMOLFORGE_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    token, token_file = f"token-from-{source.strip('-$').lower()}", None
    if source == "$SMOLFORGE_TOKEN":
        monkeypatch.setenv("SMOLFORGE_TOKEN", token)
    else:
        token_file = tmp_path / "given"
        token_file.write_text(token + "\n")
        token_file = str(token_file)
    assert server_token(ServeOptions(model="m", token_file=token_file, state_dir=str(tmp_path / "serve"))) == (token, None)
    backend = SimpleNamespace(state=SimpleNamespace(root=tmp_path / "embedded"), manager=SimpleNamespace())
    path = _embedded_api_token(backend, given_token(token_file))
    assert path.read_text() == token and path.stat().st_mode & 0o777 == 0o600
    assert backend.manager.serve_token_file == str(path)

    for name in ("SMOLFORGE_TOKEN", "SMOLFORGE_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    made, where = server_token(ServeOptions(model="m", state_dir=str(tmp_path / "serve")))
    assert where == tmp_path / "serve" / "token" and made != token
    assert _embedded_api_token(backend, given_token(None)) is None
