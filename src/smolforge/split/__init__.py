"""Split learning: the client keeps the data, the labels and the first and last layers; a trunk
server runs the middle layers. Hidden states go forward over gRPC, gradients come back, and all
three parts train their LoRA in lockstep.

Modules: `partition` (cut a model into bottom/trunk/top), `lora` (seeded LoRA on parts, peft
adapter files), `codec` (tensors on the wire), `protocol` (+ `split.proto`, `gen_proto`),
`server` (the trunk server; `calls`: its error statuses and input checks), `client` (connection,
retries), `settings` (the training settings `split train` and a `split` job share, torch-free),
`trainer` (the client loop), `checkpoint`, `merge`, `rng`, and inference through the
split: `generate` (the client: bottom and top with their KV caches) and `trunk_generate` (the
server's generation sessions, a trunk KV cache each).

Imports are lazy so that `import smolforge.split` stays cheap.
"""

from __future__ import annotations

__all__ = ["ServeConfig", "SplitTrainConfig", "merge_run", "serve", "train_split"]


def __getattr__(name: str):
    if name in ("ServeConfig", "serve"):
        from smolforge.split import server

        return getattr(server, name)
    if name in ("SplitTrainConfig", "train_split"):
        from smolforge.split import trainer

        return getattr(trainer, name)
    if name == "merge_run":
        from smolforge.split.merge import merge_run

        return merge_run
    raise AttributeError(name)
