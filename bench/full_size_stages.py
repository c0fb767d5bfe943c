r"""A model bigger than each worker's memory limit, served and LoRA-trained in 2 stages (issue 31, full size).

The model is a full-size twin of a published 1B+ checkpoint (default `twin:tinyllama-1.1b-chat-v1.0@full`:
TinyLlama-1.1B-Chat's published config, 1.10 B parameters, random weights, its tokenizer made locally;
nothing downloaded), saved once in bf16 (the published dtype: 2.2 GB) and linked into a temp models dir.
Two workers join a local coordinator (`tests/cluster/localcluster.py`, the CI proof's world in
`tests/cluster/test_memory_cap.py`) with `worker join --memory-limit` below the whole model's bytes in
that dtype (default 0.9 x), each holding the model in its models dir, so model travel is not in any time.

1. one process loads the whole model (`serve`'s own `ServedModel` + `Engine`, 1 thread) and answers the
   prompts greedily: its peak RSS (VmHWM) is P, and its decode rate is the 1-process baseline;
2. `serve --stages 2` on the capped workers (1 CPU and 1 thread per stage): each stage's peak RSS from the
   job's result, the same prompts' answers (equal to the single process's: yes/no) and the decode rate;
3. `launch --stages 2` (the pipeline strategy) LoRA-trains it a few steps at batch 1, seq 64, lr 3e-3 (one
   eval of 2 rows through the stages at the end, so none is inside a step's time): each rank's peak RSS
   and the median s/step from the job's summary, the training loss first -> last and the final eval loss;
4. `serve --stages 1` on one capped worker: the planner's refusal.

Decode rate, both sides the same way: (n - 1) / (t(n tokens) - t(1 token)) per prompt, median over the
prompts, so the prefill is out of it; in wall-clock time (tokens/s) and in CPU time (CPU s/token: the one
process's own, or both stage actors' read from /proc, as they run on this machine). On a shared machine
the wall rate follows the load (a process that sleeps between its steps, as a stage does while the other
works, is favoured by the scheduler over one that never sleeps); the CPU time does not.

At most one copy of the model is alive at a time (step 1 ends before the cluster loads a stage; the serve
job is cancelled before training starts); before each heavy step the script waits (up to 2 min) for
--min-free-gb of MemAvailable, else skips the step and says so.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/full_size_stages.py \
        [--model twin:tinyllama-1.1b-chat-v1.0@full --dtype bf16 --cap-of-model 0.9 --tokens 16 --steps 4 --seq 64 \
         --lr 3e-3 --precision auto]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is 2 + 3?", "Write a list of colours:", "The capital of France is"]
MODEL_NAME = "fullsize-twin"  # the name in the workers' models dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="twin:tinyllama-1.1b-chat-v1.0@full",
                    help="a full-size twin (twin:<family>@full) or a local checkpoint directory")
    ap.add_argument("--dtype", default="bf16", help="the dtype every process loads (the saved one for a twin)")
    ap.add_argument("--cap-of-model", type=float, default=0.9,
                    help="each worker's --memory-limit as a share of the whole model's bytes (must be < 1)")
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per answer")
    ap.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--steps", type=int, default=4, help="training steps")
    ap.add_argument("--batch", type=int, default=1, help="training rows per micro-batch")
    ap.add_argument("--seq", type=int, default=64, help="training max length")
    ap.add_argument("--lr", type=float, default=3e-3, help="LoRA learning rate (the CI proof's)")
    ap.add_argument("--precision", default="auto",
                    help="training precision: auto (bf16 autocast where the CPU does it well; a bf16 model is cast "
                         "nothing, and the stage plan counts no copies for it) or fp32")
    ap.add_argument("--min-free-gb", type=float, default=8.0, help="MemAvailable needed before a heavy step")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs) after the run")
    args = ap.parse_args(argv)
    if not 0 < args.cap_of_model < 1:
        ap.error("--cap-of-model must be between 0 and 1: the point is a cap below the whole model")
    return args


# -- the model ---------------------------------------------------------------------------------------------

def model_dir(name: str) -> Path:
    """The checkpoint directory: a twin is built once (cached under $SMOLFORGE_HOME/twins)."""
    from smolforge.models.twins import is_twin, twin_dir

    return twin_dir(name) if is_twin(name) else Path(name)


def link_into(src: Path, models: Path) -> Path:
    """`src` as models/MODEL_NAME, its files hard-linked (no second 2 GB on disk) or copied across devices."""
    dst = models / MODEL_NAME
    dst.mkdir(parents=True)
    for f in src.iterdir():
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)
    return dst


def model_facts(path: Path) -> dict:
    """Parameters and bytes as stored (the safetensors headers: nothing loaded), layers."""
    from safetensors import safe_open

    params = nbytes = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                sl = st.get_slice(key)
                n = 1
                for d in sl.get_shape():
                    n *= d
                params += n
                nbytes += n * {"BF16": 2, "F16": 2, "F32": 4}[sl.get_dtype()]
    config = json.loads((path / "config.json").read_text())
    return {"params": params, "bytes": nbytes, "layers": config.get("num_hidden_layers"),
            "dtype": config.get("torch_dtype")}


# -- memory and load ---------------------------------------------------------------------------------------

def available_gb() -> float:
    """MemAvailable (free plus reclaimable cache: what `free -g` shows as available), GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def room_for(what: str, need_gb: float, wait_s: float = 120) -> bool:
    """Whether `need_gb` is available for a heavy step (waiting up to `wait_s`): the machine is shared."""
    deadline = time.time() + wait_s
    while available_gb() < need_gb and time.time() < deadline:
        time.sleep(5)
    ok = available_gb() >= need_gb
    print(f"[{time.strftime('%H:%M:%S')}] {what}: {available_gb():.1f} GiB available, "
          f"{'go' if ok else f'skipped (< {need_gb} GiB)'}; load {os.getloadavg()[0]:.2f}", flush=True)
    return ok


def rate(n_tokens: int, t_n: float, t_1: float) -> float | None:
    """Decode tokens/s without the prefill: (n - 1) tokens over the time n tokens took beyond 1."""
    return (n_tokens - 1) / (t_n - t_1) if n_tokens > 1 and t_n > t_1 else None


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes `pids` of this machine have used so far."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# -- 1: one process --------------------------------------------------------------------------------------

SINGLE = """
import json, sys, time, torch
torch.set_num_threads(1)
from smolforge.serve.engine import Engine
from smolforge.serve.model import ServedModel
from smolforge.serve.sampling import SamplingParams
from smolforge.telemetry.memory import peak_rss_mb
model = ServedModel.load(sys.argv[1], device="cpu", dtype=sys.argv[2])
engine = Engine(model).start()
out = []
for p in json.loads(sys.argv[4]):
    ids = model.tokenizer(p)["input_ids"]
    t, c = time.perf_counter(), time.process_time()
    full = engine.generate(ids, SamplingParams(max_tokens=int(sys.argv[3]), temperature=0), timeout=1200)
    t_n, c_n = time.perf_counter() - t, time.process_time() - c
    t, c = time.perf_counter(), time.process_time()
    engine.generate(ids, SamplingParams(max_tokens=1, temperature=0), timeout=600)
    out.append({"text": full.text, "tokens": len(full.token_ids), "t_n": t_n, "t_1": time.perf_counter() - t,
                "c_n": c_n, "c_1": time.process_time() - c})
engine.stop()
print(json.dumps({"peak_rss_mb": peak_rss_mb(), "answers": out}))
"""


def single_process(model: Path, args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", SINGLE, str(model), args.dtype, str(args.tokens),
                        json.dumps(PROMPTS[: args.prompts])], capture_output=True, text=True, timeout=1500, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"the single process failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    summarize(res)
    return res


def summarize(res: dict) -> None:
    """The median decode rate (wall clock) and CPU seconds per decoded token over the answers."""
    res["tok_s"] = median([rate(a["tokens"], a["t_n"], a["t_1"]) for a in res["answers"]])
    res["cpu_s_per_token"] = median([1 / r if r else None for r in
                                     (rate(a["tokens"], a["c_n"], a["c_1"]) for a in res["answers"])])


# -- the cluster -----------------------------------------------------------------------------------------

def submitted(r: subprocess.CompletedProcess) -> str:
    if "submitted " not in r.stderr:
        raise RuntimeError(f"not submitted (rc {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return r.stderr.split("submitted ", 1)[1].split()[0]


def wait_stages(client, job_id: str, ready, stages: int = 2, timeout: float = 60) -> list[dict]:
    """The stages in the job's result once `ready(stage)` holds for each (the runner mirrors them every 2 s)."""
    deadline, got = time.time() + timeout, []
    while time.time() < deadline:
        got = (client.get_job(job_id).get("result") or {}).get("stages") or []
        if len(got) == stages and all(ready(s) for s in got):
            return got
        time.sleep(1)
    return got


def ask(http, prompt: str, tokens: int, pids: list[int]) -> dict:
    """One prompt's greedy answer of `tokens` tokens, then of 1 token: wall and stage CPU time of each."""
    timed = []
    for n in (tokens, 1):
        t, c = time.perf_counter(), cpu_s(pids)
        r = http.post("/completions", json={"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0})
        r.raise_for_status()
        timed.append((r.json(), time.perf_counter() - t, cpu_s(pids) - c))
    (full, t_n, c_n), (_, t_1, c_1) = timed
    return {"text": full["choices"][0]["text"], "tokens": full["usage"]["completion_tokens"],
            "t_n": t_n, "t_1": t_1, "c_n": c_n, "c_1": c_1}


def staged_serve(c, args, single: dict | None) -> dict:
    """`serve --stages 2` on the capped workers: answers, decode rate, each stage's peak RSS."""
    import httpx

    from localcluster import free_port

    port = free_port()
    t0 = time.time()
    r = c.cli("serve", "--model", MODEL_NAME, "--stages", "2", "--port", str(port), "--model-name", "m",
              "--dtype", args.dtype, "--cpus-per-stage", "1", timeout=900)
    job_id = submitted(r)
    out: dict = {"plan": [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "stage " in ln and " on " in ln],
                 "ready_s": time.time() - t0}
    try:
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=1200,
                            headers={"Authorization": f"Bearer {c.token}"})
        # the stage actors run on this machine: their CPU time is read from /proc around each request
        pids = [s["pid"] for s in wait_stages(c.client(), job_id, lambda s: s.get("pid"))]
        out["answers"] = [ask(http, p, args.tokens, pids) for p in PROMPTS[: args.prompts]]
        summarize(out)
        if single:
            out["equal"] = [a["text"] == s["text"] and a["tokens"] == s["tokens"]
                            for a, s in zip(out["answers"], single["answers"])]
        out["stages"] = wait_stages(c.client(), job_id, lambda s: s.get("peak_rss_mb"))
    finally:
        c.client().cancel_job(job_id)
        wait_gone(c.client(), job_id)
    return out


def wait_gone(client, job_id: str, timeout: float = 90) -> None:
    """Until the job is cancelled and its actors had a moment to exit (their memory back)."""
    deadline = time.time() + timeout
    while time.time() < deadline and client.get_job(job_id).get("state") not in ("cancelled", "failed", "completed"):
        time.sleep(1)
    time.sleep(5)


def staged_train(c, args, out_dir: Path) -> dict:
    """`launch --stages 2` LoRA on the capped workers: each rank's peak RSS, s/step, the loss first -> last."""
    r = c.cli("launch", "--model", MODEL_NAME, "--dataset", "bundled", "--stages", "2", "--max-steps", str(args.steps),
              "--batch-size", str(args.batch), "--max-length", str(args.seq), "--dtype", args.dtype,
              "--cpus-per-worker", "1", "--save-every", "0", "--quiet", "--json", "--output-dir", str(out_dir),
              "--lr", str(args.lr), "--set", f"precision={args.precision}", "--set", "data.max_eval_samples=2",
              "--set", "eval_accuracy=false", timeout=1500)
    if r.returncode != 0:
        raise RuntimeError(f"launch --stages 2 failed (rc {r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}")
    st = json.loads(r.stdout)
    res, client = st["result"], c.client()
    rows = sorted((m for m in client.job_metrics(st["job_id"], "loss") if m.get("value") is not None),
                  key=lambda m: m.get("step") or 0)
    events = client.job_events(st["job_id"])
    evals = [e["data"]["eval_loss"] for e in events if e["kind"] == "eval"]
    plan = next((e["message"] for e in events if e["kind"] == "pipeline_plan"), "")
    return {"job": st["job_id"], "peaks": res.get("peak_rss_mb_per_rank"), "nodes": res.get("nodes"),
            "median_step_s": res.get("median_step_s"), "steps": res.get("steps"),
            "loss_first": rows[0]["value"] if rows else None, "loss_last": rows[-1]["value"] if rows else None,
            "eval_loss": evals[-1] if evals else None, "plan": plan}


def refused(c, args) -> str:
    """`serve --stages 1`: the planner's refusal (the model does not fit one capped worker), on one line."""
    import contextlib

    from localcluster import free_port

    r = c.cli("serve", "--model", MODEL_NAME, "--stages", "1", "--port", str(free_port()), "--dtype", args.dtype,
              timeout=600)
    if r.returncode == 0:
        with contextlib.suppress(Exception):
            c.client().cancel_job(submitted(r))
        return "NOT refused: it was served on one worker"
    text = " ".join((r.stdout + r.stderr).split())  # the CLI wraps its message: one line again
    return f"exit {r.returncode}: " + text[text.find("the model does not fit"):] if "does not fit" in text else text


# -- the table -------------------------------------------------------------------------------------------

def mib(x) -> str:
    return "-" if x is None else f"{x:,.0f} MiB"


def rate_cell(r: dict, base: dict | None) -> str:
    """tokens/s (wall) and CPU s/token, with their ratios to the 1-process run when there is one."""
    cell = f"{r['tok_s']:.2f} tok/s" if r.get("tok_s") else "-"
    if base and base is not r and base.get("tok_s") and r.get("tok_s"):
        cell += f" ({r['tok_s'] / base['tok_s']:.2f}x)"
    if r.get("cpu_s_per_token"):
        cell += f"; {r['cpu_s_per_token']:.3f} CPU s/token"
        if base and base is not r and base.get("cpu_s_per_token"):
            cell += f" ({r['cpu_s_per_token'] / base['cpu_s_per_token']:.2f}x)"
    return cell


def table(facts: dict, cap_mib: float, single: dict | None, serve: dict | None, train: dict | None,
          refusal: str | None) -> str:
    """Markdown: what / peak RSS per stage or rank / cap / whole model / tokens/s or s/step."""
    whole, cap = f"{facts['bytes'] / 2**20:,.0f} MiB", f"{cap_mib:,.0f} MiB"
    lines = ["| what | peak RSS per stage / rank | cap | whole model | tokens/s or s/step |",
             "|---|---:|---:|---:|---:|"]
    if single:
        lines.append(f"| 1 process, whole model, greedy | P = {mib(single['peak_rss_mb'])} | none | {whole} | "
                     f"{rate_cell(single, single)} |")
    if serve and serve.get("stages"):
        peaks = " / ".join(mib(s.get("peak_rss_mb")) for s in serve["stages"])
        eq = "yes" if serve.get("equal") and all(serve["equal"]) else "no"
        lines.append(f"| `serve --stages 2`; greedy tokens equal 1 process's: {eq} | {peaks} | {cap} | {whole} | "
                     f"{rate_cell(serve, single)} |")
    if train and train.get("peaks"):
        peaks = " / ".join(mib(p) for p in train["peaks"])
        loss = (f", loss {train['loss_first']:.2f} → {train['loss_last']:.2f}" if train.get("loss_first") is not None
                else "") + (f", eval loss {train['eval_loss']:.2f}" if train.get("eval_loss") is not None else "")
        step = f"{train['median_step_s']:.1f} s/step" if train.get("median_step_s") else "-"
        lines.append(f"| `launch --stages 2` LoRA, {train['steps']} steps{loss} | {peaks} | {cap} | {whole} | {step} |")
    if refusal:
        verdict = "refused by the planner" if "does not fit" in refusal else refusal[:80]
        lines.append(f"| `serve --stages 1` on one capped worker | - | {cap} | {whole} | {verdict} |")
    return "\n".join(lines)


# -- the run ---------------------------------------------------------------------------------------------

def run_cluster(base: Path, models: Path, args, cap_gb: float, single: dict | None) -> dict:
    sys.path.insert(0, str(ROOT / "tests" / "cluster"))
    from localcluster import LocalCluster

    out: dict = {"serve": None, "train": None, "refusal": None, "errors": []}
    c = LocalCluster(base)
    try:
        c.start_coordinator()
        c.add_workers(["w1", "w2"], models_dir=models, memory_gb=round(cap_gb, 3))
        c.wait_nodes(["coordinator", "w1", "w2"])
        steps = [("serve", lambda: staged_serve(c, args, single)),
                 ("train", lambda: staged_train(c, args, base / "out")),
                 ("refusal", lambda: refused(c, args))]
        for key, step in steps:
            if key != "refusal" and not room_for(f"step {key}", args.min_free_gb):
                continue
            try:
                out[key] = step()
            except Exception as e:  # one failed step must not lose the others' numbers
                out["errors"].append(f"{key}: {e}")
                print(f"{key} failed: {e}", file=sys.stderr, flush=True)
    finally:
        c.close()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    t0 = time.time()
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)
    base = Path(tempfile.mkdtemp(prefix="fullsize-", dir="/tmp"))
    try:
        src = model_dir(args.model)
        models = base / "models"
        path = link_into(src, models)
        facts = model_facts(path)
        cap_gb = args.cap_of_model * facts["bytes"] / 1e9
        print(f"model {args.model}: {facts['params'] / 1e9:.3f} B parameters, {facts['bytes'] / 1e9:.2f} GB in "
              f"{facts['dtype']} ({facts['layers']} layers), loaded as {args.dtype}; each worker capped at "
              f"{cap_gb:.2f} GB ({args.cap_of_model:g} x the whole model)", flush=True)
        single = single_process(path, args) if room_for("step 1 process", args.min_free_gb) else None
        if single:
            print(f"1 process: peak {single['peak_rss_mb']:.0f} MiB, {single['tok_s']:.2f} tok/s", flush=True)
        res = run_cluster(base, models, args, cap_gb, single)
        print(json.dumps({"facts": facts, "cap_gb": cap_gb, "single": single, **res}, indent=1, default=str))
        print(f"\nuptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}; "
              f"whole run {time.time() - t0:.0f} s\n")
        print(table(facts, cap_gb * 1e9 / 2**20, single, res["serve"], res["train"], res["refusal"]))
        print(f"\nserve --stages 1: {res['refusal']}")
        return 1 if res["errors"] else 0
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
