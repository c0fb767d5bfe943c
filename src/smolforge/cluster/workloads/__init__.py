"""The workload drivers: one package per job kind, each a runner plus the Ray actors it places.

- `data_parallel/` a worker group of ranks (`rank.py`), its job-control and parameter-server actors
- `distill/`       teachers, streaming students, rotation and aggregation
- `serve/`         a model served from stage actors behind the OpenAI-compatible API
- `export/`        one task on a node that holds the model
"""
