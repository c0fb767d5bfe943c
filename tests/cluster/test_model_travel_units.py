"""Models that travel (issue 31 item 2), in process: the piece protocol, the disk-space refusal and
where placement sends a job whose model only some nodes hold. The real multi-process proof is
tests/cluster/test_model_travel.py."""

from __future__ import annotations

import hashlib
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from smolforge.cluster.control.placement import requirements_for, travels, worker_bundles
from smolforge.cluster.control.specs import DataParallelJob
from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.nodes.discovery import scan_models_dir
from smolforge.cluster.nodes.model_fetch import (ModelFetcher, PieceReceiver, held_model_dir, model_manifest,
                                                 read_piece, space_refusal)
from smolforge.errors import SmolforgeError

PIECE = 4096


def sums(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def model(tmp_path) -> Path:
    """A model directory of a few files, one of them many pieces long."""
    src = tmp_path / "holder" / "org" / "m"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"model_type": "llama"}')
    (src / "model.safetensors").write_bytes(bytes(range(256)) * 70)  # 17920 bytes: 5 pieces
    (src / "sub" / "empty.txt").write_bytes(b"")
    return src


def send(receiver: PieceReceiver, src: Path, limit: int | None = None, damage: int | None = None) -> int:
    """Pieces from `src` into `receiver` as `ModelFetcher.fetch` sends them: each wanted piece, asked
    again when refused; `damage`: that piece (0-based, in sending order) goes out damaged once; `limit`:
    the link is cut after that many pieces are in. Returns how many pieces were sent (refused ones too)."""
    sent = written = 0
    for rel, index in receiver.wanted():
        while True:
            data = read_piece(src, rel, index, PIECE)
            if damage is not None and sent == damage:
                data = b"\x00" + data[1:] if data[:1] != b"\x00" else b"\x01" + data[1:]
            sent += 1
            if receiver.write(rel, index, data):
                break
        written += 1
        if limit is not None and written >= limit:
            return sent
    receiver.commit()
    return sent


def test_pieces_resume_after_a_cut_and_a_damaged_piece_is_refused_and_sent_again(model, tmp_path):
    manifest = model_manifest(model, PIECE)
    assert manifest["pieces"] == 5 + 1 + 1 and manifest["bytes"] == 17920 + 23
    dest_root = tmp_path / "worker-models"

    first = PieceReceiver(dest_root, "org/m", manifest)
    assert not first.complete()
    first.open()
    assert send(first, model, limit=3) == 3  # the link is cut after 3 pieces
    assert not (dest_root / "org" / "m").exists()  # nothing half-written at its final name
    assert scan_models_dir(dest_root) == {}  # a partial fetch is never advertised as a model

    again = PieceReceiver(dest_root, "org/m", manifest)  # a new process: only the journal and the files
    again.open()
    assert again.resumed == 3 and len(again.wanted()) == manifest["pieces"] - 3
    assert send(again, model, damage=1) == manifest["pieces"] - 3 + 1  # one piece refused, sent again
    assert again.refused == 1
    assert sums(dest_root / "org" / "m") == sums(model)  # checksums equal
    assert scan_models_dir(dest_root) == {"org/m": str((dest_root / "org" / "m").resolve())}
    assert not (dest_root / ".partial").exists() or not any((dest_root / ".partial").iterdir())

    hit = PieceReceiver(dest_root, "org/m", manifest)
    assert hit.complete()  # a second fetch sends nothing


def test_a_journal_of_another_version_or_damaged_pieces_is_not_trusted(model, tmp_path):
    manifest = model_manifest(model, PIECE)
    first = PieceReceiver(tmp_path / "w", "org/m", manifest)
    first.open()
    send(first, model, limit=4)
    written = sorted(first.done)
    rel, index = written[0]
    with open(first.partial / rel, "r+b") as f:  # a piece torn on disk after it was journalled
        f.seek(index * PIECE)
        f.write(b"\xff\xfe")
    resumed = PieceReceiver(tmp_path / "w", "org/m", manifest)
    resumed.open()
    assert resumed.resumed == 3 and (rel, index) in resumed.wanted()
    (model / "config.json").write_text('{"model_type": "llama", "changed": true}')
    changed = PieceReceiver(tmp_path / "w", "org/m", model_manifest(model, PIECE))
    changed.open()
    assert changed.resumed == 0  # another version of the model: its pieces start over


def test_a_piece_that_is_not_the_manifest_s_is_never_written(model, tmp_path):
    manifest = model_manifest(model, PIECE)
    r = PieceReceiver(tmp_path / "w", "org/m", manifest)
    r.open()
    assert not r.write("model.safetensors", 0, b"not the piece") and r.refused == 1
    assert r.partial.joinpath("model.safetensors").read_bytes()[:4] == b"\0\0\0\0"
    assert ("model.safetensors", 0) in r.wanted()
    with pytest.raises(SmolforgeError):
        PieceReceiver(tmp_path / "w", "../escape", manifest)


Usage = namedtuple("Usage", "total used free")


def test_a_node_without_the_disk_space_is_refused_before_anything_is_sent(model, tmp_path, monkeypatch):
    manifest = model_manifest(model, PIECE)
    monkeypatch.setenv("SMOLFORGE_MODELS_DIR", str(tmp_path / "small-disk"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 << 30, (10 << 30) - (100 << 20), 100 << 20))
    fetcher = ModelFetcher("org/m", manifest)
    prep = fetcher.prepare()
    assert prep.keys() == {"refused"}, prep
    assert "0.10 GB free in" in prep["refused"] and "the model needs 0.00 GB (+ 0.27 GB kept free)" in prep["refused"]
    assert fetcher.receiver.done == set() and fetcher.progress()["pieces"] == 0
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 << 30, 0, 1 << 30))
    assert ModelFetcher("org/m", manifest).prepare() == {"resumed": 0, "missing_bytes": manifest["bytes"]}
    assert space_refusal(tmp_path, need=10, margin=0) is None


def test_the_fetched_copy_is_what_the_node_loads(model, tmp_path, monkeypatch):
    monkeypatch.setenv("SMOLFORGE_MODELS_DIR", str(tmp_path / "w"))
    monkeypatch.setenv("SMOLFORGE_MODEL_PATHS", "{}")
    assert held_model_dir("org/m") is None
    r = PieceReceiver(tmp_path / "w", "org/m", model_manifest(model, PIECE))
    r.open()
    send(r, model)
    assert held_model_dir("org/m") == str(tmp_path / "w" / "org" / "m")


def _node(name, role="worker", models=(), cpus=1):
    res = {"CPU": float(cpus), "memory": 8e9}
    if role == "worker":
        res[ray_glue.WORKER_RESOURCE] = float(cpus)
    for m in models:
        res[ray_glue.model_resource(m)] = 1000.0
    return ray_glue.NodeInfo(node_id=name * 8, name=name, address="127.0.0.1", alive=True, role=role, cpus=cpus,
                             gpus=0, ram_gb=8.0, gpu_type=None, models=sorted(models), resources=res,
                             available=dict(res), labels={ray_glue.NAME_LABEL: name, ray_glue.ROLE_LABEL: role})


def test_placement_sends_the_model_and_prefers_the_nodes_that_hold_it():
    job = DataParallelJob.model_validate({"num_workers": 2, "train": {"model": "org/m", "data": {"path": "bundled"}}})
    only_coord = [_node("coord", "coordinator", ("org/m",)), _node("w1"), _node("w2")]
    assert travels(job, False, only_coord) and requirements_for(job, False, only_coord).model is None
    bundles = worker_bundles(job, requirements_for(job, False, only_coord), only_coord, 2, False)
    assert all("model:org/m" not in b for b, _ in bundles)  # any worker: it fetches the model

    one_holds = [_node("coord", "coordinator"), _node("w1"), _node("w2", models=("org/m",))]
    bundles = worker_bundles(job, requirements_for(job, False, one_holds), one_holds, 2, False)
    assert ["model:org/m" in b for b, _ in bundles] == [True, False]  # the holder's slot first

    pinned = job.model_copy(update={"require_model": True})
    assert not travels(pinned, False, only_coord) and requirements_for(pinned, False, only_coord).model == "org/m"
    nobody = [_node("coord", "coordinator"), _node("w1")]
    req = requirements_for(job, False, nobody)
    assert req.model == "org/m"
    with pytest.raises(SmolforgeError) as err:
        ray_glue.check_placeable(req, nobody)
    text = err.value.render()
    assert "smolforge worker rescan" in text and "require_model: false" in text, text


def test_the_follow_bar_shows_the_newest_transfer_event():
    from types import SimpleNamespace

    from smolforge.cli.follow import model_transfer_line

    events = [{"id": 1, "kind": "placed", "message": "round 1"},
              {"id": 2, "kind": "model_transfer", "message": "model m: w1 fetching: 1.00 MB, 4/19 pieces"},
              {"id": 3, "kind": "model_transfer", "message": "model m: w1 has it: 3.50 MB, 19/19 pieces"}]
    asked: list[int] = []
    backend = SimpleNamespace(job_events=lambda job_id, since: asked.append(since)
                              or [e for e in events if e["id"] > since])
    seen = {"id": 0, "line": ""}
    assert model_transfer_line(backend, "j1", seen) == "model m: w1 has it: 3.50 MB, 19/19 pieces"
    assert model_transfer_line(backend, "j1", seen) == "model m: w1 has it: 3.50 MB, 19/19 pieces"
    assert asked == [0, 3]  # only the new events are asked for


def test_a_stage_part_holds_only_its_tensors_is_never_advertised_and_loads_as_the_whole(tmp_path, monkeypatch):
    """What a stage's node receives (issue 31 item 2): the config and tokenizer, and only the tensors
    `load_stage` reads for that stage (embeddings on the first, norm and tied head on the last); kept
    under the models dir where `held_stage_dir` finds it and the inventory scan does not."""
    import torch

    from smolforge.cluster.nodes.model_fetch import MODELS_DIR_ENV, held_stage_dir, stage_part_name
    from smolforge.models.stage_load import load_stage, stage_keys, write_stage_part
    from smolforge.models.tiny import preset_dir

    whole = Path(preset_dir("tiny-llama"))
    models = tmp_path / "models"
    monkeypatch.setenv(MODELS_DIR_ENV, str(models))
    monkeypatch.delenv("SMOLFORGE_MODEL_PATHS", raising=False)
    bounds = [0, 2, 4]
    size = sum(p.stat().st_size for p in whole.glob("*.safetensors"))
    keys = [stage_keys(whole, bounds, i) for i in (0, 1)]
    assert "model.embed_tokens.weight" in keys[0] and "model.norm.weight" not in keys[0]
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(keys[1])  # tied head: the embeddings too
    assert not any(".layers.2." in k for k in keys[0]) and not any(".layers.0." in k for k in keys[1])
    for i in (0, 1):
        part = write_stage_part(whole, bounds, i, models / stage_part_name("org/m", bounds, i))
        assert (part / "config.json").is_file() and (part / "tokenizer.json").is_file()
        assert (part / "model.safetensors").stat().st_size < size
        assert held_stage_dir("org/m", bounds, i) == str(part)
        got, _ = load_stage(str(part), bounds, i)
        want, _ = load_stage(str(whole), bounds, i)
        assert all(torch.equal(got.state_dict()[k], v) for k, v in want.state_dict().items())
    assert scan_models_dir(models) == {}  # a part is never taken for the model
    assert held_stage_dir("org/m", [0, 1, 4], 0) is None  # another cut's part is not this one


def test_a_transfer_s_time_is_in_the_estimate_and_holders_come_first(monkeypatch):
    """Issue 31 item 2, the transfer's time in the plan: bytes over the node's measured link, else the
    configured rate, else the planner's default; a holder (0 s) is chosen before a node the model must
    be sent to; every kind that runs a model asks no holder of a model that travels."""
    from smolforge.cluster.control.placement import (LINK_ENV, fewest_transfer_seconds, model_need,
                                                      transfer_note, transfer_seconds)

    monkeypatch.delenv(LINK_ENV, raising=False)
    assert transfer_seconds(25e6) == pytest.approx(2.0)  # 100 Mbit/s, nothing measured or configured
    monkeypatch.setenv(LINK_ENV, "800")
    assert transfer_seconds(25e6) == pytest.approx(0.25)
    assert transfer_seconds(25e6, measured=5e6) == pytest.approx(5.0)  # measured beats configured
    note, est = transfer_note([("w1", 10e6, None), ("w2", 10e6, 1e6)])
    assert est == {"w1": pytest.approx(0.1), "w2": pytest.approx(10.0)}
    assert "10.0 MB to w1 (est. 0.1 s at 800 Mbit/s)" in note and "est. 10.0 s in all" in note, note
    assert transfer_note([]) == ("", {})

    nodes = [_node("w1"), _node("w2", models=("org/m",)), _node("w3")]
    assert [n.name for n in fewest_transfer_seconds(nodes, "org/m", 1e9)] == ["w2", "w1", "w3"]
    slow = {nodes[0].node_id: 1e3}
    assert [n.name for n in fewest_transfer_seconds(nodes, "org/m", 1e9, slow)] == ["w2", "w3", "w1"]

    only_coord = [_node("coord", "coordinator", ("org/m",)), _node("w1")]
    assert model_need("org/m", None, False, only_coord) is None  # it travels: any worker will do
    assert model_need("org/m", None, False, [_node("w1")]) == "org/m"  # no holder: placement says what to do
    assert model_need("org/m", True, False, only_coord) == "org/m" and model_need("org/m", False, False, []) is None
    assert model_need("tiny-llama", None, False, []) is None  # a preset: built anywhere


def test_a_node_joining_a_running_elastic_job_gets_the_model_before_its_rank_starts(monkeypatch):
    """`_admit` (a node lent to a running DiLoCo/parameter-server group): the placed joiner's node is
    handed to `bring_model` before its rank runs; a transfer that fails releases it, with the reason
    in a `join_failed` event, and starts no rank."""
    from types import SimpleNamespace

    from smolforge.cluster.control.runner import Failed
    from smolforge.cluster.workloads.data_parallel import joining

    calls, events, started = [], [], []

    class Group:
        def __init__(self, *a, **kw):
            self.released = False

        def start(self, timeout):
            return [{"node_id": "id-w3", "node_name": "w3", "pid": 1}]

        def release(self):
            self.released = True

        def run(self, *a, **kw):
            started.append(a)
            return ["ref"]

    def bring(report, model, placed, nodes, stopping, **kw):
        calls.append((model, placed))
        return outcome

    monkeypatch.setattr(joining, "WorkerGroup", Group)
    monkeypatch.setattr(joining, "bring_model", bring)
    monkeypatch.setattr(joining, "requirements_for", lambda spec, embedded: ray_glue.Requirements(cpus=1))
    monkeypatch.setattr(joining, "rank_task", lambda spec, world, travels=False: "task")
    job = DataParallelJob.model_validate({"num_workers": 2, "strategy": "diloco",
                                          "train": {"model": "org/m", "data": {"path": "bundled"}}})
    runner = SimpleNamespace(
        spec=job, job_id="j", want=None, control=None, server=None, joiners=[], members={},
        ctx=SimpleNamespace(embedded=False, healthy_nodes=lambda: [_node("w3")], keep_spec=lambda *a: None),
        store=SimpleNamespace(add_event=lambda job_id, kind, message, data=None, **kw: events.append((kind, message)),
                              upsert_task=lambda *a, **kw: None))
    runner._pop_joins = lambda: ["w3"]
    runner._lend = lambda nodes: None
    runner._model_travels = lambda: joining.NodeJoining._model_travels(runner)
    runner._bring_model = lambda placed, task_id, world: joining.NodeJoining._bring_model(runner, placed, task_id,
                                                                                          world)

    outcome = Failed("model org/m: w3 cannot take it: 0.10 GB free", retryable=False)
    assert joining.NodeJoining._admit(runner, job, 2, {}, 2, 3) == []
    assert calls == [("org/m", [("id-w3", "w3")])] and not started and not runner.joiners
    assert [k for k, _ in events] == ["join_failed"] and "0.10 GB free" in events[0][1], events

    calls.clear(), events.clear()
    outcome = None  # it fetched the model (or held it): the rank starts
    assert joining.NodeJoining._admit(runner, job, 2, {}, 2, 3) == [(2, "ref")]
    assert calls == [("org/m", [("id-w3", "w3")])] and len(started) == 1 and runner.members == {2: "w3"}


def test_a_distill_run_waits_for_its_fetching_workers_to_advertise_its_models(monkeypatch):
    """distill/travel.py: each model fetched with advertise=False by the workers that lack it, the models
    at once (each of the first run's two sends waits until both began), each such
    node asked to read its models once, after the last; the run waits for them by name (a node re-joins
    Ray under a new id); one that never comes back is left out with an event; no worker holding the
    teacher then fails the attempt; a stop while waiting regroups. Presets, Ollama teachers and a
    teacher on the coordinator do not travel."""
    import threading

    from smolforge.cluster.control.runner import Failed, Regroup
    from smolforge.cluster.workloads.distill import travel

    coord = _node("coord", "coordinator", ("org/t", "org/s"))
    w1, w2 = _node("w1"), _node("w2")
    back = _node("w1", models=("org/t", "org/s"))
    back.node_id = "new-w1-id"
    tables: list[list] = []
    calls, asked, events = [], [], []

    both = threading.Barrier(2, timeout=20)  # the first run's two models: sent at once, else it breaks

    def bring(report, model, placed, nodes, stopping, part=None, advertise=True):
        calls.append((model, [n for _, n in placed], advertise))
        if len(calls) <= 2:
            both.wait()

    monkeypatch.setattr(travel, "bring_model", bring)
    monkeypatch.setattr(travel, "ask_rescan", lambda placed: asked.append(sorted(n for _, n in placed))
                        or ({n for _, n in placed}, {}))
    monkeypatch.setattr(travel.ray_glue, "nodes", lambda: tables.pop(0) if len(tables) > 1 else tables[0])
    monkeypatch.setattr(travel, "WAIT_POLL_S", 0.01)

    def report(message, data):
        events.append((data.get("state"), data.get("nodes"), message))

    held = [coord, w1]
    assert travel.travelling_models("org/t", ["org/s", "tiny-llama", "org/t"], False, nodes=held) == ["org/t", "org/s"]
    assert travel.travelling_models("org/t", ["org/s"], False, backend="ollama", nodes=held) == ["org/s"]
    assert travel.travelling_models("org/t", ["org/s"], False, on_coordinator=True, nodes=held) == ["org/s"]

    tables[:] = [[coord, w1, w2], [coord, w1, w2], [coord, back, w2]]  # w1 re-joins, w2 never does
    assert travel.bring_run_models(report, ["org/t", "org/s"], "org/t", lambda: False, wait_s=0.5) is None
    assert sorted(calls) == [("org/s", ["w1", "w2"], False), ("org/t", ["w1", "w2"], False)] and asked == [["w1", "w2"]]
    left = [(nodes, m) for state, nodes, m in events if state == "left_out"]
    assert [nodes for nodes, _ in left] == [["w2"]] and "left out" in left[0][1], events
    assert "advertised" not in [state for state, _, _ in events]

    events.clear()
    tables[:] = [[coord, w1, w2]]  # nobody re-joins: no worker can run the teacher
    got = travel.bring_run_models(report, ["org/t", "org/s"], "org/t", lambda: False, wait_s=0.05)
    assert isinstance(got, Failed) and "teacher model org/t" in got.reason, got
    assert [nodes for state, nodes, _ in events if state == "left_out"] == [["w1", "w2"]]

    tables[:] = [[coord, w1, w2]]
    assert isinstance(travel.bring_run_models(report, ["org/t"], "org/t", lambda: True, wait_s=60), Regroup)


def test_a_pipeline_round_sends_the_config_part_and_each_rank_fetches_only_its_stage_s_part(tmp_path, monkeypatch):
    """Issue 31, a pipeline rank's part: a node placed for a round of a strategy whose ranks read only their
    stage (`stage_parts`: the pipeline) receives the config part (no tensor) instead of the model, and its
    rank, once it has cut the model, fetches its stage's part; every other strategy, a one-rank round
    (the single strategy loads the whole model), a model that does not travel, or a node with its own
    whole copy: no part."""
    from types import SimpleNamespace

    from smolforge.cluster.nodes.model_fetch import MODELS_DIR_ENV, stage_part_name
    from smolforge.cluster.workloads.data_parallel import joining
    from smolforge.cluster.workloads.data_parallel.stage_parts import fetches_part, local_model, round_part
    from smolforge.cluster.workloads.model_transfer import CONFIG_PART, StagePart
    from smolforge.models.stage_load import write_stage_part
    from smolforge.models.tiny import preset_dir
    from smolforge.parallel.strategies import STRATEGIES

    assert STRATEGIES["pipeline"].stage_parts and not any(STRATEGIES[n].stage_parts for n in STRATEGIES if n != "pipeline")
    assert round_part(True, 2) == CONFIG_PART and round_part(True, 1) is None and round_part(False, 2) is None
    assert fetches_part(True, 2, travels=True, whole_here=False)
    assert not fetches_part(True, 2, travels=True, whole_here=True)  # it loads its whole copy: nothing sent
    assert not fetches_part(True, 2, travels=False, whole_here=False)  # a preset, require_model false
    assert not fetches_part(True, 1, travels=True, whole_here=False) and not fetches_part(False, 2, True, False)
    assert CONFIG_PART.data() == {"part": "config"} and "no tensors" in CONFIG_PART.label()
    assert StagePart((0, 2, 4), 1).data() == {"stage": 1, "bounds": [0, 2, 4]}
    assert stage_part_name("org/m", [], None) == ".stages/org--m/config" != stage_part_name("org/m", [0, 2, 4], 0)

    sent = []
    monkeypatch.setattr(joining, "bring_model", lambda report, model, placed, nodes, stopping, part=None, **kw:
                        sent.append((model, part)))
    for strategy, world, part in (("pipeline", 2, CONFIG_PART), ("pipeline", 1, None), ("ddp", 2, None)):
        job = DataParallelJob.model_validate({"num_workers": world, "strategy": strategy,
                                              "train": {"model": "org/m", "data": {"path": "bundled"}}})
        runner = SimpleNamespace(spec=job, job_id="j", want=None, ctx=SimpleNamespace(embedded=False,
                                 healthy_nodes=lambda: []), store=None)
        runner._model_travels = lambda: joining.NodeJoining._model_travels(runner)
        assert joining.NodeJoining._bring_model(runner, [("id-w1", "w1")], "j-g1", world) is None
        assert sent.pop() == ("org/m", part), strategy
    runner.spec = job.model_copy(update={"train": job.train.model_copy(update={"model": "tiny-llama"})})
    assert joining.NodeJoining._bring_model(runner, [("id-w1", "w1")], "j-g1", 2) is None and not sent  # a preset

    models = tmp_path / "models"
    monkeypatch.setenv(MODELS_DIR_ENV, str(models))
    monkeypatch.setenv("SMOLFORGE_MODEL_PATHS", "{}")
    config = write_stage_part(preset_dir("tiny-llama"), [], None, models / stage_part_name("org/m", [], None))
    assert (config / "config.json").is_file() and (config / "tokenizer.json").is_file()
    assert (config / "model.safetensors").stat().st_size < 100 and scan_models_dir(models) == {}  # no tensor
    assert local_model("org/m", True, 2, travels=True) == (str(config), True)
    assert local_model("org/m", False, 2, travels=True) == ("org/m", False)  # ddp: the runner sent the model whole
    shutil.copytree(preset_dir("tiny-llama"), models / "org" / "m")
    assert local_model("org/m", True, 2, travels=True) == (str(models / "org" / "m"), False)  # its own whole copy


def test_a_rank_s_part_fetch_reports_as_the_job_s_events_and_fails_the_rank_with_the_reason(tmp_path, monkeypatch):
    """`stage_parts.PartFetch` (a pipeline rank's `model_part`): its node asks `bring_model` for the rank's
    `StagePart` of the planned cut; each step becomes a `model_transfer` event through the rank's reports;
    it answers the part's local directory, or raises with the reason (the rank fails; the policy decides)."""
    from smolforge.cluster.control.runner import Failed
    from smolforge.cluster.nodes.model_fetch import MODELS_DIR_ENV, stage_part_name
    from smolforge.cluster.workloads.data_parallel import stage_parts
    from smolforge.cluster.workloads.model_transfer import StagePart

    monkeypatch.setenv(MODELS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("SMOLFORGE_MODEL_PATHS", "{}")
    monkeypatch.setattr(ray_glue, "nodes", lambda: [_node("coord", "coordinator", ("org/m",)), _node("w2")])
    asked, emitted = [], []

    def bring(report, model, placed, nodes, stopping, part=None, **kw):
        asked.append((model, placed, part, stopping()))
        report("w2 has it: 1.00 MB", {"model": model, "node": "w2", "state": "done", **part.data()})
        if outcome is None:
            where = tmp_path / stage_part_name(model, list(part.bounds), part.index)
            where.mkdir(parents=True)
            (where / "config.json").write_text("{}")
        return outcome

    monkeypatch.setattr(stage_parts, "bring_model", bring)
    fetch = stage_parts.PartFetch("org/m", ("id-w2", "w2"), 1, emitted.append)
    outcome = None
    assert fetch([0, 2, 4], 1) == str(tmp_path / stage_part_name("org/m", [0, 2, 4], 1))
    assert asked == [("org/m", [("id-w2", "w2")], StagePart((0, 2, 4), 1), False)]
    assert emitted == [{"type": "event", "kind": "model_transfer", "message": "rank 1: w2 has it: 1.00 MB",
                        "data": {"model": "org/m", "node": "w2", "state": "done", "stage": 1, "bounds": [0, 2, 4],
                                 "rank": 1}}]
    outcome = Failed("model org/m: w2 cannot take it: 0.10 GB free", retryable=False)
    with pytest.raises(SmolforgeError) as err:
        fetch([0, 1, 4], 1)
    assert "stage 1's part (layers 1-4)" in err.value.render() and "0.10 GB free" in err.value.render()


def test_a_served_model_s_parts_are_sent_at_once_then_its_stages_start_one_per_node_at_a_time(monkeypatch):
    """`serve --stages 3` of a model only the coordinator holds, stages 0 and 2 planned on w1, stage 1 on
    w2 (`StageGroup._start_stages`): every stage's part is sent before any stage starts, the three sends
    at once (each send waits until all three have begun: sent one after another, the first would wait
    alone and the barrier break); then the stages start, w2's while w1's first loads, w1's second only
    once w1's first answered (a node's memory cap is planned for resident sizes, not two loads at once).
    A send that fails ends the start with its reason, after the others ended, and no stage starts."""
    import threading

    from smolforge.cluster.control.runner import Failed
    from smolforge.cluster.workloads import model_transfer
    from smolforge.cluster.workloads.serve import stages as st
    from smolforge.serve.stages import StageError

    coord, w1, w2 = _node("coord", "coordinator", ("org/m",)), _node("w1"), _node("w2")
    monkeypatch.setattr(ray_glue, "nodes", lambda: [coord, w1, w2])
    record: list[tuple] = []
    barrier, refuse = threading.Barrier(3, timeout=20), set()

    def bring(report, model, placed, nodes, stopping, part=None, **kw):
        record.append(("send", part.index, placed[0][1]))
        barrier.wait()  # BrokenBarrierError unless the three sends run at once
        record.append(("sent", part.index))
        return Failed("w2 cannot take it: 0.10 GB free", retryable=False) if part.index in refuse else None

    def settle(h, actor, node):
        record.append(("answered", h.index))
        h.actor, h.where, h.broken, h.pending = actor, {"node": node.name}, False, None

    def group() -> st.StageGroup:
        g = st.StageGroup("org/m", None, bounds=[0, 1, 2, 4])
        g.targets, g.handles = [w1.node_id, w2.node_id, w1.node_id], [st.RemoteStage(g, i) for i in range(3)]
        monkeypatch.setattr(g, "_create", lambda h, node: record.append(("create", h.index, node.name)) or h.index)
        monkeypatch.setattr(g, "_settle", settle)
        return g

    monkeypatch.setattr(model_transfer, "bring_model", bring)
    group()._start_stages()
    sends, rest = record[:6], record[6:]
    assert sorted(e for e in sends[:3]) == [("send", 0, "w1"), ("send", 1, "w2"), ("send", 2, "w1")], record
    assert sorted(e[1] for e in sends[3:]) == [0, 1, 2] and {e[0] for e in sends[3:]} == {"sent"}, record
    assert rest == [("create", 0, "w1"), ("create", 1, "w2"), ("answered", 0), ("create", 2, "w1"),
                    ("answered", 1), ("answered", 2)], record

    record.clear()
    refuse.add(1)
    g = group()
    with pytest.raises(StageError, match="stage 1 could not be given its part .*0.10 GB free"):
        g._start_stages()
    assert sorted(e[0] for e in record) == ["send"] * 3 + ["sent"] * 3, record  # every send ended, none started
    assert [h.pending for h in g.handles] == [None] * 3


def test_a_data_parallel_round_sends_the_model_while_its_ranks_processes_start(monkeypatch):
    """`WorkerGroup.start`: once the bundles are reserved and every rank's actor is created, `meanwhile`
    (the runner's `bring_model`) gets the reserved nodes in rank order, before the actors' answers are
    awaited, so the transfer overlaps the ranks' process starts instead of following them."""
    import importlib

    import ray

    from smolforge.cluster.workloads.data_parallel import worker_group

    pgmod = importlib.import_module("ray.util.placement_group")  # the module (ray.util's name is its function)

    w1, w2 = _node("w1"), _node("w2")
    record: list[tuple] = []

    class Actor:
        def __init__(self, rank):
            self.info = type("M", (), {"remote": lambda _self: ("info", rank)})()

    class Cls:
        def options(self, **kw):
            return self

        def remote(self, job_id, attempt, rank, cpus, control):
            record.append(("created", rank))
            return Actor(rank)

    def get(refs, timeout=None):
        if refs == "ready":
            return None
        record.append(("awaited", [r for _, r in refs]))
        return [{"rank": r, "node_id": n.node_id, "node_name": n.name} for (_, r), n in zip(refs, (w1, w2))]

    monkeypatch.setattr(pgmod, "placement_group", lambda specs, **kw: type("PG", (), {"ready": lambda s: "ready"})())
    monkeypatch.setattr(pgmod, "placement_group_table", lambda pg: {"bundles_to_node_id": {0: w1.node_id, 1: w2.node_id}})
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "remote", lambda cls: Cls())
    monkeypatch.setattr(ray_glue, "nodes", lambda: [w2, w1])
    group = worker_group.WorkerGroup("j", 1, [({"CPU": 1}, {}), ({"CPU": 1}, {})], control=None)
    infos = group.start(5, meanwhile=lambda placed: record.append(("meanwhile", placed)))
    assert record == [("created", 0), ("created", 1), ("meanwhile", [(w1.node_id, "w1"), (w2.node_id, "w2")]),
                      ("awaited", [0, 1])], record
    assert [i["node_name"] for i in infos] == ["w1", "w2"]
