"""The `serve` job kind on a real cluster (a coordinator and two workers holding tiny-copy, each a
separate process): the official `openai` client gets a streamed chat completion through a 2-stage
serve job, authenticated with the cluster token; `job cancel` stops the API and every stage."""

from __future__ import annotations

import shutil
import socket
import time

import pytest

from localcluster import LocalCluster, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from smolforge.models.tiny import preset_dir

    base = tmp_path_factory.mktemp("serve-job")
    models = base / "models"
    shutil.copytree(preset_dir("tiny-llama"), models / "tiny-copy")
    cluster = LocalCluster(base)
    try:
        cluster.start_coordinator()
        cluster.add_workers(["w1", "w2"], models_dir=models)
        cluster.wait_nodes(["coordinator", "w1", "w2"])
        yield {"c": cluster, "base": base}
    finally:
        cluster.close()


def wait_event(client, job_id: str, kind: str, timeout: float) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for e in client.job_events(job_id):
            if e["kind"] == kind:
                return e
        st = client.get_job_status(job_id)
        if st["state"] in ("failed", "cancelled", "completed"):
            raise AssertionError(f"job {job_id} {st['state']}: {st.get('error')}\n" + timeline(client, job_id))
        time.sleep(0.3)
    raise AssertionError(f"no {kind} event after {timeout} s\n" + timeline(client, job_id))


def timeline(client, job_id) -> str:
    return "\n".join(f"{e['ts']:.2f} {e['kind']}: {e['message']}" for e in client.job_events(job_id))


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_openai_client_streams_a_chat_through_a_two_stage_serve_job(world):
    """Submitted with `smolforge serve --stages 2` (coordinator found through $SMOLFORGE_COORDINATOR)."""
    import openai

    c = world["c"]
    client = c.client()
    port = free_port()
    # `smolforge serve --stages 2` against the coordinator: it submits the job and returns once it serves
    r = c.cli("serve", "--model", "tiny-copy", "--stages", "2", "--port", str(port), "--model-name", "tiny",
              timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stderr.split("submitted ", 1)[1].split()[0]
    url = wait_event(client, job_id, "serving", 30)["data"]["url"]
    assert url == f"http://127.0.0.1:{port}" and f"on {url}" in r.stdout
    assert f"smolforge job cancel {job_id}" in r.stdout
    assert c.token not in r.stdout + r.stderr
    stages = [e["message"] for e in client.job_events(job_id) if e["kind"] == "stage"]
    assert len(stages) == 2 and {s.split(" on ")[-1] for s in stages} == {"w1", "w2"}, stages

    api = openai.OpenAI(base_url=f"{url}/v1", api_key=c.token, max_retries=0, timeout=60)
    stream = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                         max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert text  # the tiny model says something
    # the same request again, not streamed: the same greedy text
    again = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                        max_tokens=16, temperature=0)
    assert again.choices[0].message.content == text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="x" * 32, max_retries=0, timeout=30).models.list()

    r = c.cli("job", "cancel", job_id)
    assert r.returncode == 0, r.stdout + r.stderr
    deadline = time.time() + 60
    while time.time() < deadline and (client.get_job_status(job_id)["state"] != "cancelled" or port_open(port)):
        time.sleep(0.3)
    assert client.get_job_status(job_id)["state"] == "cancelled"
    assert not port_open(port)
