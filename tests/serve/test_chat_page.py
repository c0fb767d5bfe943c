"""The chat page in a real headless Chromium: it takes the token from the URL fragment, a message is
typed and sent, and the answer shows up piece by piece (the DOM is watched while it streams), with
its tokens/s; a screenshot is taken.

Why the DevTools protocol and not `--dump-dom`: `--virtual-time-budget` runs out while a streamed
response body is still arriving (a pending body read does not hold virtual time), so the dump shows
an empty answer. Driving a real-time Chromium over its DevTools websocket (aiohttp's client, already
installed with Ray) also lets the test see the text grow.
"""

from __future__ import annotations

import asyncio
import base64
import html
import json
import re
import subprocess
import time

import httpx
import pytest

from helpers import CHROMIUM, require_chromium
from servehelpers import free_port

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="session", autouse=True)
def chromium() -> str:
    """At test time, not a module-level skipif: under CI (CI=true) a missing browser fails (helpers.require).
    Session scope: checked before the session's `server` starts."""
    return require_chromium()


QUESTION, FOLLOW_UP = "What is 2 + 3?", "And 4 + 4?"


def type_and_send(text: str) -> str:
    return (f"document.getElementById('prompt').value = {json.dumps(text)};"
            "document.getElementById('send').click(); true")


def answer(n: int) -> str:
    """[state, text] of the n-th assistant message, or null."""
    return (f"(function () {{ var a = document.querySelectorAll('.msg.assistant')[{n}];"
            "return a ? [a.getAttribute('data-state'), a.firstChild ? a.firstChild.textContent : ''] : null; })()")


class DevTools:
    """The few DevTools calls the test needs, on one page's websocket."""

    def __init__(self, ws):
        self.ws, self.n = ws, 0

    async def call(self, method: str, **params):
        self.n += 1
        await self.ws.send_str(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads((await self.ws.receive(timeout=60)).data)
            if msg.get("id") == self.n:
                assert "error" not in msg, msg
                return msg["result"]

    async def eval(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = await self.eval(expression)
            if value:
                return value
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out waiting for {expression}")


def page_socket(port: int, deadline: float) -> str:
    while time.time() < deadline:
        try:
            pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json() if t["type"] == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError("Chromium's DevTools did not come up")


async def chat_in_browser(ws_url: str, shot_path) -> tuple[list[str], str, str, str]:
    """Send QUESTION; return the answer's texts as seen while streaming, the final DOM, the stats line,
    and the answer to FOLLOW_UP (sent after it, in the same conversation)."""
    import aiohttp

    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
        dt = DevTools(ws)
        await dt.wait_for("document.body.getAttribute('data-ready') === '1'")
        await dt.eval(type_and_send(QUESTION))
        seen: list[str] = []
        deadline = time.time() + 60
        while time.time() < deadline:
            state = await dt.eval(answer(0))
            if state and (not seen or state[1] != seen[-1]):
                seen.append(state[1])
            if state and state[0] != "streaming":
                break
            await asyncio.sleep(0.005)
        dom = await dt.eval("document.documentElement.outerHTML")
        stats = await dt.eval("document.querySelector('.msg.assistant .stats').textContent")
        await dt.eval(type_and_send(FOLLOW_UP))
        second = await dt.wait_for(f"(function () {{ var s = {answer(1)}; return s && s[0] === 'done' ? s[1] : null; }})()")
        shot = await dt.call("Page.captureScreenshot", format="png")
        shot_path.write_bytes(base64.b64decode(shot["data"]))
        return seen, dom, stats, second


def test_chat_page_streams_an_answer(server, tmp_path):
    client = server.client()
    expected = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": QUESTION}],
                                              temperature=0, max_tokens=64).choices[0].message.content
    port = free_port()
    browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                "--disable-component-update", "--disable-sync", "--no-first-run",
                                f"--user-data-dir={tmp_path / 'profile'}", f"--remote-debugging-port={port}",
                                "--window-size=1000,700", f"{server.base}/chat#token={server.token}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ws_url = page_socket(port, time.time() + 60)
        shot = tmp_path / "chat.png"
        seen, dom, stats, second = asyncio.run(chat_in_browser(ws_url, shot))
    finally:
        browser.terminate()
        browser.wait(timeout=30)
    assert f'<div class="msg user">{html.escape(QUESTION, quote=False)}</div>' in dom
    assert 'data-state="done"' in dom, dom[-3000:]
    assert seen[-1] == expected  # the answer the API gives, in the page
    partial = [s for s in seen if s and s != expected]
    assert partial and all(expected.startswith(s) for s in partial), seen  # it grew piece by piece
    chunks = int(re.search(r'data-chunks="(\d+)"', dom).group(1))
    assert chunks > 1
    assert re.fullmatch(r"\d+ tokens, [\d.]+ tokens/s", stats) and not stats.startswith("0 ")
    assert server.token not in dom  # the fragment was dropped from the address bar, the token not written anywhere
    assert shot.exists() and shot.stat().st_size > 5000
    # the page keeps the conversation: the follow-up was sent with the first exchange before it
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": expected},
                    {"role": "user", "content": FOLLOW_UP}]
    assert second == client.chat.completions.create(model=server.model, messages=conversation, temperature=0,
                                                    max_tokens=64).choices[0].message.content


def test_the_chat_page_runs_only_its_own_script_and_cannot_be_framed(server):
    """The shell's headers (`http_limits.page_headers`): its one inline script allowed by its hash, nothing
    else; the streaming test above proves the page still works under that policy."""
    import base64
    import hashlib
    import urllib.request

    with urllib.request.urlopen(f"{server.base}/chat", timeout=30) as resp:
        body, csp = resp.read().decode(), resp.headers["Content-Security-Policy"]
        assert resp.headers["X-Frame-Options"] == "DENY" and resp.headers["Referrer-Policy"] == "no-referrer"
    script = re.search(r"<script>(.*?)</script>", body, flags=re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'self' 'sha256-{digest}';" in csp and "frame-ancestors 'none'" in csp, csp
    assert "unsafe-inline" not in csp.split("script-src", 1)[1].split(";", 1)[0]


def test_chat_page_without_a_token_asks_for_it(server, tmp_path):
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'p'}",
           "--virtual-time-budget=5000", "--dump-dom", f"{server.base}/chat"]
    bare = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    assert 'id="login" style="display: block;"' in bare and 'class="msg' not in bare
