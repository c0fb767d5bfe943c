#!/usr/bin/env python3
"""The seed documents' Python API, called the way their guides write it; only the import lines differ
(`from smolforge import ...` where they have `from src.sollol_integration import ...` and
`from sollol import SOLLOLClient`).

Run it on the coordinator's machine, in an empty directory (it writes ./teacher_outputs, ./output,
./merged_model as the seeds do): `create_distributed_training(...)` and `SOLLOLClient()` find the
coordinator and its token through the state dir ($SMOLFORGE_HOME, default ~/.smolforge).

    smolforge coordinator start &
    smolforge worker join 127.0.0.1:5000 --token-file ~/.smolforge/token --name w1 &
    smolforge worker join 127.0.0.1:5000 --token-file ~/.smolforge/token --name w2 &
    python examples/seeds_api.py --teacher tiny-llama --student tiny-llama --data prompts.jsonl

tests/cluster/test_seeds_api.py runs it against a real local cluster with tiny models and data.
"""

import argparse
import time

from smolforge import Client as SOLLOLClient
from smolforge import ResourceConfig, TaskConfig, create_distributed_training
from smolforge.errors import SmolforgeError


def main():
    parser = argparse.ArgumentParser(description="The seeds' teacher-student and client API on smolforge")
    parser.add_argument("--teacher", default="qwen2.5:3b", help="Teacher model")
    parser.add_argument("--student", default="qwen2.5:0.5b", help="Student model")
    parser.add_argument("--data", default="data/training.jsonl", help="Dataset path (JSONL)")
    parser.add_argument("--max-samples", type=int, default=1000, help="Limit dataset samples")
    parser.add_argument("--job-steps", type=int, default=400, help="steps of the client's data-parallel job")
    args = parser.parse_args()

    # -- TEACHER_STUDENT_GUIDE.md: connect, discover ------------------------------------------------
    orchestrator = create_distributed_training(mode="teacher_student", config={})
    nodes = orchestrator.discover_nodes()
    for node in nodes:
        resources = node.get('resources', {})
        cpu = resources.get('cpu', {})
        mem = resources.get('memory', {})
        gpu = resources.get('gpu', {})
        print(f"    {node['name']}: {cpu.get('cores', 0)} CPUs, {mem.get('total_gb', 0):.1f}GB RAM, "
              f"{gpu.get('count', 0)} GPUs; Ollama models: "
              f"{', '.join(m['name'] for m in resources.get('ollama_models', [])) or 'none'} "
              f"(flat: {node['ollama_models']})")
    gpu_nodes = [n for n in nodes if n['resources']['gpu']['count'] > 0]
    if not gpu_nodes:
        print("[!] No GPU nodes detected - using CPU-optimized workflow")

    # -- one teacher, monitored with the guide's callback ----------------------------------------------
    teacher_task_id = orchestrator.create_teacher_task(
        model_path=args.teacher,
        dataset_path=args.data,
        output_dir="./teacher_outputs",
        batch_size=8,
        max_samples=args.max_samples
    )
    print(f"[✓] Teacher task created: {teacher_task_id}")

    def teacher_callback(task_id, status):
        state = status.get('state', 'unknown')
        assert state in ('pending', 'running', 'completed', 'failed'), state
        if state == 'running':
            print(f"      Progress: {status.get('progress', 0)}")
        elif state == 'completed':
            print("      Progress: 100%")
        elif state == 'failed':
            print(f"[✗] Teacher task failed: {status.get('error', 'Unknown error')}")

    orchestrator.monitor_tasks([teacher_task_id], callback=teacher_callback)
    print("[✓] Teacher outputs generated")

    # -- students (the guide's LoRA call), monitored, then merged ----------------------------------------
    student_task_ids = orchestrator.create_student_tasks(
        base_model=args.student,           # Smaller student model
        teacher_outputs_dir="./teacher_outputs",
        num_students=2,                      # Number of student nodes
        peft_type="lora",                    # PEFT method (lora, prefix, prompt, adapter, ia3)
        peft_config={                        # LoRA-specific config
            "r": 8,
            "alpha": 16,
            "dropout": 0.05
        }
    )

    # -- the other PEFT methods of the peft_methods example, and lora_config as the CPU guide writes it
    #    (created now: they queue for a free node while the two above train) -------------------------------
    light = TaskConfig(name="light", type="training", resources=ResourceConfig(cpu_cores=1), max_retries=1,
                       checkpointing=True)
    peft_students = orchestrator.create_student_tasks(
        base_model=args.student,
        teacher_outputs_dir="./teacher_outputs",
        num_students=1,
        lora_config={"r": 8, "alpha": 16},
        task_config=light,
    )
    for peft_type, peft_config in [
        ("prefix", {"num_virtual_tokens": 30}),
        ("prompt", {"num_virtual_tokens": 8, "prompt_tuning_init": "TEXT",  # or "RANDOM"
                    "prompt_tuning_init_text": "Answer the question:"}),
        ("adapter", {"reduction_factor": 16}),
        ("ia3", {}),
    ]:
        peft_students += orchestrator.create_student_tasks(
            base_model=args.student,
            teacher_outputs_dir="./teacher_outputs",
            num_students=1,
            peft_type=peft_type,
            peft_config=peft_config
        )

    def on_task_update(task_id, status):
        assert status['state'] in ('pending', 'running', 'completed', 'failed'), status['state']
        if status['state'] == 'completed':
            print(f"✓ {task_id} finished!")
        elif status['state'] == 'failed':
            print(f"✗ {task_id} failed: {status.get('error')}")

    orchestrator.monitor_tasks(student_task_ids, callback=on_task_update)
    print("[i] Student adapters: ./output/student_0, ./output/student_1")
    orchestrator.aggregate_student_outputs(
        student_output_dirs=["./output/student_0", "./output/student_1"],
        output_path="./merged_model"
    )
    print("[✓] Merged adapter: ./merged_model/final_adapter")
    orchestrator.monitor_tasks(peft_students, callback=on_task_update)
    print(f"[✓] Trained {len(peft_students)} more students")

    # -- CPU_OPTIMIZATION_GUIDE.md: parallel teachers, rotation ---------------------------------------
    teacher_ids = orchestrator.create_parallel_teacher_tasks(
        model_path=args.teacher,
        dataset_path=args.data,
        output_dir="./parallel/teacher_outputs",
        num_teachers=None,  # Auto-detect (one per node)
        batch_size=2,  # Small batches for CPU
        compress_outputs=True  # Reduce disk I/O
    )
    print(f"[✓] Created {len(teacher_ids)} parallel teachers")
    orchestrator.monitor_tasks(teacher_ids)
    orchestrator.reassign_idle_teacher_as_student(teacher_ids[0])

    # -- the guide's TaskConfig: what a teacher task cannot honour is refused, saying where it applies ----
    task_config = TaskConfig(
        name="heavy_training",
        type="training",
        priority="high",
        resources=ResourceConfig(
            gpu_memory_gb=24,    # Needs 24GB GPU
            cpu_cores=8,         # Needs 8 CPU cores
            ram_gb=64            # Needs 64GB RAM
        ),
        max_retries=3,
        checkpointing=True
    )
    try:
        orchestrator.create_teacher_task(model_path=args.teacher, dataset_path=args.data,
                                         output_dir="./teacher_outputs", task_config=task_config)
    except SmolforgeError as err:
        print(f"[i] refused: {err.what}")

    # -- the SOLLOL client, on the coordinator's machine ---------------------------------------------------
    client = SOLLOLClient()
    print(f"[i] nodes: {[n['name'] for n in client.list_nodes()]}")
    try:
        client.submit_job({"model": args.student, "dataset": args.data,
                           "resources": {"gpu_ids": [0, 1], "cpu_cores": 16, "ram_gb": 32}})
    except SmolforgeError as err:
        print(f"[i] no node here could ever run that request: {err.what.splitlines()[0]}")
    job_id = client.submit_job({"model": args.student, "dataset": args.data, "num_workers": 1,
                                "resources": {"cpu_cores": 1}}, overrides=[f"max_steps={args.job_steps}"])
    deadline = time.time() + 180
    while client.get_job_status(job_id)["state"] != "running" and time.time() < deadline:
        time.sleep(0.5)
    jobs = client.list_jobs()
    client.join_job(jobs[0]['id'])  # Join latest job
    print(f"[i] {jobs[0]['id']}: {client.get_job_status(job_id)['state']}")
    print(f"[i] pause asked: {client.pause_job(job_id)['state']}")
    print(f"[i] paused: {client.wait_for_job(job_id, timeout=180)['state']}")  # it pauses after its step
    print(f"[i] resumed: {client.resume_job(job_id)['state']}")
    print(f"[i] cancelled: {client.cancel_job(job_id)['state']}")
    print("[✓] SEEDS API OK")


if __name__ == "__main__":
    main()
