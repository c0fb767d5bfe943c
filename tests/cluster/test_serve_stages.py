"""Staged serving on a real multi-node Ray cluster on one machine: stage actors on the nodes that hold
the model give the single-process tokens; a stage actor SIGKILLed during a streamed generation ends
that request with an error, and the next request runs on a re-placed stage.

The nodes are `ray start --block` processes (our own children, stopped by PID, never `ray stop`):
    head  1 CPU, the coordinator's role, holds no model
    w1    1 CPU, holds tiny-copy
    w2    1 CPU, holds tiny-copy
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from smolforge.pipeline.serve.batch import DoneEvent, ErrorEvent, TokenEvent
from smolforge.pipeline.serve.engine import Engine
from smolforge.pipeline.serve.model import ServedModel
from smolforge.pipeline.serve.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "tiny-copy"


def _spawn(base: Path, models: Path, procs: list):
    from smolforge.cluster import ray_glue
    from smolforge.cluster.auth import write_token
    from smolforge.cluster.ray_process import head_command, spawn, stop, wait_for_port, worker_command
    from smolforge.cluster.statedir import free_port

    tmp = Path(tempfile.mkdtemp(prefix="sfs", dir="/tmp"))  # short: Ray socket paths
    token_path = base / "token"
    write_token(token_path, os.urandom(16).hex())
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path), "RAY_TMPDIR": str(tmp),
           "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "RAY_raylet_start_wait_time_s": "120"}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    head = head_command(port, cpus=1, node_ip="127.0.0.1", name="head", resources={ray_glue.HEAD_RESOURCE: 1000},
                        labels={ray_glue.NAME_LABEL: "head", ray_glue.ROLE_LABEL: "coordinator"}, temp_dir=str(tmp),
                        object_store_mb=100)
    procs.append(spawn(head, env, base / "head.log", die_with_parent=True))
    wait_for_port("127.0.0.1", port, procs[0], 120, base / "head.log")
    handle = ray_glue.connect(f"127.0.0.1:{port}", state_dir=base / "driver", token=token_path.read_text())
    paths = json.dumps({MODEL: str(models / MODEL)})
    for name in ("w1", "w2"):
        res = {ray_glue.WORKER_RESOURCE: 1.0, ray_glue.model_resource(MODEL): ray_glue.MODEL_AMOUNT}
        cmd = worker_command(f"127.0.0.1:{port}", cpus=1, gpus=0, node_ip="127.0.0.1", name=name, resources=res,
                             labels={ray_glue.NAME_LABEL: name, ray_glue.ROLE_LABEL: "worker",
                                     ray_glue.GPUS_LABEL: "0"}, temp_dir=str(tmp), object_store_mb=100)
        for attempt in range(2):
            proc = spawn(cmd, {**env, "SMOLFORGE_MODEL_PATHS": paths}, base / f"{name}-{attempt}.log",
                         die_with_parent=True)
            procs.append(proc)
            deadline = time.time() + 150
            while time.time() < deadline and proc.poll() is None:
                if any(n.name == name for n in handle.nodes()):
                    break
                time.sleep(0.5)
            if any(n.name == name for n in handle.nodes()):
                break
            stop(proc)
        else:
            raise AssertionError(f"node {name} did not join; see {base}/{name}-*.log")
    return handle, tmp


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from smolforge.cluster.ray_process import stop
    from smolforge.models.tiny import preset_dir

    base = tmp_path_factory.mktemp("serve-stages")
    models = base / "models"
    shutil.copytree(preset_dir("tiny-llama"), models / MODEL)
    procs: list = []
    handle = tmp = None
    try:
        handle, tmp = _spawn(base, models, procs)
        single = ServedModel.load(str(models / MODEL), device="cpu")
        yield SimpleNamespace(handle=handle, base=base, single=single)
    finally:
        if handle is not None:
            handle.shutdown()
        for p in reversed(procs):
            stop(p)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def prompts(tok) -> list[list[int]]:
    texts = ["What is 2 + 3?", "Reverse abc", "the of and to in is you that it he was for on are as with his", "sum"]
    return [tok(t)["input_ids"] for t in texts]


def generate_all(model, ps, params) -> list[list[int]]:
    engine = Engine(model, max_batch=len(ps))
    from smolforge.pipeline.serve.batch import Request

    done: dict[int, DoneEvent] = {}
    reqs = [Request(p, params, (lambda i: lambda e: done.__setitem__(i, e) if not isinstance(e, TokenEvent) else None)(i))
            for i, p in enumerate(ps)]
    engine.run_batch(reqs)
    assert all(isinstance(done[i], DoneEvent) for i in range(len(ps))), done
    return [done[i].token_ids for i in range(len(ps))]


def test_two_stage_actors_give_the_single_process_tokens(cluster, tmp_path):
    from smolforge.cluster.serve_stages import StageGroup

    params = SamplingParams(max_tokens=20, temperature=0)
    ps = prompts(cluster.single.tokenizer)
    expected = generate_all(cluster.single, ps, params)
    group = StageGroup(MODEL, 2, step_timeout_s=20, load_timeout_s=120)
    try:
        model = group.start()
        where = group.describe()
        assert sorted(w["node"] for w in where) == ["w1", "w2"]  # one per node holding the model, not the head
        assert [w["layers"] for w in where] == [[0, 2], [2, 4]]
        assert model.eos_ids == cluster.single.eos_ids and model.max_positions == cluster.single.max_positions
        assert generate_all(model, ps, params) == expected
        assert all(h.info()["batches"] == 0 for h in group.handles)  # caches freed on every stage
    finally:
        group.close()

    # a LoRA adapter: its files travel to the stage actors through Ray, merged on each stage
    import torch
    from peft import LoraConfig, get_peft_model

    from smolforge.models.loading import load_model

    torch.manual_seed(1)
    path = cluster.base / "models" / MODEL
    peft_model = get_peft_model(load_model(str(path)), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                  target_modules=["q_proj", "v_proj", "down_proj"]))
    adapter = tmp_path / "lora_adapter"
    peft_model.save_pretrained(adapter)
    with_adapter = generate_all(ServedModel.load(str(path), str(adapter), device="cpu"), ps, params)
    assert with_adapter != expected
    group = StageGroup(MODEL, 2, adapter=str(adapter), step_timeout_s=20, load_timeout_s=120)
    try:
        assert generate_all(group.start(), ps, params) == with_adapter
    finally:
        group.close()


def test_a_killed_stage_fails_its_request_and_is_placed_again(cluster):
    from smolforge.cluster.serve_stages import StageGroup

    tok = cluster.single.tokenizer
    long = SamplingParams(max_tokens=200, temperature=0)
    # a prompt the model answers at length (no EOS early): the kill surely lands mid-generation
    ps = [p for p in prompts(tok) if len(generate_all(cluster.single, [p], long)[0]) >= 60]
    assert ps, "no prompt gives a long answer"
    prompt = ps[0]
    group = StageGroup(MODEL, 2, step_timeout_s=20, load_timeout_s=120)
    engine = None
    try:
        model = group.start()
        engine = Engine(model).start()
        victim = group.handles[1].where
        events: queue.Queue = queue.Queue()
        engine.submit(prompt, long, events.put)
        first = events.get(timeout=60)
        assert isinstance(first, TokenEvent), first
        os.kill(victim["pid"], signal.SIGKILL)  # the stage actor's process, on w1 or w2
        killed = time.monotonic()
        while True:
            event = events.get(timeout=30)
            if not isinstance(event, TokenEvent):
                break
        assert isinstance(event, ErrorEvent), event
        assert time.monotonic() - killed < 30
        assert "stage 1" in event.message

        again = engine.generate(prompt, SamplingParams(max_tokens=30, temperature=0), timeout=180)
        assert again.token_ids == generate_all(cluster.single, [prompt], SamplingParams(max_tokens=30, temperature=0))[0]
        now = group.describe()[1]
        assert now["replacements"] == 1 and now["running"] and now["pid"] != victim["pid"]
        assert now["node"] in ("w1", "w2")
        assert any("re-placed" in e for e in group.events)
    finally:
        if engine is not None:
            engine.stop()
        group.close()
