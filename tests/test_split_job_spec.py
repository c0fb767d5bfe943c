"""Split learning as a job kind, without a cluster: `launch --mode split` flags (a bad one is exit 2 and
one message, before anything starts), the `kind: split` spec and its defaults, and where the trunk goes
(`choose_trunk_node`: model-aware, a GPU node first, not where a trunk of the job was lost)."""

from __future__ import annotations

import hashlib

import pytest
from typer.testing import CliRunner

from smolforge.cluster.control.kinds import parse
from smolforge.cluster.nodes.ray_glue import MODEL_PREFIX, WORKER_RESOURCE, NodeInfo, Requirements
from smolforge.errors import SmolforgeError

SPLIT = ["launch", "--mode", "split", "--model", "tiny-llama", "--dataset", "bundled"]
POINTS = ["--split-point-1", "1", "--split-point-2", "3"]

BAD_FLAGS = [  # (name, argv, what stderr says)
    ("no split points", SPLIT, "--mode split needs --split-point-1 and --split-point-2"),
    ("an empty trunk", [*SPLIT, "--split-point-1", "3", "--split-point-2", "2"],
     "split_point_2 (2) must be above split_point_1 (3)"),
    ("another mode's flag", [*SPLIT, *POINTS, "--workers", "3"], "--workers does not apply to --mode split"),
    ("a setting the job owns", [*SPLIT, *POINTS, "--set", "split.server_port=50051"],
     "split.server_port: Extra inputs are not permitted"),
    ("a PEFT method split learning lacks", [*SPLIT, *POINTS, "--peft", "ia3"], "--peft ia3 does not apply"),
    ("a split flag in another mode", ["launch", "--model", "tiny-llama", "--dataset", "bundled", "--client-node", "w1"],
     "--client-node applies to --mode split only"),
]


@pytest.mark.timeout(120)  # a row that is not refused would start an embedded cluster: fail it, do not train
@pytest.mark.parametrize("name,argv,needle", BAD_FLAGS, ids=[row[0] for row in BAD_FLAGS])
def test_launch_split_with_bad_flags_is_one_message_and_exit_2(name, argv, needle):
    from smolforge.cli.main import app

    result = CliRunner().invoke(app, argv, env={"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None})
    err = result.stderr
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (name, result.exception, err[-2000:])
    assert err.startswith("error:") and err.count("error:") == 1 and needle in err, (name, err)
    assert "Traceback" not in result.output and "\n  fix:" in err and len(err.splitlines()) <= 12, err


def _job(**split) -> dict:
    return {"kind": "split", "split": {"model": "tiny-llama", "split_point_1": 1, "split_point_2": 3, **split}}


def test_a_split_job_checkpoints_by_default_and_its_settings_are_split_trains():
    """A job's trunk can only be placed again from a checkpoint: unset, save_interval is the jobs' default
    (a tenth of the steps, at least 10); `checkpointing: false` turns it off. Every setting is one of
    `smolforge split train`'s (the seed's names), so the client is built from them as they are."""
    from smolforge.split.trainer import SplitTrainConfig

    job = parse(_job(max_steps=300))
    assert job.split.save_interval == 30 and job.client_node == "@coordinator" and job.trunk_gpu == "preferred"
    assert parse({**_job(max_steps=300), "checkpointing": False}).split.save_interval == 0
    assert parse({**_job(save_interval=4), "resources": {"cpu_cores": 2}}).cpus == 2
    cfg = SplitTrainConfig(**job.split.model_dump(), server_port=50051, output_dir="out", resume=True)
    assert cfg.save_interval == 30 and cfg.lora_rank == job.split.lora_rank
    with pytest.raises(SmolforgeError, match="split_point_2 .1. must be above split_point_1 .1."):
        parse(_job(split_point_2=1))


# what `split train` says itself and a job's runner decides (client_side.ClientActor._config)
JOB_OWNED = {"server_host", "server_port", "token", "tls_ca", "tls_server_name", "output_dir", "resume",
             "session_name", "quiet", "tensorboard", "wandb", "reconnect_timeout", "num_threads"}


def _same(a, b) -> bool:
    return (a.annotation, a.default, a.default_factory, a.metadata, a.description) == (
        b.annotation, b.default, b.default_factory, b.metadata, b.description)


def test_the_job_and_the_command_train_with_one_list_of_settings():
    """`SplitSettings` (the job) and `SplitTrainConfig` (the command) both derive from
    `split.settings.SplitTraining`: neither declares a training setting of its own, so a default or a
    bound cannot differ between them. The job overrides only save_interval's default (unset: the jobs'
    default; a job must checkpoint); the command adds only what a job owns."""
    from smolforge.cluster.control.specs import SplitSettings
    from smolforge.split.settings import SplitTraining
    from smolforge.split.trainer import SplitTrainConfig

    shared = SplitTraining.model_fields
    job, command = SplitSettings.model_fields, SplitTrainConfig.model_fields
    assert set(job) == set(shared), f"declare training settings in SplitTraining, not the job: {set(job) ^ set(shared)}"
    assert set(command) == set(shared) | JOB_OWNED, (
        f"a setting of `split train` only: put it in SplitTraining, or in JOB_OWNED if a job's runner decides it: "
        f"{set(command) ^ (set(shared) | JOB_OWNED)}")
    assert [k for k in shared if not _same(job[k], shared[k])] == ["save_interval"]
    assert [k for k in shared if not _same(command[k], shared[k])] == []
    assert not JOB_OWNED & set(shared)


def _id(name: str) -> str:
    return hashlib.sha224(name.encode()).hexdigest()  # a node id as Ray writes it (56 hex digits)


def _node(name: str, gpus: float = 0, models: tuple[str, ...] = ("m",), cpus: float = 2, free: float = 2) -> NodeInfo:
    res = {"CPU": cpus, WORKER_RESOURCE: cpus, **{MODEL_PREFIX + m: 1000.0 for m in models}, **({"GPU": gpus} if gpus else {})}
    return NodeInfo(node_id=_id(name), name=name, address="127.0.0.1", alive=True, role="worker", cpus=cpus,
                    gpus=gpus, ram_gb=8, gpu_type=None, models=list(models), resources=res,
                    available={**res, "CPU": free, WORKER_RESOURCE: free})


def test_the_trunk_goes_to_a_node_holding_the_model_a_gpu_first_not_where_it_was_lost():
    from smolforge.cluster.workloads.split.trunk import choose_trunk_node

    req = Requirements(model="m", cpus=1, gpu="preferred")
    nodes = [_node("cpu1"), _node("gpu1", gpus=1), _node("other", gpus=1, models=("x",))]
    plan = choose_trunk_node(req, nodes, avoid=set())
    assert plan.node.name == "gpu1" and plan.options["num_gpus"] == 1 and "a GPU node" in plan.why, plan
    # lost on the GPU node: the other node holding the model takes it, though it has no GPU
    plan = choose_trunk_node(req, [n for n in nodes if n.name != "gpu1"], avoid={_id("gpu1")})
    assert plan.node.name == "cpu1" and not plan.options["num_gpus"] and "CPU node" in plan.why, plan
    # two that hold it: not the one where it was lost (a trunk process that died on a live node)
    plan = choose_trunk_node(req, [_node("z", cpus=4, free=4), _node("b")], avoid={_id("z")})  # z: roomier, but lost there
    assert plan.node.name == "b" and "not where the trunk was lost" in plan.why, plan
    with pytest.raises(SmolforgeError, match="does not hold model m"):
        choose_trunk_node(req, [_node("other", models=("x",))], avoid=set())
