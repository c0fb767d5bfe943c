"""End to end: 2 teachers + 2 streaming students against 1 teacher followed by 1 student.

Same cluster (the embedded one of this machine unless --address is given), same prompts, same
teacher settings and the same total number of student steps (2 × S/2 against 1 × S). The
baseline runs the teacher to completion, then starts its student; the parallel run starts
everything at once and students train on shards as they land.

    python bench/distill_e2e.py --prompts 512 --student-steps 60
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="small-llama")
    ap.add_argument("--student", default="tiny-llama")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--student-steps", type=int, default=60, help="total student steps (split over 2 in parallel)")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--num-shards", type=int, default=16)
    ap.add_argument("--address", default=None, help="Ray address of a running cluster (default: embedded)")
    args = ap.parse_args()

    import transformers

    transformers.utils.logging.set_verbosity_error()
    from types import SimpleNamespace

    from smolforge.cluster.nodes import ray_glue
    from smolforge.orchestrator import Orchestrator

    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="sfb", dir="/tmp"))
    handle = ray_glue.connect(args.address)
    backend = SimpleNamespace(handle=handle, close=lambda: None)
    work = Path(tempfile.mkdtemp(prefix="distill-e2e-"))
    teach = dict(max_samples=args.prompts, max_new_tokens=args.max_new_tokens, top_k=32, batch_size=32,
                 num_shards=args.num_shards, device="cpu")
    stud = dict(peft_type="lora", peft_config={"r": 8, "alpha": 16, "dropout": 0.0}, batch_size=16, lr=1e-3,
                device="cpu")
    def warm_up(tag: str) -> None:
        """Two warm Ray task workers with the teacher loaded once, before each run (Ray reaps idle
        workers above its soft limit, so a run after a student actor would otherwise pay a cold start)."""
        o = Orchestrator("teacher_student", backend=backend)
        w = o.create_parallel_teacher_tasks(args.teacher, "bundled", work / f"warm-{tag}", max_samples=8,
                                            num_teachers=2, max_new_tokens=2, num_shards=2, device="cpu")
        o.wait_distill(w, timeout=900)
        o.shutdown_distill()

    try:
        warm_up("seq")
        orch = Orchestrator("teacher_student", backend=backend)
        t0 = time.perf_counter()
        [t] = orch.create_parallel_teacher_tasks(args.teacher, "bundled", work / "seq", num_teachers=1, **teach)
        orch.wait_distill([t], timeout=3600)
        t_teacher = time.perf_counter() - t0
        s = orch.create_student_tasks(args.student, work / "seq" / "teacher_outputs", num_students=1,
                                      max_steps=args.student_steps, **stud)
        orch.wait_distill(s, timeout=3600)
        seq = time.perf_counter() - t0
        orch.shutdown_distill()

        warm_up("par")
        orch = Orchestrator("hybrid", backend=backend)
        t0 = time.perf_counter()
        ts = orch.create_parallel_teacher_tasks(args.teacher, "bundled", work / "par", num_teachers=2, **teach)
        ss = orch.create_student_tasks(args.student, work / "par" / "teacher_outputs", num_students=2,
                                       max_steps=args.student_steps // 2, **stud)
        orch.wait_distill(ts, timeout=3600)
        p_teacher = time.perf_counter() - t0
        orch.wait_distill(ss, timeout=3600)
        par = time.perf_counter() - t0
        first = min(e["ts"] for e in orch.events if e["kind"] == "student_started") - (t0 - time.perf_counter() + time.time())
        if os.environ.get("BENCH_TIMELINE"):
            base = orch.events[0]["ts"]
            for e in orch.events:
                if e["kind"] not in ("student_shard",):
                    print(f"  {e['ts'] - base:6.2f} {e['kind']}: {e['message']}")
        orch.shutdown_distill()
        cpus = sum(n.cpus for n in handle.nodes() if n.takes_work)
        print(f"cluster: {len(handle.nodes())} nodes, {cpus:g} worker CPUs; teacher {args.teacher}, student {args.student}, "
              f"{args.prompts} prompts, {args.student_steps} student steps in total")
        print(f"1 teacher then 1 student   : {seq:.1f}s (teacher {t_teacher:.1f}s)")
        print(f"2 teachers + 2 streaming   : {par:.1f}s (teachers {p_teacher:.1f}s, first student step at {first:.1f}s)")
        print(f"ratio (parallel / sequential): {par / seq:.2f}")
    finally:
        handle.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
