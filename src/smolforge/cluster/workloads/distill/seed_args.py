"""The seeds' arguments on teacher and student tasks: their `TaskConfig` (what those tasks can honour,
and a refusal that says where the rest applies: nothing in it is silently ignored), `lora_config`
and the PEFT keys they write. Kept here so the task code only sees smolforge's own settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from smolforge.cluster.control.specs import TaskConfig
from smolforge.config import PeftSpec
from smolforge.errors import SmolforgeError
from smolforge.models.peft_spec import peft_spec_from_config


def task_options(task_config: TaskConfig | None, role: Literal["teacher", "student"]) -> dict[str, Any]:
    """The settings a teacher or student task takes from `task_config`: `cpus` (resources.cpu_cores),
    `max_retries` and, for students, `checkpointing`.

    Teacher and student tasks start at once on nodes that hold their model: they have no queue for
    `priority` to order, and reserve no RAM or GPU memory. Those belong to jobs, which the queue
    places (`Client.submit_job`, `create_data_parallel_tasks(task_config=...)`); asking for them
    here is an error rather than a request that would be quietly dropped.
    """
    if task_config is None:
        return {}
    res = task_config.resources
    refused = [f"resources.{k}" for k in ("ram_gb", "gpu_memory_gb", "gpu_ids")
               if res is not None and getattr(res, k) is not None]
    if task_config.priority != "normal":
        refused.append(f"priority {task_config.priority!r}")
    if role == "teacher" and task_config.checkpointing is False:
        refused.append("checkpointing False (a teacher keeps every shard it writes)")
    if refused:
        raise SmolforgeError(
            f"a {role} task cannot honour {', '.join(refused)} from its TaskConfig", where="task_config",
            fix=f"{role} tasks take resources.cpu_cores, max_retries and checkpointing; priority and RAM/GPU "
                "requests are for jobs the queue places: Client().submit_job({...}) or "
                "create_data_parallel_tasks(..., task_config=...)")
    out: dict[str, Any] = {}
    if res is not None and res.cpu_cores is not None:
        out["cpus"] = res.cpu_cores
    if task_config.max_retries is not None:
        out["max_retries"] = task_config.max_retries
    if role == "student" and task_config.checkpointing is not None:
        out["checkpointing"] = task_config.checkpointing
    return out


def resolve(name: str, given: Any, from_config: Any, default: Any) -> Any:
    """One setting given as an argument and/or by the TaskConfig: they must agree; else the default."""
    if given is not None and from_config is not None and given != from_config:
        raise SmolforgeError(f"{name} is {given} but the TaskConfig says {from_config}: they set the same thing",
                             where="task_config", fix="give one of them")
    return given if given is not None else (from_config if from_config is not None else default)


@dataclass
class StudentArgs:
    peft: PeftSpec
    cpus: float
    save_every: int
    max_retries: int | None  # None: the orchestrator's default for restarts after a lost worker


def student_args(peft_type: str, peft_config: dict[str, Any] | None, lora_config: dict[str, Any] | None,
                 task_config: TaskConfig | None, cpus: float | None, save_every: int | None,
                 max_retries: int | None) -> StudentArgs:
    """create_student_tasks' settings from the seeds' spellings: `lora_config` (peft_type lora with that
    config), `peft_config` with their keys, and a TaskConfig's cpu_cores, max_retries and
    checkpointing (false: no checkpoints; true: every 50 steps unless save_every is set)."""
    if lora_config is not None:
        from smolforge.models.peft.lora import LoRA

        if peft_config is not None or peft_type != LoRA.name:  # the seeds' lora_config is LoRA's by its name
            raise SmolforgeError("lora_config is peft_type='lora' with that peft_config: give one of them",
                                 where="create_student_tasks", fix="pass either lora_config or peft_type + peft_config")
        peft_config = lora_config
    opts = task_options(task_config, "student")
    checkpointing = opts.get("checkpointing")
    if checkpointing is False and save_every:
        raise SmolforgeError(f"the TaskConfig turns checkpointing off but save_every is {save_every}",
                             where="task_config", fix="drop one of them")
    return StudentArgs(peft=peft_spec_from_config(peft_type, peft_config, where="peft_config"),
                       cpus=resolve("cpus_per_student", cpus, opts.get("cpus"), 1.0),
                       save_every=save_every or (50 if checkpointing else 0),
                       max_retries=resolve("max_retries", max_retries, opts.get("max_retries"), None))
