"""The gate's refusal of a request without the token, in process (the real `Gate`, a recording ASGI
receive): a small declared body is read and dropped before the 401, so that closing the connection
does not reset it under a client that has not yet read the answer (seen once on a loaded machine as
"connection reset by peer" in tests/serve/test_hostile.py); a big, undeclared or chunked one is never
read at all (auth before bytes: tests/cluster/test_gate.py proves the memory side on a real server)."""

from __future__ import annotations

import asyncio

import pytest

from smolforge.gate import DRAIN_MAX, Gate


def refuse(content_length: int | None, chunks: list[bytes]) -> tuple[int, int]:
    """(status answered, body messages the gate read) for a POST without the token."""
    reads, sent = [], []
    queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        reads.append(1)
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):  # never reached without the token
        raise AssertionError("the app ran")

    headers = [(b"content-length", str(content_length).encode())] if content_length is not None else []
    gate = Gate(app, token=lambda: "secret", open_paths=(), max_body=10**6)
    asyncio.run(gate({"type": "http", "path": "/v1/chat/completions", "headers": headers}, receive, send))
    return sent[0]["status"], len(reads)


@pytest.mark.parametrize("length, chunks, read", [
    (100, [b"x" * 100], 1),                                 # small: read and dropped
    (DRAIN_MAX, [b"x" * (DRAIN_MAX // 2)] * 2, 2),          # at the bound, in two messages
    (DRAIN_MAX + 1, [b"x" * (DRAIN_MAX + 1)], 0),           # over it: never read
    (300 * 2**20, [b"x" * 1024], 0),                        # a 300 MiB declaration: never read
    (None, [b"x" * 100], 0),                                # chunked (no length): never read
])
def test_a_refused_small_body_is_drained_and_a_big_one_never_read(length, chunks, read):
    assert refuse(length, chunks) == (401, read)
