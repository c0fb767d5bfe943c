"""`smolforge serve`: a generation engine with static batching behind an OpenAI-compatible API and a chat page.

- `sampling.py`: the per-request sampling settings and one token from logits (greedy, temperature, top_p, seed)
- `model.py`: the served model (base + adapter, tokenizer) and its batched forward with a KV cache
- `batch.py`: one static batch: `step()` gives every active request one new token
- `stops.py`: incremental detokenization and stop strings
- `engine.py`: the thread that owns the model, the request queue and the token streams; `events.py`: what
  a request's sink receives and the context rule (torch-free: the HTTP side needs only these)
- `engines.py`: which engine computes the tokens (`--engine`: a name -> loader registry, and the `auto`
  rule); `llamacpp.py`: a GGUF export in llama.cpp as a `BatchModel`, one llama.cpp sequence per row
- `stages.py`: a model cut into stages: `StageServer` (one stage, a KV cache per batch) and `StagedModel`
  (the batch model over stage handles: local servers, or the Ray actors of `cluster/workloads/serve/stages.py`)
- `api.py`, `protocol.py`, `chat.html`: the HTTP side; `intake.py`: a body to a checked, tokenized
  request, off the event loop; `streams.py`: answers and token streams from the engine thread;
  `openapi.py`: the OpenAPI description the fuzz tests check answers against
- `server.py`: one-process `smolforge serve`; `front.py`: its HTTP side in a process of its own (`--front
  process`, the default), talking to the engine's process through `channel.py` (JSON lines on a socketpair)
"""
