"""The cluster: a coordinator (Ray head + control service) and workers that join it.

Three layers, each importing only the ones below it (import-linter checks it, type-checking
imports included):
- the services at the top: `coordinator` (the long-running command), `api` and `api_input` (the
  FastAPI control service and what it accepts), `metrics` (Prometheus), `embedded` (the cluster of
  one machine when no coordinator runs: same manager, same runners), `embedded_dashboard`, and
  `face`: the `Backend` protocol `smolforge.Client` and `embedded` implement, and the names `cli/` and
  the Orchestrator use of `workloads/` and `nodes/` (they import neither directly)
- `workloads/`: one package per job kind (data parallel, distill, serve, export): a runner and the
  Ray actors it places
- `control/`: the job control plane every kind shares: the kind registry, manager, queue, states,
  failure policy, job store, specs, artifacts, the runner base
- `nodes/`: the machines and the Ray processes on them: starting and joining Ray, TLS and token,
  node agents, discovery, the state directory

Importing this package is cheap; Ray and torch are imported where they are used.
"""
