"""The seeds' API shapes without a cluster: node dicts, per-backend model advertising and placement,
TaskConfig, the seeds' PEFT keys and call signatures. (test_seeds_api.py runs the calls on a cluster.)"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import pytest

from smolforge.errors import SmolforgeError


@dataclass
class Node:
    name: str
    models: list[str] = field(default_factory=list)
    ollama_models: list[str] = field(default_factory=list)
    gpus: float = 0
    cpus: float = 2
    alive: bool = True
    takes_work: bool = True

    @property
    def node_id(self):
        return "id-" + self.name

    @property
    def resources(self):
        return {**{f"model:{m}": 1000 for m in self.models}, **{f"ollama:{m}": 1000 for m in self.ollama_models}}


def test_a_model_held_only_as_an_ollama_tag_is_advertised_and_placed_for_ollama_only(tmp_path):
    from smolforge.cluster.nodes import ray_glue
    from smolforge.cluster.nodes.discovery import by_backend, scan_hf_cache, with_aliases
    from smolforge.distill.planner import model_nodes

    # discovery: an Ollama tag and its HF alias load with Ollama only; cached weights and their alias with HF
    cache = tmp_path / "hub"
    (cache / "models--Qwen--Qwen2.5-1.5B-Instruct" / "snapshots" / "a").mkdir(parents=True)
    (cache / "models--Qwen--Qwen2.5-1.5B-Instruct" / "snapshots" / "a" / "config.json").write_text("{}")
    models = with_aliases({**scan_hf_cache(cache), "qwen2.5:0.5b": "ollama"})
    assert by_backend(models) == {"hf": ["Qwen/Qwen2.5-1.5B-Instruct", "qwen2.5:1.5b"],
                                  "ollama": ["Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5:0.5b"]}
    res = ray_glue.advertised_models(models)
    assert "model:qwen2.5:1.5b" in res and "ollama:qwen2.5:0.5b" in res
    assert "model:Qwen/Qwen2.5-0.5B-Instruct" not in res and "model:qwen2.5:0.5b" not in res
    node = ray_glue._node_from_ray({"NodeID": "n1", "Alive": True,
                                    "Resources": {"CPU": 2, ray_glue.WORKER_RESOURCE: 2, **res}}, {})
    assert node.models == ["Qwen/Qwen2.5-1.5B-Instruct", "qwen2.5:1.5b"]
    assert node.ollama_models == ["Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5:0.5b"]

    # placement: an hf teacher never lands on the Ollama-only node (it would download the weights)
    ollama_box = Node("ollama-box", ollama_models=["qwen2.5:0.5b", "Qwen/Qwen2.5-0.5B-Instruct"], gpus=1)
    weights_box = Node("weights-box", models=["Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5:0.5b"])
    nodes = [ollama_box, weights_box, Node("bare")]
    for name in ("qwen2.5:0.5b", "Qwen/Qwen2.5-0.5B-Instruct"):
        chosen, req = model_nodes(nodes, name, backend="hf")
        assert [n.name for n in chosen] == ["weights-box"] and req == name
        chosen, req = model_nodes(nodes, name, backend="ollama")
        assert [n.name for n in chosen] == ["ollama-box"] and req == name
    with pytest.raises(SmolforgeError, match="no node holds teacher model 'qwen2.5:0.5b' as weights") as err:
        model_nodes([ollama_box], "qwen2.5:0.5b", backend="hf")
    assert "Ollama: qwen2.5:0.5b" in err.value.render()
    with pytest.raises(SmolforgeError, match="as an Ollama tag") as err:
        model_nodes([weights_box], "qwen2.5:0.5b", backend="ollama")
    assert "ollama pull qwen2.5:0.5b" in err.value.render()
    # the Ray request names the backend's resource
    req = ray_glue.Requirements(model="qwen2.5:0.5b", model_backend="ollama")
    assert req.per_task(False) == {"CPU": 1.0, ray_glue.WORKER_RESOURCE: 1.0}
    assert "ollama:qwen2.5:0.5b" in req._resources(False)[2]
    weights_only = ray_glue._node_from_ray({"NodeID": "n2", "Alive": True, "Resources": {
        "CPU": 2, ray_glue.WORKER_RESOURCE: 2, "model:qwen2.5:0.5b": 1000}}, {})
    assert req.reasons(weights_only) == ["does not hold model qwen2.5:0.5b in Ollama"]
    assert req.reasons(node) == []


def test_node_dicts_carry_the_seeds_nested_resources_beside_the_flat_keys():
    from smolforge.cluster.nodes import ray_glue
    from smolforge.cluster.nodes.nodeview import node_view

    raw = {"NodeID": "n1", "Alive": True, "Labels": {ray_glue.NAME_LABEL: "gpu-box", ray_glue.RAM_LABEL: "31.3",
                                                      ray_glue.GPU_MEM_LABEL: "24", ray_glue.GPU_TYPE_LABEL: "RTX"},
           "Resources": {"CPU": 8, "GPU": 1, "memory": 2e10, ray_glue.WORKER_RESOURCE: 8, "model:tiny-llama": 1000,
                         "ollama:qwen2.5:7b": 1000}}
    n = node_view(ray_glue._node_from_ray(raw, {}), state="online",
                  usage={"ram_total_gb": 31.3, "ram_used_gb": 11.3})
    assert (n["cpus"], n["gpus"], n["ram_gb"], n["models"], n["ollama_models"]) == (8, 1, 31.3, ["tiny-llama"],
                                                                                    ["qwen2.5:7b"])
    r = n["resources"]
    assert r["gpu"]["count"] == 1 and r["gpu"]["memory_gb"] == 24 and r["gpu"]["type"] == "RTX"
    assert r["cpu"]["cores"] == 8 and r["memory"] == {"total_gb": 31.3, "available_gb": 20.0}
    assert r["ollama_models"] == [{"name": "qwen2.5:7b"}]
    assert n["ray_resources"]["memory"] == 2e10 and n["state"] == "online"


def test_task_config_maps_onto_jobs_and_tasks():
    import smolforge
    from smolforge.cluster.workloads.distill.seed_args import resolve, student_args, task_options
    from smolforge.cluster.control.specs import DataParallelJob

    heavy = smolforge.TaskConfig(name="heavy_training", type="training", priority="high",
                                 resources=smolforge.ResourceConfig(gpu_memory_gb=24, cpu_cores=8, ram_gb=64),
                                 max_retries=3, checkpointing=True)
    job = DataParallelJob.model_validate({"train": {"model": "tiny-llama", "data": {"path": "bundled"}, "max_steps": 50},
                                          **heavy.job_fields()})
    assert (job.name, job.priority, job.cpus_per_worker, job.min_ram_gb, job.gpu_memory_gb, job.max_retries,
            job.train.save_every, job.gpu) == ("heavy_training", "high", 8, 64, 24, 3, 10, "required")  # as launch
    with pytest.raises(SmolforgeError, match="cannot honour resources.ram_gb, resources.gpu_memory_gb, priority"):
        task_options(heavy, "teacher")
    light = smolforge.TaskConfig(resources=smolforge.ResourceConfig(cpu_cores=2), max_retries=1, checkpointing=False)
    assert task_options(light, "student") == {"cpus": 2, "max_retries": 1, "checkpointing": False}
    with pytest.raises(SmolforgeError, match="a teacher keeps every shard"):
        task_options(light, "teacher")
    with pytest.raises(SmolforgeError, match="cpus_per_student is 1 but the TaskConfig says 2"):
        resolve("cpus_per_student", 1, 2, 1.0)
    with pytest.raises(SmolforgeError, match="priority: Input should be 'high', 'normal' or 'low'"):
        smolforge.TaskConfig(priority="urgent")
    # create_student_tasks' seed arguments: lora_config, and a TaskConfig's checkpointing and retries
    args = student_args("lora", None, {"r": 4, "alpha": 8}, smolforge.TaskConfig(checkpointing=True, max_retries=1),
                        None, None, None)
    assert (args.peft.r, args.peft.alpha, args.cpus, args.save_every, args.max_retries) == (4, 8, 1.0, 50, 1)
    assert student_args("ia3", {}, None, light, None, None, None).save_every == 0
    with pytest.raises(SmolforgeError, match="lora_config is peft_type='lora' with that peft_config"):
        student_args("prefix", None, {"r": 4}, None, None, None, None)
    with pytest.raises(SmolforgeError, match="turns checkpointing off but save_every is 10"):
        student_args("lora", None, None, light, None, 10, None)


def test_the_seeds_peft_keys_and_call_signatures():
    from smolforge.cluster.workloads.distill.students import StudentTasks
    from smolforge.cluster.workloads.distill.teachers import TeacherTasks
    from transformers import LlamaConfig, LlamaForCausalLM

    from smolforge.models.houlsby import BottleneckAdapter
    from smolforge.models.peft_methods import apply_peft, peft_spec_from_config

    spec = peft_spec_from_config("prompt", {"num_virtual_tokens": 30, "prompt_tuning_init": "TEXT",
                                            "prompt_tuning_init_text": "Answer:"})
    assert (spec.num_virtual_tokens, spec.prompt_tuning_init, spec.prompt_tuning_init_text) == (30, "TEXT", "Answer:")
    assert peft_spec_from_config("lora", {"r": 4, "alpha": 8, "dropout": 0.1}).r == 4
    assert peft_spec_from_config("ia3", {}).method == "ia3"
    adapter = peft_spec_from_config("adapter", {"reduction_factor": 16})
    model = apply_peft(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=4)), adapter)
    down = next(m.down for m in model.modules() if isinstance(m, BottleneckAdapter))
    assert down.out_features == model.config.hidden_size // 16
    with pytest.raises(SmolforgeError, match="reduction_fctor: Extra inputs are not permitted"):
        peft_spec_from_config("adapter", {"reduction_fctor": 16})

    params = list(inspect.signature(TeacherTasks.create_parallel_teacher_tasks).parameters)
    assert params[1:7] == ["model_path", "dataset_path", "output_dir", "num_teachers", "batch_size", "compress_outputs"]
    params = inspect.signature(StudentTasks.create_student_tasks).parameters
    assert {"lora_config", "peft_type", "peft_config", "task_config"} <= set(params)
