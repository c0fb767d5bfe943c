"""lm-evaluation-harness as a client of `smolforge serve` (issue 44 item 7): its `local-completions`
model scores a multiple-choice task (a task YAML and a JSONL made here: nothing downloaded) through
the served model (`echo` with `logprobs` on /v1/completions, through the front process), with the
same accuracy as its own HF model class on the same checkpoint, and every choice's log-likelihood
equal within 1e-3 (lm-eval 0.4.13, the `eval` extra).

lm-eval runs in a child process: its `datasets` reads its cache and offline settings when imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import require_module

# soak: ~11 s of CPU in lm-eval's process (its imports ~4.5 s) besides the server's: over the CI tier's
# few seconds a test. The CI tier proves echo's numbers in test_logprobs.py.
pytestmark = [pytest.mark.timeout(600), pytest.mark.soak]

TASK = "smolforge_local_mc"
DOCS = [
    ("The sky is", ["blue", "green", "loud", "seven"], 0),
    ("Two plus two is", ["four", "red", "cat", "Monday"], 0),
    ("Water is", ["wet", "dry", "square", "late"], 0),
    ("A dog says", ["woof", "meow", "moo", "quack"], 0),
    ("The capital of France is", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("Ice is", ["cold", "hot", "sweet", "tall"], 0),
    ("The sun rises in the", ["east", "west", "north", "south"], 0),
    ("A week has seven", ["days", "cats", "rivers", "songs"], 0),
    ("Fire is", ["hot", "cold", "blue", "quiet"], 0),
    ("Grass is", ["green", "purple", "metal", "loud"], 0),
    ("Snow is", ["white", "black", "orange", "heavy"], 0),
    ("Birds can", ["fly", "swim", "read", "cook"], 0),
]

TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

SCRIPT = """
import json, sys, time
t0 = time.process_time()
import lm_eval
from lm_eval.tasks import TaskManager

task, tasks_dir, model_dir, base_url = sys.argv[1:5]
out = {}
for kind, model, args in (
        ("serve", "local-completions", {"model": "tiny", "base_url": base_url, "tokenizer": model_dir,
                                        "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1,
                                        "max_length": 512}),
        ("hf", "hf", {"pretrained": model_dir, "device": "cpu", "dtype": "float32", "max_length": 512})):
    tasks = TaskManager(include_path=tasks_dir, include_defaults=False)  # ours only: no scan of lm-eval's own
    res = lm_eval.simple_evaluate(model=model, model_args=args, tasks=[task], task_manager=tasks, log_samples=True,
                                  batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  fewshot_random_seed=0)
    samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
    out[kind] = {"acc": res["results"][task]["acc,none"], "acc_norm": res["results"][task]["acc_norm,none"],
                 "lls": [[r[0] for r in s["filtered_resps"]] for s in samples]}
    out[kind]["cpu_s"] = time.process_time() - t0
print("RESULT " + json.dumps(out))
"""


def test_lm_eval_scores_a_local_task_through_serve_as_through_its_hf_model(server, model_copy, tmp_path):
    require_module("lm_eval", "lm-eval (smolforge[eval])", "pip install -e '.[eval]'")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS))
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "HF_HOME": str(tmp_path / "hf"),
           "OPENAI_API_KEY": server.token, "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, TASK, str(tasks), str(model_copy),
                          f"{server.base}/v1/completions"], env=env, capture_output=True, text=True, timeout=540)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    serve, hf = got["serve"], got["hf"]
    assert len(serve["lls"]) == len(hf["lls"]) == len(DOCS)
    worst = max(abs(a - b) for s, h in zip(serve["lls"], hf["lls"]) for a, b in zip(s, h))
    assert worst < 1e-3, (worst, serve["lls"], hf["lls"])
    assert (serve["acc"], serve["acc_norm"]) == (hf["acc"], hf["acc_norm"])
