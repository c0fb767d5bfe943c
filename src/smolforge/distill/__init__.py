"""Teacher→student distillation, the pure parts: teacher backends (hf, ollama, reference), the top-k
logit store, KD losses, streaming students, adapter aggregation, the planner and the run settings.

Nothing here imports Ray (an import-linter contract keeps it so): running teachers and students on
the cluster is `smolforge.cluster.workloads.distill`.
"""
