"""The cluster: a coordinator (Ray head + control service) and workers that join it.

Modules, one concept each:
- `statedir`   where the coordinator keeps its token, job store, artifacts and address file
- `auth`       the one shared token (Ray token auth and the API's bearer token)
- `discovery`  what this machine has: CPUs, RAM, GPUs, models
- `ray_glue`   connect to a cluster (or start the embedded one), node table, requirements -> Ray options
- `ray_process` `ray start` for the head and for workers, stopped only by the PIDs we started
- `node_agent` one actor per node that publishes live usage to the coordinator
- `jobstore`   SQLite (WAL): jobs, tasks, events, metrics
- `artifacts`  content-checksummed files and directories that jobs produce and consume
- `job_control` the per-job actor that workers talk to (stop flags, progress, artifact upload)
- `scheduler`  the job manager: runs jobs, recovers from failures, pause/resume/cancel/join
- `api`        the FastAPI control service
- `coordinator` and `worker`: the two long-running commands

Importing this package is cheap; Ray and torch are imported where they are used.
"""
