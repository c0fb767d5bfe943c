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
- `states`     JobState: the legal moves between job states, which ones are final
- `policy`     FailurePolicy: retry from the last checkpoint or give up, with a reason, for every kind
- `jobs`       the job-kind registry: each kind's spec, runner, uploads, checks
- `manager`    the job manager: submit, one runner per active job, pause/resume/cancel/join, recovery
- `runners/`   `base` (what every runner shares) and `data_parallel`; `distill/` holds the distill runner
- `placement`  where a data-parallel job's ranks may go, and how many fit on a node
- `distill/`   distillation on the cluster: teacher tasks, shard broker, student actors, the run loop
- `embedded`   the cluster of one machine when no coordinator runs (same manager, same runners)
- `api`        the FastAPI control service
- `coordinator` and `worker`: the two long-running commands

Importing this package is cheap; Ray and torch are imported where they are used.
"""
