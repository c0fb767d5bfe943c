"""The bad-input table, through the real CLI: each case is exit 2 and one message (what, where, how to
fix), never a traceback. Cases that need a running service start the real one."""

from __future__ import annotations

import json
import socket

import pytest

from helpers import smolforge


def _files(tmp):
    (tmp / "empty.yaml").write_text("")
    (tmp / "list.yaml").write_text("- a\n- b\n")
    (tmp / "latin1.yaml").write_bytes(b"model: caf\xe9\n")
    (tmp / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    (tmp / "bad.jsonl").write_text("not json\n{bad\n")
    (tmp / "nomodel").mkdir()
    (tmp / "cfgdir").mkdir()


TRAIN = ["train", "--model", "tiny-llama", "--data", "bundled"]
CASES = [  # (name, args with {t} for the tmp dir, what stderr says)
    ("config is a directory", ["train", "--config", "{t}/cfgdir"], "is a directory, not a YAML file"),
    ("config not UTF-8", ["train", "--config", "{t}/latin1.yaml"], "is not UTF-8 text"),
    ("empty config", ["train", "--config", "{t}/empty.yaml"], "missing --model and --data"),
    ("config is a list", ["train", "--config", "{t}/list.yaml"], "config must be a mapping"),
    ("a key into a scalar", [*TRAIN, "--set", "max_steps.x=1"], "max_steps"),
    ("unknown key, did you mean", [*TRAIN, "--set", "bach_size=4"], "did you mean 'batch_size'?"),
    ("unknown nested key", [*TRAIN, "--set", "data.max_lenght=4"], "did you mean 'max_length'?"),
    ("negative steps", [*TRAIN, "--max-steps", "-5"], "max_steps: Input should be greater than or equal to 1"),
    ("JSONL nested 100 000 deep", ["train", "--model", "tiny-llama", "--data", "{t}/deep.jsonl"], "nested too deeply"),
    ("only bad lines", ["train", "--model", "tiny-llama", "--data", "{t}/bad.jsonl", "--skip-bad-lines"],
     "no usable examples (2 bad lines skipped)"),
    ("unknown strategy, did you mean", ["launch", "--model", "tiny-llama", "--dataset", "bundled", "--strategy",
                                        "dilocco"], "did you mean 'diloco'?"),
    ("a strategy setting that does not exist", ["launch", "--model", "tiny-llama", "--dataset", "bundled",
                                                "--strategy", "diloco", "--set", "strategy_config.inner_step=5"],
     "strategy_config.inner_step: Extra inputs are not permitted"),
    ("a strategy setting out of range", ["launch", "--model", "tiny-llama", "--dataset", "bundled", "--strategy",
                                         "diloco", "--set", "strategy_config.codec=int4"], "strategy_config.codec"),
    ("a parameter-server deadline floor above its ceiling",
     ["launch", "--model", "tiny-llama", "--dataset", "bundled", "--strategy", "sync-ps", "--set",
      "strategy_config.deadline_min_s=9", "--set", "strategy_config.deadline_max_s=2"],
     "deadline_min_s 9.0 is above deadline_max_s 2.0"),
    ("a negative staleness bound", ["launch", "--model", "tiny-llama", "--dataset", "bundled", "--strategy", "ssp",
                                    "--set", "strategy_config.staleness_bound=-1"], "strategy_config.staleness_bound"),
    ("--stages with a data-parallel strategy", ["launch", "--model", "tiny-llama", "--dataset", "bundled", "--stages",
                                                "2", "--strategy", "zero1"], "--strategy zero1 is data parallelism"),
    ("--stages and --workers that differ", ["launch", "--model", "tiny-llama", "--dataset", "bundled", "--stages", "2",
                                           "--workers", "3"], "--stages 2 and --workers 3 differ"),
    ("model dir without config.json", ["train", "--model", "{t}/nomodel", "--data", "bundled"], "has no config.json"),
    ("coordinator not running", ["jobs", "--coordinator", "127.0.0.1:9", "--token", "x"], "cannot reach the coordinator"),
    ("token file missing", ["jobs", "--coordinator", "127.0.0.1:9", "--token-file", "{t}/no-such-token"],
     "cannot read the token file"),
    ("token file empty", ["worker", "join", "127.0.0.1:9", "--token-file", "{t}/empty.yaml"], "the token file is empty"),
    ("https without a pinned fingerprint", ["jobs", "--coordinator", "https://127.0.0.1:9", "--token", "x"],
     "needs the coordinator's certificate fingerprint"),
    ("a fingerprint that is not one", ["worker", "join", "https://127.0.0.1:9", "--token", "x", "--tls-fingerprint",
                                       "abc"], "is not a SHA-256 certificate fingerprint"),
    ("--tls-cert without --tls-key", ["coordinator", "start", "--tls-cert", "{t}/empty.yaml", "--state-dir",
                                      "{t}/state", "--port", "9"], "--tls-cert and --tls-key go together"),
    ("split server open to a LAN without a token", ["split", "serve", "--model", "tiny-llama", "--split-point-1", "1",
                                                    "--split-point-2", "2", "--no-token", "--host", "0.0.0.0"],
     "--no-token with --host 0.0.0.0"),
    ("serve stages that are not a number", ["serve", "--model", "tiny-llama", "--stages", "many"],
     "--stages 'many' is not a number of stages"),
    ("a priority the queue has not", ["launch", "--model", "tiny-llama", "--dataset", "bundled", "--priority",
                                      "urgent"], "priority: Input should be 'high', 'normal' or 'low'"),
    ("a resource request that contradicts its field", ["launch", "--model", "tiny-llama", "--dataset", "bundled",
                                                       "--cpus-per-worker", "2", "--set", "resources.cpu_cores=4"],
     "resources.cpu_cores is 4 but cpus_per_worker is 2"),
]


@pytest.mark.parametrize("name,args,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_message_and_exit_2(tmp_path, name, args, needle):
    _files(tmp_path)
    argv = [a.replace("{t}", str(tmp_path)) for a in args]
    if argv[0] == "train":
        argv += ["--output-dir", str(tmp_path / "out")]
    proc = smolforge(*argv, timeout=120)
    assert proc.returncode == 2, (name, proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.startswith("error:") and needle in proc.stderr, (name, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "fix:" in proc.stderr


def test_a_port_in_use_is_named(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = smolforge("coordinator", "start", "--port", str(port), "--state-dir", str(tmp_path / "s"), timeout=120)
    assert proc.returncode == 2 and f"port {port} is already in use" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "s" / "coordinator.json").exists() or not json.loads(
        (tmp_path / "s" / "coordinator.json").read_text()).get("head_pid")


def test_a_used_output_dir_is_refused_before_the_job_is_submitted(tmp_path):
    """The adapter download at a job's end would refuse a dir holding another run's adapter: say so
    before anything runs (no cluster starts, nothing is submitted), not after an hour of training."""
    used = tmp_path / "out" / "lora_adapter"
    used.mkdir(parents=True)
    (used / "adapter_model.safetensors").write_bytes(b"an earlier run")
    env = {"SMOLFORGE_HOME": str(tmp_path / "home"), "SMOLFORGE_COORDINATOR": ""}
    proc = smolforge("launch", "--model", "tiny-llama", "--dataset", "bundled", "--workers", "1",
                     "--output-dir", str(tmp_path / "out"), timeout=120, env=env)
    assert proc.returncode == 2 and "already holds lora_adapter" in proc.stderr, proc.stderr[-2000:]
    assert (used / "adapter_model.safetensors").read_bytes() == b"an earlier run"
    assert not (tmp_path / "home" / "embedded" / "jobs.db").exists()  # nothing was submitted


def test_a_download_keeps_the_same_artifact_and_refuses_other_files(tmp_path):
    from smolforge.errors import SmolforgeError
    from smolforge.parallel.transfer import check_download_dest, pack_dir, unpack_dir

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"weights")
    payload = pack_dir(src)
    dest = tmp_path / "dest"
    assert check_download_dest(dest, payload["sha256"]) is False  # free
    unpack_dir(payload, dest)
    assert check_download_dest(dest, payload["sha256"]) is True  # the same artifact: nothing to do
    (dest / "mine.txt").write_text("the user's own file")
    with pytest.raises(SmolforgeError, match="already holds other files"):
        check_download_dest(dest, payload["sha256"])
    assert check_download_dest(dest, payload["sha256"], overwrite=True) is False
    assert (dest / "mine.txt").exists()  # refusing (or allowing) deletes nothing by itself


def test_an_adapter_of_another_base_is_one_message(tmp_path):
    """The bad-input table's "tokenizer/model mismatch" row: through the real CLI, exit 2, no traceback."""
    from smolforge.config import PeftSpec
    from smolforge.models import peft_methods as pm
    from smolforge.models.loading import load_model

    out = tmp_path / "lora_adapter"
    pm.save_adapter(pm.apply_peft(load_model("tiny-llama"), PeftSpec(method="lora", r=4)), out)
    proc = smolforge("eval", "--model", "tiny-qwen2", "--adapter", str(out), "--data", "bundled", timeout=120)
    assert proc.returncode == 2 and "trained on another base model" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "fix:" in proc.stderr
