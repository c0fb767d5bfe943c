"""The job control plane: what a job is and how it moves, for every kind alike.

- `kinds.py`     the job-kind registry: spec, demand, runner and view of each kind, in one entry
- `specs.py`     the specs users submit (YAML, `launch`, `Client.submit_job`), validated once
- `manager.py`   accepts jobs, queues them, starts one runner per active job
- `queue.py`     which waiting jobs start now, and why the others wait
- `placement.py` which node: every kind's node choices, pure functions over the node table (a model's
                 need and travel, a data-parallel round and joiner, a trunk, an export, students)
- `stage_plan.py` which nodes run a model's stages and their layer ranges (`plan_stages`, `plan_serving`),
                 and a served stage's candidates, probes and re-placement
- `runner.py`    the runner base: a job's lifecycle (attempts, outcomes, the policy, state moves)
- `states.py`    a job's states and the moves it may make
- `policy.py`    one failure policy for every kind: retry from the last checkpoint, or give up
- `jobstore.py`  SQLite (WAL): jobs, events, metrics; survives a coordinator restart
- `artifacts.py` checksummed directories that jobs produce and consume
- `jobview.py`   how a job reads to a person or a script

Nothing here names a kind: the kinds live in `cluster/workloads/`, one package each.
"""
