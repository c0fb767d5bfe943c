"""A data-parallel job on the cluster: N rank actors that form a torch.distributed group and train together.

- `runner.py`       the job's runner: places the group, watches it, regroups or retries on a loss
- `worker_group.py` N rank actors placed together (a placement group), started and released together
- `rank.py`         one rank: a Ray actor that runs the ordinary training engine with its strategy (it meets
                    its group through `parallel/rendezvous.py`)
- `job_control.py`  the per-job control actor the ranks talk to (pause, cancel, joins, reports)
- `param_server.py` the parameter-server actor around a strategy's `ServerCore`
- `reports.py`      what the ranks report, sorted into the job store and the sinks
"""
