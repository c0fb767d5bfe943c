"""One `smolforge distill` run's polling loops, threads and driver CPU (issue 42's measurement).

Runs `smolforge distill` (bundled data, two students, embedded cluster) as a child process of the
code on PYTHONPATH, and while it runs:
- every --every seconds reads /proc of the driver (the CLI process: it hosts the embedded
  coordinator, the job runner and the distillation's session) and of every process below it:
  threads (/proc/PID/task), CPU ticks (/proc/PID/stat utime+stime), each driver thread's
  voluntary context switches (how often it woke);
- every --dump-every seconds takes a `py-spy dump` of each Python process of the run (the driver
  and Ray's workers: teacher tasks, student actors) and sorts its Python threads: a thread waiting
  in `time.sleep`, or in a wait with a timeout (`Condition/Event.wait(timeout)`, `queue.get(timeout)`,
  `ray.wait(timeout=)`, `select`/`poll` with a timeout), is a polling loop; one blocked without a
  timeout, or running, is not.

A loop is named by its site: the innermost frame of smolforge's own code (else of Ray's, else the
innermost frame) in the thread's stack. `own_loops` are those whose stack passes through smolforge;
the rest (`other_loops`) are Ray's and the libraries'. Output: one JSON object (stdout or --out).

    PYTHONPATH=src .venv/bin/python bench/distill_loops.py --out /tmp/loops-after.json
    # "before": the same script on an older tree
    PYTHONPATH=/work/old/src .venv/bin/python bench/distill_loops.py --out /tmp/loops-before.json

Needs py-spy (a dependency of ray[default]) and ptrace rights on the run's processes (root, or
kernel.yama.ptrace_scope=0); without them the thread sort is skipped and said so.
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import psutil

CLK_TCK = os.sysconf("SC_CLK_TCK")
# a waiting primitive's line that gives it a timeout: time.sleep(...), wait(..., timeout), get(timeout=)
TIMED = re.compile(r"\bsleep\(|timeout|\.wait\(\s*[\w.]+\s*\)")
UNTIMED_WAITS = {"waiter.acquire()"}  # threading.Condition.wait without a timeout
FRAME = re.compile(r"^\s+(?P<func>\S+) \((?P<file>.+):(?P<line>\d+)\)$")
THREAD = re.compile(r'^Thread (?P<tid>\S+) \((?P<state>[^)]*)\)(?:: "(?P<name>.*)")?')


def cpu_ticks(pid: int) -> int | None:
    """utime+stime of a process in clock ticks (/proc/PID/stat fields 14 and 15), None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


def thread_wakes(pid: int) -> dict[str, tuple[str, int]]:
    """Per thread id: (its name, voluntary context switches so far) from /proc/PID/task/TID/."""
    out: dict[str, tuple[str, int]] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except OSError:
            continue
        m = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M)
        out[task.name] = (name, int(m.group(1)) if m else 0)
    return out


def role(proc: psutil.Process, driver: int) -> str:
    """What a process of the run is: the driver, a Ray worker by its title (ray::StudentActor), or its program."""
    if proc.pid == driver:
        return "driver"
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return "gone"
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split()[0].split(".")[0]  # ray::_StudentWorker.run -> ray::_StudentWorker
    return Path(cmd[0]).name if cmd else proc.name()


def is_python(proc: psutil.Process) -> bool:
    """Whether a process runs a Python interpreter (py-spy can read it)."""
    try:
        return "python" in Path(proc.exe()).name
    except psutil.Error:
        return False


def statement(file: str, line: int) -> str:
    """The source of the statement that starts at file:line (its lines up to balanced brackets)."""
    text = ""
    for k in range(line, line + 6):
        text += linecache.getline(file, k).strip() + " "
        if text.count("(") <= text.count(")"):
            break
    return text.strip()


def classify(frames: list[tuple[str, str, int]], idle: bool) -> str:
    """'poll' (sleeps, or waits with a timeout), 'blocked' (waits without one) or 'running'.

    frames: (function, file, line), innermost first, as py-spy prints them. Judged by the innermost
    smolforge frame's statement when there is one (its `time.sleep(0.5)`, `ray.wait(..., timeout=)`,
    `event.wait(TICK_S)`), else by the innermost frames (Ray's and the libraries' own loops)."""
    own = next((f for f in frames if "/smolforge/" in f[1]), None)
    if own is not None:
        src = statement(own[1], own[2])
        if TIMED.search(src):
            return "poll"
        return "blocked" if idle else "running"
    if not frames or not idle:
        return "running"
    for func, file, line in frames[:3]:
        src = statement(file, line)
        if src in UNTIMED_WAITS:
            return "blocked"
        if TIMED.search(src):
            return "poll"
        if not file.endswith(("threading.py", "queue.py", "selectors.py", "socket.py")):
            break
    return "blocked"


def site(frames: list[tuple[str, str, int]]) -> tuple[str, bool]:
    """A loop's name (func file:line of its innermost smolforge frame, else Ray's, else the innermost),
    and whether smolforge's code is on the stack."""
    def named(f: tuple[str, str, int]) -> str:
        func, file, line = f
        short = file.split("site-packages/")[-1].split("/src/")[-1]
        return f"{func} ({short}:{line})"
    for f in frames:
        if "/smolforge/" in f[1]:
            return named(f), True
    for f in frames:
        if "/ray/" in f[1]:
            return named(f), False
    return (named(frames[0]) if frames else "?"), False


def parse_dump(text: str) -> list[dict]:
    """py-spy dump's text as threads: {tid, name, idle, frames[(func, file, line)]}."""
    threads: list[dict] = []
    for line in text.splitlines():
        if m := THREAD.match(line):
            threads.append({"tid": m["tid"], "name": m["name"] or "", "idle": "idle" in m["state"], "frames": []})
        elif (m := FRAME.match(line)) and threads:
            threads[-1]["frames"].append((m["func"], m["file"], int(m["line"])))
    return threads


def dump(pyspy: str, pid: int, keep: Path | None = None) -> list[dict] | None:
    """One py-spy dump of a process, parsed; its text kept as keep/PID.txt (the last one)."""
    try:
        got = subprocess.run([pyspy, "dump", "--pid", str(pid), "--full-filenames"], capture_output=True,
                             text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    if got.returncode != 0:
        return None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"{pid}.txt").write_text(got.stdout)
    return parse_dump(got.stdout)


class Sampler:
    """What the run's processes did, sample by sample."""

    def __init__(self, driver: int, pyspy: str | None, keep: Path | None = None):
        self.driver, self.pyspy, self.keep = driver, pyspy, keep
        self.cpu: list[tuple[float, int]] = []  # (seconds since start, driver ticks)
        self.roles: dict[int, Counter] = defaultdict(Counter)  # pid -> its titles seen (a worker's change)
        self.threads_max: Counter = Counter()  # pid -> most threads seen in it
        self.procs_max = 0  # most processes of the run at once
        self.py_names: dict[str, str] = {}  # driver thread id -> its Python name (from the dumps)
        self.wakes: dict[str, list] = {}  # driver thread id -> [name, first count, at, last count, at]
        self.polling: dict[tuple, dict] = {}  # (process role, pid, thread name) -> {own, sites, seen}
        self.loops: dict[str, dict] = {}  # site -> {own, roles, threads max, dumps seen}
        self.dumps = self.dump_failures = 0
        self.driver_threads: Counter = Counter()  # driver thread name -> dumps it was seen in
        self.t0 = time.monotonic()

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.driver)
            return [root] + root.children(recursive=True)
        except psutil.Error:
            return []

    def sample(self) -> None:
        ticks = cpu_ticks(self.driver)
        if ticks is not None:
            self.cpu.append((time.monotonic() - self.t0, ticks))
        procs = self.tree()
        self.procs_max = max(self.procs_max, len(procs))
        for p in procs:
            try:
                self.threads_max[p.pid] = max(self.threads_max[p.pid], p.num_threads())
            except psutil.Error:
                continue
            self.roles[p.pid][role(p, self.driver)] += 1
        now = time.monotonic()
        for tid, (name, n) in thread_wakes(self.driver).items():
            row = self.wakes.setdefault(tid, [name, n, now, n, now])
            row[3:] = [n, now]

    def sort_threads(self) -> None:
        if not self.pyspy:
            return
        for p in self.tree():
            r = role(p, self.driver)
            if r == "gone" or not (p.pid == self.driver or r.startswith("ray::") or is_python(p)):
                continue
            threads = dump(self.pyspy, p.pid, self.keep)
            if threads is None:
                self.dump_failures += 1
                continue
            self.dumps += 1
            seen: Counter = Counter()
            for t in threads:
                if p.pid == self.driver:
                    self.driver_threads[t["name"] or t["tid"]] += 1
                    self.py_names[t["tid"]] = t["name"]
                if classify(t["frames"], t["idle"]) != "poll":
                    continue
                name, own = site(t["frames"])
                seen[name] += 1
                who = self.polling.setdefault((r, p.pid, t["name"] or t["tid"]), {"own": False, "sites": set(), "seen": 0})
                who["own"] |= own
                who["sites"].add(name)
                who["seen"] += 1
                row = self.loops.setdefault(name, {"own": own, "roles": set(), "threads_max": 0, "seen": 0})
                row["roles"].add(r)
                row["seen"] += 1
            for name, n in seen.items():
                self.loops[name]["threads_max"] = max(self.loops[name]["threads_max"], n)

    def report(self, wall: float, min_seen: int) -> dict:
        cpu_s = (self.cpu[-1][1] / CLK_TCK) if self.cpu else None
        per_minute = []
        for k in range(1, int(wall // 60) + 1):
            before = [c for t, c in self.cpu if t <= 60 * k]
            prev = [c for t, c in self.cpu if t <= 60 * (k - 1)] or [0]
            per_minute.append(round((before[-1] - prev[-1]) / CLK_TCK, 2))
        first = [c for t, c in self.cpu if t <= 60] or [0]
        loops = {n: {**v, "roles": sorted(v["roles"])} for n, v in self.loops.items() if v["seen"] >= min_seen}
        own = {n: v for n, v in loops.items() if v["own"]}
        span = max(wall, 1e-9)
        wakes = {tid: {"name": self.py_names.get(tid, name), "python": tid in self.py_names,
                       "seen_s": round(t1 - t0, 1), "wakes_per_s": round((n1 - n0) / max(t1 - t0, 1.0), 2)}
                 for tid, (name, n0, t0, n1, t1) in self.wakes.items()}
        threads = [{"process": r if r == "driver" else f"{r} {pid}", "thread": name, "sites": sorted(v["sites"]),
                    "seen": v["seen"], "own": v["own"]}
                   for (r, pid, name), v in self.polling.items() if v["seen"] >= min_seen]
        procs = []
        for pid, seen in self.roles.items():
            names = [r for r, _ in seen.most_common() if r not in ("gone", "ray::IDLE")] or ["ray::IDLE"]
            procs.append({"pid": pid, "role": max(names, key=len), "threads_max": self.threads_max[pid]})
        return {
            "wall_s": round(wall, 1),
            "driver_cpu_s": cpu_s and round(cpu_s, 2),
            "driver_cpu_s_per_min": cpu_s and round(cpu_s * 60 / span, 2),
            "driver_cpu_s_each_minute": per_minute,
            # the run's own pace, without the first minute's start (imports, the embedded cluster)
            "driver_cpu_s_per_min_after_first": round(
                (self.cpu[-1][1] - first[-1]) / CLK_TCK * 60 / (self.cpu[-1][0] - 60), 2) if len(first) < len(self.cpu)
                and self.cpu[-1][0] > 90 else None,
            "driver_threads_max": self.threads_max.get(self.driver, 0),
            "processes_max": self.procs_max,
            "processes_seen": len(procs),
            "threads_max_sum": sum(p["threads_max"] for p in procs),
            "processes": sorted(procs, key=lambda p: p["role"]),
            "own_polling_threads": sum(t["own"] for t in threads),
            "other_polling_threads": sum(not t["own"] for t in threads),
            "polling_threads": sorted(threads, key=lambda t: (not t["own"], t["process"], t["thread"])),
            "own_polling_loops": sum(v["threads_max"] for v in own.values()),
            "own_loop_sites": own,
            "other_polling_loops": sum(v["threads_max"] for n, v in loops.items() if n not in own),
            "other_loop_sites": {n: v for n, v in loops.items() if n not in own},
            "driver_python_threads_seen": dict(self.driver_threads),
            "driver_python_thread_wakes_per_s": sorted(
                (w for w in wakes.values() if w["python"]), key=lambda w: -w["wakes_per_s"]),
            "driver_other_threads_waking_over_1_per_s": sorted(
                (w for w in wakes.values() if not w["python"] and w["wakes_per_s"] >= 1.0),
                key=lambda w: -w["wakes_per_s"]),
            "dumps": self.dumps, "dump_failures": self.dump_failures,
        }


def distill_cmd(args: argparse.Namespace, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "smolforge.cli.main", "distill", "--teacher", args.teacher, "--student",
            args.student, "--data", "bundled", "--max-samples", str(args.max_samples), "--max-steps",
            str(args.max_steps), "--num-students", "2", "--output-dir", str(out_dir), "--json"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="small-llama")
    ap.add_argument("--student", default="tiny-llama")
    ap.add_argument("--max-samples", type=int, default=256)
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--every", type=float, default=1.0, help="seconds between /proc samples")
    ap.add_argument("--dump-every", type=float, default=5.0, help="seconds between py-spy dumps of every process")
    ap.add_argument("--min-seen", type=int, default=2, help="a loop site counts when seen in this many dumps")
    ap.add_argument("--timeout", type=float, default=1200.0, help="give up on the run after this many seconds")
    ap.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="distill-loops-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_TMPDIR": str(work / "ray"),
           "SMOLFORGE_COORDINATOR": "", "SMOLFORGE_RAY_ADDRESS": "", "SMOLFORGE_HOME": str(work / "home")}
    pyspy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    log = open(work / "run.log", "w")
    t0 = time.monotonic()
    run = subprocess.Popen(distill_cmd(args, work / "run"), env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    sampler = Sampler(run.pid, pyspy, work / "dumps")
    next_dump = t0 + args.dump_every
    try:
        while run.poll() is None and time.monotonic() - t0 < args.timeout:
            sampler.sample()
            if time.monotonic() >= next_dump:
                sampler.sort_threads()
                next_dump = time.monotonic() + args.dump_every
            time.sleep(args.every)
    finally:
        if run.poll() is None:
            run.terminate()
        stdout, _ = run.communicate(timeout=120)
    wall = time.monotonic() - t0
    for tree in ("ray", "run", "home"):  # kept: run.log and the last dumps
        shutil.rmtree(work / tree, ignore_errors=True)
    report = {"command": " ".join(distill_cmd(args, Path("OUT"))[1:]), "rc": run.returncode,
              "code": os.environ.get("PYTHONPATH", ""), "py_spy": bool(pyspy), "load_avg_1m": os.getloadavg()[0],
              **sampler.report(wall, args.min_seen), "log": str(work / "run.log"), "last_dumps": str(work / "dumps")}
    try:
        summary = json.loads(stdout[stdout.index("{"):])
        report["summary"] = {k: summary.get(k) for k in ("seconds", "stage_seconds")}
        report["summary"]["student_steps"] = [s.get("steps") for s in summary.get("per_student", [])]
    except (ValueError, IndexError):
        report["stdout_tail"] = stdout[-2000:]
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
