"""schemathesis against serve's own OpenAPI description (`GET /openapi.json`, with the token), in-process
over ASGI with the tiny model: valid and invalid requests generated from the schema, with a fixed
seed. Checked on every answer: no 5xx, a status and a media type the schema documents, a body (or
each server-sent event) that fits its schema. Afterwards the engine still runs, has never restarted,
and answers a normal request. The CI tier runs a bounded number of examples; `soak` many more.

The engine's context is cut short (`max_positions`) so that no generated request can ask for more
than a few dozen tokens: the fuzzer's time goes to requests, not to decoding."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(1800)

TOKEN = "fuzz-token-28"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def fuzz_serve(served, examples: int, context: int) -> dict[tuple[str, int], int]:
    """Run schemathesis for `examples` cases; the (operation, status) counts seen."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    from smolforge.serve.api import create_app
    from smolforge.serve.engine import Engine

    engine = Engine(served, max_positions=context).start()
    app = create_app(served, engine, token=TOKEN, model_name="tiny")
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)
    modes = schemathesis.GenerationMode
    cases = schema.as_strategy(modes.POSITIVE, headers=AUTH) | schema.as_strategy(modes.NEGATIVE, headers=AUTH)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    seen: dict[tuple[str, int], int] = {}

    @seed(28)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=cases)
    def one(case) -> None:
        response = case.call_and_validate(headers=AUTH, timeout=120, checks=checks)
        key = (case.operation.label, response.status_code)
        seen[key] = seen.get(key, 0) + 1

    try:
        one()
        from starlette.testclient import TestClient

        with TestClient(app) as client:
            health = client.get("/health").json()
            normal = client.post("/v1/chat/completions", headers=AUTH, json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert health["ok"] and health["engine"] == "running" and health["restarts"] == 0, health
        assert normal.status_code == 200, normal.text
        assert engine.alive and engine.restarts == 0
    finally:
        engine.stop()
        app.state.lanes.close()
    return seen


def test_schemathesis_finds_no_5xx_and_no_answer_outside_the_schema(served_tiny):
    seen = fuzz_serve(served_tiny, examples=200, context=64)
    # the run reached the engine and the refusals, not only one of them
    assert any(op.startswith("POST") and status == 200 for op, status in seen)
    assert any(op.startswith("POST") and status == 400 for op, status in seen)


@pytest.mark.soak
def test_schemathesis_soak(served_tiny):
    seen = fuzz_serve(served_tiny, examples=1500, context=128)
    print("\nschemathesis soak:", sorted(seen.items()))
    assert sum(seen.values()) >= 1000
