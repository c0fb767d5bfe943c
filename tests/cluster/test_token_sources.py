"""Where a command finds the cluster token (--token, --token-file, the environment, the local
coordinator's state dir), and `Client()` with no arguments finding the local coordinator."""

from __future__ import annotations

import json

import pytest

from smolforge.auth import read_token_file, resolve_token
from smolforge.errors import SmolforgeError


@pytest.fixture
def no_token_env(monkeypatch):
    for k in ("SMOLFORGE_TOKEN", "SMOLFORGE_TOKEN_FILE", "SMOLFORGE_COORDINATOR"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_the_first_source_wins_in_the_documented_order(tmp_path, no_token_env):
    (tmp_path / "flag").write_text("from-flag\n")
    (tmp_path / "envfile").write_text("from-env-file")
    state = tmp_path / "state"
    state.mkdir()
    (state / "token").write_text("from-state-dir")
    assert resolve_token(None, None, state) == "from-state-dir"
    no_token_env.setenv("SMOLFORGE_TOKEN_FILE", str(tmp_path / "envfile"))
    assert resolve_token(None, None, state) == "from-env-file"
    no_token_env.setenv("SMOLFORGE_TOKEN", "from-env")
    assert resolve_token(None, None, state) == "from-env"
    assert resolve_token(None, tmp_path / "flag", state) == "from-flag"
    assert resolve_token("from-argv", tmp_path / "flag", state) == "from-argv"


def test_no_source_is_none_and_a_bad_file_is_one_message(tmp_path, no_token_env):
    assert resolve_token(None, None, tmp_path) is None
    with pytest.raises(SmolforgeError, match="cannot read the token file") as err:
        read_token_file(tmp_path / "missing")
    assert str(tmp_path / "missing") in err.value.render()
    (tmp_path / "blank").write_text("  \n")
    with pytest.raises(SmolforgeError, match="empty"):
        read_token_file(tmp_path / "blank")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SmolforgeError, match="not text"):
        read_token_file(tmp_path / "binary")


def test_client_with_no_arguments_finds_the_local_coordinator(tmp_path, no_token_env):
    from smolforge.client import Client

    no_token_env.setenv("SMOLFORGE_HOME", str(tmp_path))
    (tmp_path / "coordinator.json").write_text(json.dumps({"host_for_clients": "127.0.0.9", "port": 5123}))
    (tmp_path / "token").write_text("local-token")
    with Client() as c:
        assert (c.host, c.port, c.token) == ("127.0.0.9", 5123, "local-token")
    with Client("10.0.0.5:6000", token_file=tmp_path / "token") as c:
        assert (c.host, c.port, c.token) == ("10.0.0.5", 6000, "local-token")


def test_an_https_address_without_a_pin_is_refused_not_downgraded(no_token_env):
    from smolforge.client import Client

    no_token_env.delenv("SMOLFORGE_TLS_FINGERPRINT", raising=False)
    with pytest.raises(SmolforgeError, match="needs the coordinator's certificate fingerprint"):
        Client("https://10.0.0.5:5000", token="t")
