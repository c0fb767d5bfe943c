"""Model parallelism and serving: stage partitioning, the generation engine and the OpenAI-compatible API.

No Ray here (import-linter says so): the engine runs in one process; multi-stage serving places
stage actors from `cluster/` and reuses the engine's batch step.
"""
