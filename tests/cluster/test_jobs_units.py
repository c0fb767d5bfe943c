"""The one job system's pieces, without a cluster: states, the kind registry, ids, the failure policy."""

from __future__ import annotations

import pytest

from smolforge.cluster.control import kinds
from smolforge.cluster.control.jobstore import JobStore
from smolforge.cluster.control.policy import FailurePolicy
from smolforge.cluster.control.runner import JobRunner
from smolforge.cluster.control.states import FINAL_STATES, JobState
from smolforge.errors import SmolforgeError


def test_a_cancelled_job_never_ends_as_failed(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    job = store.create_job("data_parallel", {"kind": "data_parallel"})
    store.set_state(job, "running")
    store.set_state(job, "cancelled", force=True)
    # a runner that sees its killed workers fail records "failed" with force: the cancel stands
    assert store.set_state(job, "failed", "rank 0 died", force=True) == "cancelled"
    assert store.get_job(job)["state"] == "cancelled"
    with pytest.raises(SmolforgeError, match="cannot become"):
        store.set_state(job, "running")
    assert JobState.settle("cancelled", "failed") is JobState.CANCELLED
    assert JobState.settle("running", "failed") is JobState.FAILED
    assert all(not s.can_become(t) for s in FINAL_STATES for t in JobState)


def test_job_ids_exact_name_or_unique_prefix_never_a_guess(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    a = store.create_job("data_parallel", {}, name="alpha", job_id="job-aaaa1111")
    b = store.create_job("data_parallel", {}, name="beta", job_id="job-aaaa2222")
    assert store.get_job("job-aaaa1111")["id"] == a
    assert store.get_job("beta")["id"] == b
    assert store.get_job("job-aaaa2")["id"] == b
    with pytest.raises(SmolforgeError, match="matches 2 jobs by id prefix"):
        store.get_job("job-aaaa")
    for wild in ("%", "job-%", "_ob-aaaa1111", "job-aaaa111_"):  # SQL LIKE wildcards are plain characters
        with pytest.raises(SmolforgeError, match="no job"):
            store.get_job(wild)
    store.create_job("data_parallel", {}, name="alpha", job_id="job-bbbb0000")
    with pytest.raises(SmolforgeError, match="matches 2 jobs by name"):
        store.get_job("alpha")


def test_every_kind_is_one_registry_entry():
    assert set(kinds.KINDS) == {"data_parallel", "distill", "distill_task", "serve", "export", "split"}
    for name, kind in kinds.KINDS.items():
        assert issubclass(kind.runner(), JobRunner)
        assert kind.demand is not None, f"{name}: the queue needs to know what a {name} job asks for"
        assert kind.spec.model_fields["kind"].default == name
        assert kind.section is None or kind.section in kind.spec.model_fields
    with pytest.raises(SmolforgeError, match="unknown job kind 'teleport'"):
        kinds.kind_of({"kind": "teleport"})


def test_a_distill_job_with_its_teacher_on_the_coordinator_asks_no_worker_to_hold_the_teacher():
    from smolforge.cluster.control.specs import DistillJob

    spec = {"kind": "distill", "distill": {"teacher": "qwen2.5:7b", "students": ["tiny-llama"], "data": "bundled"}}
    assert kinds.KINDS["distill"].demand(DistillJob.model_validate(spec), False).req.model == "qwen2.5:7b"
    spec["distill"]["teacher_on_coordinator"] = True
    assert kinds.KINDS["distill"].demand(DistillJob.model_validate(spec), False).req.model is None


def test_set_routes_into_the_kind_section():
    dp = kinds.apply_job_overrides({"kind": "data_parallel", "train": {"data": {}}},
                                  ["num_workers=3", "lr=0.01", "training.batch_size=16", "train.data.max_length=64"])
    assert dp["num_workers"] == 3 and dp["train"]["lr"] == 0.01 and dp["train"]["batch_size"] == 16
    assert dp["train"]["data"]["max_length"] == 64
    ds = kinds.apply_job_overrides({"kind": "distill", "distill": {}}, ["mode=hybrid", "max_steps=9", "top_k=4"])
    assert ds["mode"] == "hybrid" and ds["distill"] == {"max_steps": 9, "top_k": 4}
    with pytest.raises(SmolforgeError, match="not a section"):
        kinds.apply_job_overrides({"kind": "data_parallel", "train": {"max_steps": 5}}, ["max_steps.x=1"])
    sv = kinds.apply_job_overrides({"kind": "serve", "model": "m"}, ["stages=3", "port=0"])  # a flat spec
    assert kinds.parse(sv).stages == 3 and sv["port"] == 0
    assert kinds.parse({"kind": "serve", "model": "m", "stages": "auto"}).stages == "auto"
    for bad in (0, "many"):
        with pytest.raises(SmolforgeError, match="stages"):
            kinds.parse({"kind": "serve", "model": "m", "stages": bad})
    with pytest.raises(SmolforgeError, match="a serving job has no setting 'lr'"):
        kinds.apply_job_overrides({"kind": "serve", "model": "m"}, ["lr=0.1"])


def test_failure_policy_retries_from_the_checkpoint_then_gives_up():
    policy = FailurePolicy(max_retries=2)
    first = policy.on_failure("rank 1 died", checkpoint="step-10")
    assert first.retry and first.resume_from == "step-10" and "retry 1 of 2" in first.reason
    assert policy.on_failure("rank 0 died").retry
    last = policy.on_failure("rank 1 died again")
    assert not last.retry and "gave up after 3 failures" in last.reason
    own = policy.on_failure("bad data", subject="student-0", retryable=False)
    assert not own.retry and own.attempt == 1 and "not retried" in own.reason


def test_only_the_embedded_cluster_writes_a_job_where_its_spec_says():
    """A coordinator never writes into a directory a network peer names; the embedded cluster (this
    machine, `smolforge distill --output-dir`) does, given an absolute path."""
    from smolforge.cluster.control import kinds
    from smolforge.errors import SmolforgeError

    spec = {"kind": "distill", "distill": {"teacher": "tiny-llama", "students": ["tiny-llama"], "data": "bundled"}}
    kinds.check_output_dir(kinds.parse(spec), embedded=False)  # no output_dir: fine anywhere
    job = kinds.parse({**spec, "output_dir": "/tmp/run"})
    with pytest.raises(SmolforgeError, match="embedded cluster only"):
        kinds.check_output_dir(job, embedded=False)
    kinds.check_output_dir(job, embedded=True)
    for bad in ("run", "/tmp/a/../b"):
        with pytest.raises(SmolforgeError, match="absolute path without"):
            kinds.check_output_dir(kinds.parse({**spec, "output_dir": bad}), embedded=True)


def test_stages_in_a_job_file_mean_the_pipeline_with_a_rank_per_stage():
    from smolforge.cluster.control.specs import DataParallelJob

    train = {"model": "tiny-llama", "data": {"path": "bundled"}}
    job = DataParallelJob.model_validate({"train": train, "stages": 3})
    assert (job.strategy, job.num_workers) == ("pipeline", 3)
    for bad, needle in (({"strategy": "ddp"}, "strategy is 'ddp'"), ({"num_workers": 3}, "differ")):
        with pytest.raises(ValueError, match=needle):
            DataParallelJob.model_validate({"train": train, "stages": 2, **bad})
