#!/usr/bin/env python3
"""The seeds' teacher and student tasks are cluster jobs: they outlive the script that made them.

The first run makes a teacher task and, as the seeds' guide advises when a machine runs out of
memory, one student with a small LoRA on that teacher's outputs (`create_student_tasks` without
`teacher_outputs_dir` takes this orchestrator's last teacher task's, and says so). It prints the task
ids and follows them; stop it (Ctrl-C, a kill, a closed laptop): on a coordinator the tasks run on,
`smolforge jobs` lists them, and any other script follows them by id:

    smolforge coordinator start &
    smolforge worker join 127.0.0.1:5000 --token-file ~/.smolforge/token --name w1 &
    python examples/seeds_tasks_as_jobs.py --teacher tiny-llama --student tiny-llama --data prompts.jsonl
    python examples/seeds_tasks_as_jobs.py --follow job-…-teacher-0 job-…-student-0

tests/cluster/test_seeds_api.py runs it against a real local cluster with tiny models and data.
"""

import argparse
import json

from smolforge import create_distributed_training


def main():
    parser = argparse.ArgumentParser(description="The seeds' tasks as jobs: make them, or follow them by id")
    parser.add_argument("--teacher", default="qwen2.5:3b", help="Teacher model")
    parser.add_argument("--student", default="qwen2.5:0.5b", help="Student model")
    parser.add_argument("--data", default="data/training.jsonl", help="Dataset path (JSONL)")
    parser.add_argument("--max-samples", type=int, default=1000, help="Limit dataset samples")
    parser.add_argument("--follow", nargs="+", metavar="TASK_ID", help="follow these tasks (from any process)")
    args = parser.parse_args()

    orchestrator = create_distributed_training(mode="teacher_student", config={})
    if args.follow:
        def on_update(task_id, status):
            print(f"[i] {task_id}: {status['state']} ({100 * float(status.get('progress') or 0):.0f}%)", flush=True)

        final = orchestrator.monitor_tasks(args.follow, callback=on_update)
        print("[✓] FINAL " + json.dumps({t: s["state"] for t, s in final.items()}), flush=True)
        return

    teacher_task_id = orchestrator.create_teacher_task(
        model_path=args.teacher,
        dataset_path=args.data,
        output_dir="./teacher_outputs",
        batch_size=8,
        max_samples=args.max_samples
    )
    # TEACHER_STUDENT_GUIDE.md, "Out of memory": fewer students, a smaller LoRA rank
    student_task_ids = orchestrator.create_student_tasks(
        base_model=args.student,
        num_students=1,
        peft_type="lora",
        peft_config={"r": 4}
    )
    print("[✓] TASKS " + " ".join([teacher_task_id] + student_task_ids), flush=True)
    orchestrator.monitor_tasks([teacher_task_id] + student_task_ids,
                               callback=lambda task_id, status: print(f"[i] {task_id}: {status['state']}", flush=True))
    print("[✓] done: ./teacher_outputs, ./output/student_0")


if __name__ == "__main__":
    main()
