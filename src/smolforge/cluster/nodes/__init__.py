"""The machines of the cluster and the Ray processes on them.

- `ray_process.py`, `ray_loopback.py`, `ray_session.py`, `ray_glue.py`: starting, joining, reaping and
  talking to Ray; `ray_tls.py`, `ray_auth.py`: Ray's TLS and token; `tls.py`: the API's certificate
- `worker.py`: `smolforge worker join`; `node_agent.py`, `heartbeat.py`: a node's agent and health
- `discovery.py`: what a machine offers (CPUs, RAM, GPUs, models); `nodeview.py`: how a node reads
- `statedir.py`: the coordinator's state directory
"""
