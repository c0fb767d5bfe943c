"""The bad-input table, through the CLI's own app (typer's runner, in this process): each case is exit
2 and one message (what, where, how to fix), never a traceback. A few tests run the real command
where the process matters (a port in use, the real entry point's output)."""

from __future__ import annotations

import json
import socket

import pytest
from typer.testing import CliRunner

from helpers import smolforge

DEEP = "[" * 5000 + "]" * 5000


def _files(tmp):
    (tmp / "empty.yaml").write_text("")
    (tmp / "list.yaml").write_text("- a\n- b\n")
    (tmp / "latin1.yaml").write_bytes(b"model: caf\xe9\n")
    (tmp / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    (tmp / "bad.jsonl").write_text("not json\n{bad\n")
    (tmp / "nomodel").mkdir()
    (tmp / "cfgdir").mkdir()
    (tmp / "deep.yaml").write_text(f"model: tiny-llama\ndata: {{path: bundled}}\nx: {DEEP}\n")
    (tmp / "deepblock.yaml").write_text("".join("  " * i + f"k{i}:\n" for i in range(600)))
    (tmp / "deepjob.yaml").write_text("kind: data_parallel\ntrain: {model: tiny-llama, data: {path: bundled}}\n"
                                      f"x: {'[' * 40}{']' * 40}\n")
    # a billion laughs: 9 aliases of 9 aliases ... expand to 9**9 values (a few KB of YAML)
    bomb = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    (tmp / "bomb.yaml").write_text("\n".join(["model: tiny-llama", "data: {path: bundled}", *bomb]) + "\n")
    (tmp / "a-file").write_text("not a directory")
    (tmp / "train-run" / "checkpoints" / "step-10").mkdir(parents=True)  # another run's, not a demo's


TRAIN = ["train", "--model", "tiny-llama", "--data", "bundled"]
CASES = [  # (name, args with {t} for the tmp dir, what stderr says)
    ("config is a directory", ["train", "--config", "{t}/cfgdir"], "is a directory, not a YAML file"),
    ("config is a device", ["train", "--config", "/dev/null"], "is not a regular file (a character device)"),
    ("data is a device", [*TRAIN[:3], "--data", "/dev/null"], "/dev/null is not a regular file (a character device)"),
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
                                         "diloco", "--set", "strategy_config.codec=int3"], "strategy_config.codec"),
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


LAUNCH = ["launch", "--model", "tiny-llama", "--dataset", "bundled"]
SPLIT_SERVE = ["split", "serve", "--model", "tiny-llama", "--split-point-1", "1", "--split-point-2", "2"]
SPLIT_TRAIN = ["split", "train", "--model", "tiny-llama", "--split-point-1", "1", "--split-point-2", "2"]
HOSTILE = [  # the review's seven command lines, then more: bounds, encodings, nesting, paths
    ("nested YAML in --config", ["train", "--config", "{t}/deep.yaml"], "deep.yaml: nests deeper than 32 levels"),
    ("nested YAML in submit", ["submit", "{t}/deep.yaml"], "deep.yaml: nests deeper than 32 levels"),
    ("nested --set value", [*TRAIN, "--set", f"x={DEEP}"], "--set x: nests deeper than 32 levels"),
    ("nested --peft-config", [*TRAIN, "--peft-config", '{"r": ' + DEEP + "}"], "--peft-config nests deeper than 32"),
    ("serve --port -1", ["serve", "--model", "tiny-llama", "--port", "-1"], "--port -1 is not a port number"),
    ("coordinator --port 70000", ["coordinator", "start", "--port", "70000", "--state-dir", "{t}/state"],
     "--port 70000 is not a port number"),
    ("worker join an unclosed IPv6 literal", ["worker", "join", "http://[::1", "--token", "x"],
     "'[::1' is not HOST:PORT (Invalid IPv6 URL)"),
    ("--ray-port in Ray's worker ports", ["coordinator", "start", "--ray-port", "15000", "--port", "5999",
                                          "--state-dir", "{t}/state"],
     "inside Ray's worker-port range (10002-19999)"),
    ("block-nested YAML in --config", ["train", "--config", "{t}/deepblock.yaml"], "nests deeper than 32 levels"),
    ("nested YAML in a job file", ["submit", "{t}/deepjob.yaml"], "deepjob.yaml: nests deeper than 32 levels"),
    ("a YAML alias bomb", ["train", "--config", "{t}/bomb.yaml"], "holds more than 100,000 values"),
    ("a --set key 40 parts long", [*TRAIN, "--set", "a." * 40 + "b=1"], "has more than 32 parts"),
    ("nested --peft-config of distill", ["distill", "--teacher", "tiny-llama", "--student", "tiny-llama", "--data",
                                         "bundled", "--peft-config", '{"r": ' + DEEP + "}"], "nests deeper than 32"),
    ("--port and --ray-port the same", ["coordinator", "start", "--port", "6000", "--ray-port", "6000", "--state-dir",
                                        "{t}/state"], "--port and --ray-port are both 6000"),
    ("--ray-port past 65535", ["coordinator", "start", "--ray-port", "99999", "--state-dir", "{t}/state"],
     "--ray-port 99999 is not a port number"),
    ("coordinator --cpus below 0", ["coordinator", "start", "--cpus", "-2", "--state-dir", "{t}/state"],
     "--cpus -2 is below 0"),
    ("worker join over ftp", ["worker", "join", "ftp://host:5000", "--token", "x"], "http:// or https://, not ftp://"),
    ("worker join a models dir that does not exist", ["worker", "join", "127.0.0.1:9", "--token", "x", "--models-dir",
                                                       "{t}/no-such-dir"], "no-such-dir does not exist"),
    ("worker join a models dir that is a file", ["worker", "join", "127.0.0.1:9", "--token", "x", "--models-dir",
                                                 "{t}/a-file"], "is not a folder"),
    ("coordinator a models dir that does not exist", ["coordinator", "start", "--state-dir", "{t}/cs", "--models-dir",
                                                      "{t}/no-such-dir"], "no-such-dir does not exist"),
    ("worker join port past 65535", ["worker", "join", "host:99999", "--token", "x"], "Port out of range"),
    ("worker join with a path", ["worker", "join", "http://host:5000/api", "--token", "x"], "is not HOST:PORT"),
    ("worker join --cpus -1", ["worker", "join", "127.0.0.1:9", "--token", "x", "--cpus", "-1"], "--cpus -1 is below 1"),
    ("worker join --gpus -1", ["worker", "join", "127.0.0.1:9", "--token", "x", "--gpus", "-1"], "--gpus -1 is below 0"),
    ("jobs at an unclosed IPv6 literal", ["jobs", "--coordinator", "http://[::1", "--token", "x"], "is not HOST:PORT"),
    ("a state no job has", ["jobs", "--state", "runing"], "unknown job state 'runing'"),
    ("dashboard --port 70000", ["dashboard", "--port", "70000"], "--port 70000 is not a port number"),
    ("split serve --port -1", ["split", "serve", "--model", "tiny-llama", "--split-point-1", "1", "--split-point-2",
                               "2", "--port", "-1"], "--port -1 is not a port number"),
    ("split train --server-port 70000", ["split", "train", "--model", "tiny-llama", "--split-point-1", "1",
                                         "--split-point-2", "2", "--server-port", "70000"],
     "--server-port 70000 is not a port number"),
    ("diloco int8 block past 4096", [*LAUNCH, "--strategy", "diloco", "--set", "strategy_config.codec=int8", "--set",
                                     "strategy_config.block=100000"], "less than or equal to 4096"),
    ("diloco int8 block below 64", [*LAUNCH, "--strategy", "diloco", "--set", "strategy_config.block=8"],
     "greater than or equal to 64"),
    ("a model name that is not UTF-8", ["train", "--model", "caf\udce9", "--data", "bundled"],
     "the model argument is not UTF-8 text (byte 0xe9"),
    ("a job id that is not UTF-8", ["job", "show", "\udcff"], "the job-id argument is not UTF-8 text (byte 0xff"),
    ("a --config name too long", ["train", "--config", "x" * 5000 + ".yaml"], "File name too long"),
    ("a --data name too long", ["train", "--model", "tiny-llama", "--data", "x" * 5000 + ".jsonl"],
     "data.path: is 5,006 characters long (at most 4,096)"),  # the input rules' length, before any file is opened
    ("--output-dir that is a file", [*TRAIN, "--output-dir", "{t}/a-file"], "cannot make the directory"),
    ("demo --max-steps 0", ["demo", "--workflow", "sft", "--max-steps", "0", "--output-dir", "{t}/d"],
     "--max-steps 0: give 1 or more"),
    ("demo over another run's checkpoints", ["demo", "--workflow", "sft", "--output-dir", "{t}/train-run"],
     "holds files that no .smolforge-run.json records"),
    # issue 43's six, then their kinds (input_rules: every int 64-bit, every float finite, each count in its
    # flag's range with cli.common.bounded, every string UTF-8 without NUL), on other commands and flags
    ("--seed past 64 bits", [*TRAIN, "--seed", "99999999999999999999999"],
     "--seed 99999999999999999999999 is past the 64-bit range (23 digits)"),
    ("launch --max-steps past 64 bits", [*LAUNCH, "--max-steps", str(2**70)], "--max-steps 1180591620717411303424 is past the 64-bit range (22 digits)"),
    ("demo --seed past 64 bits", ["demo", "--seed", str(10**30), "--output-dir", "{t}/d"], "past the 64-bit range"),
    ("--epochs inf", [*TRAIN, "--epochs", "inf"], "--epochs inf is not a finite number"),
    ("--lr nan", [*TRAIN, "--lr", "nan"], "--lr nan is not a finite number"),
    ("launch --epochs -inf", [*LAUNCH, "--epochs", "-inf"], "--epochs -inf is not a finite number"),
    ("distill --temperature nan", ["distill", "--teacher", "tiny-llama", "--student", "tiny-llama", "--data", "bundled",
                                   "--temperature", "nan"], "--temperature nan is not a finite number"),
    ("distill --temperature 0", ["distill", "--teacher", "tiny-llama", "--student", "tiny-llama", "--data", "bundled",
                                 "--temperature", "0"], "temperature: Input should be greater than 0"),
    ("--max-new-tokens -1", ["generate", "--model", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "-1"],
     "--max-new-tokens -1 is below 1"),
    ("split train --batch-size 0", [*SPLIT_TRAIN, "--batch-size", "0"], "--batch-size 0 is below 1"),
    ("split train --max-seq-length -5", [*SPLIT_TRAIN, "--max-seq-length", "-5"], "--max-seq-length -5 is below 1"),
    ("split serve --lora-rank 0", [*SPLIT_SERVE, "--lora-rank", "0"], "--lora-rank 0 is below 1"),
    ("split serve --max-sessions -1", [*SPLIT_SERVE, "--max-sessions", "-1"], "--max-sessions -1 is below 1"),
    ("--lora-dropout 5", [*SPLIT_SERVE, "--lora-dropout", "5"], "--lora-dropout 5.0 is at or above 1"),
    ("train --lora-dropout 5", [*TRAIN, "--lora-dropout", "5"], "dropout: Input should be less than 1"),
    ("split serve --session-timeout nan", [*SPLIT_SERVE, "--session-timeout", "nan"], "is not a finite number"),
    ("--temperature nan", ["generate", "--model", "tiny-llama", "--prompt", "hi", "--temperature", "nan"],
     "--temperature nan is not a finite number"),
    ("generate --temperature -1", ["generate", "--model", "tiny-llama", "--prompt", "hi", "--temperature", "-1"],
     "--temperature -1.0 is below 0"),
    ("a NUL byte in --model", ["train", "--model", "tiny\x00llama", "--data", "bundled"], "--model holds a NUL byte (at character 4)"),
    ("a NUL byte in a --set value", [*TRAIN, "--set", "output_dir=a\x00b"], "holds a NUL byte"),
]


def _row(row):
    return row if isinstance(row, type(pytest.param())) else pytest.param(*row, id=row[0])


def _invoke(argv: list[str]):
    """The CLI in this process; a SystemExit of 2 is the one outcome a bad input may have."""
    from smolforge.cli.main import app

    return CliRunner().invoke(app, argv, env={"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None})


@pytest.mark.timeout(120)  # a row that is not refused would run its command: fail it, do not train for minutes
@pytest.mark.parametrize("name,args,needle", [_row(r) for r in CASES + HOSTILE])
def test_bad_input_is_one_message_and_exit_2(tmp_path, name, args, needle):
    _files(tmp_path)
    argv = [a.replace("{t}", str(tmp_path)) for a in args]
    if argv[0] == "train" and "--output-dir" not in argv:
        argv += ["--output-dir", str(tmp_path / "out")]
    result = _invoke(argv)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (name, result.exception, result.output[-2000:])
    err = result.stderr
    assert err.startswith("error:") and err.count("error:") == 1 and needle in err, (name, err[-2000:])
    assert "Traceback" not in result.output and "fix:" in err
    assert "\n  fix:" in err and len(err.splitlines()) <= 12, err  # one message, not a dump


def test_bad_ports_fail_before_anything_starts(tmp_path):
    """`coordinator start --port 70000` used to start the Ray head, then die at bind(): now nothing
    starts (no Ray in this process, no child process, not even the state dir)."""
    import psutil
    import ray

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    for argv in (["coordinator", "start", "--port", "70000", "--state-dir", str(tmp_path / "s")],
                 ["coordinator", "start", "--ray-port", "15000", "--state-dir", str(tmp_path / "s")]):
        assert _invoke(argv).exit_code == 2
    assert not ray.is_initialized() and not (tmp_path / "s").exists()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_the_real_command_prints_one_message_for_nested_yaml(tmp_path):
    """The same table row through `python -m smolforge.cli.main`: the process's own stderr and code."""
    _files(tmp_path)
    proc = smolforge("train", "--config", str(tmp_path / "deep.yaml"), "--output-dir", str(tmp_path / "out"), timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error:"), proc.stderr[-2000:]
    assert "nests deeper than 32 levels" in proc.stderr and "Traceback" not in proc.stderr


def test_the_demo_deletes_nothing_of_another_run_and_replaces_its_own(tmp_path):
    """`demo --output-dir D` over another run's outputs is refused with them untouched; over a demo's own
    earlier outputs (its manifest records them) it starts afresh, as it always did."""
    from smolforge.distill.demo import claim_demo_dir
    from smolforge.errors import SmolforgeError

    _files(tmp_path)
    run = tmp_path / "train-run"
    (run / "distill" / "output").mkdir(parents=True)  # as a `smolforge distill --output-dir D/distill` leaves it
    refused = _invoke(["demo", "--workflow", "distill", "--output-dir", str(run)])
    assert refused.exit_code == 2 and "holds files that no .smolforge-run.json records" in refused.stderr
    with pytest.raises(SmolforgeError, match="holds files that no .smolforge-run.json records"):
        claim_demo_dir(run, ("distill", "sft-baseline"))
    assert (run / "checkpoints" / "step-10").is_dir() and (run / "distill" / "output").is_dir()  # nothing deleted
    demo = tmp_path / "demo"
    claim_demo_dir(demo, ("checkpoints",))  # a first demo records its directory
    (demo / "checkpoints" / "step-400").mkdir(parents=True)
    claim_demo_dir(demo, ("checkpoints",))  # the next one replaces what the first left
    assert not (demo / "checkpoints").exists()


def test_a_port_in_use_is_named(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = smolforge("coordinator", "start", "--port", str(port), "--state-dir", str(tmp_path / "s"), timeout=120)
    assert proc.returncode == 2 and f"{port}: address already in use" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "s" / "coordinator.json").exists() or not json.loads(
        (tmp_path / "s" / "coordinator.json").read_text()).get("head_pid")


@pytest.mark.parametrize("command", [["coordinator", "start"], ["serve", "--model", "tiny-llama"]])
def test_a_host_that_is_not_this_machine_s_is_named_not_called_a_port_in_use(command, tmp_path):
    """Every listener asks the OS why it cannot bind (`net.bind_refusal`): `--host 8.8.8.8` used to say
    "port ... is already in use" on the coordinator (issue 43)."""
    (tmp_path / "token").write_text("a-token-of-32-characters-or-more-0123456789\n")
    (tmp_path / "token").chmod(0o600)
    proc = smolforge(*command, "--host", "8.8.8.8", "--port", "0" if command[0] == "serve" else "8799",
                     "--state-dir" if command[0] == "coordinator" else "--token-file",
                     str(tmp_path / "s") if command[0] == "coordinator" else str(tmp_path / "token"), timeout=120)
    assert proc.returncode == 2 and "8.8.8.8 is not an address of this machine" in proc.stderr, proc.stderr[-2000:]
    assert "in use" not in proc.stderr and "Traceback" not in proc.stderr and "--host" in proc.stderr


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
