"""A pipeline rank's checkpoints: the whole state written by rank 0 as the stages' tensors arrive.

`Pipeline` inherits this. Each rank holds only its stage, so a checkpoint (or the final adapter) is
gathered to rank 0 tensor by tensor over point-to-point sends: a JSON header per rank (names, dtypes,
shapes; never pickle), then its tensors in order, which rank 0 writes into a safetensors file as they
come (a full model) or keeps (an adapter, small). It is keyed as every strategy keys it (parameter
names; the optimizer by one process's integer ids), so a pipeline checkpoint resumes under any
strategy and any strategy's under a pipeline, each rank reading only its stage's tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from smolforge.train.checkpoint import optimizer_file_key, optimizer_file_metadata, spool_tensor_file
from smolforge.train.tensor_reader import TensorReader


class PipelineCheckpoints:
    """`Pipeline`'s checkpoint methods; they use its layout, rank, world, device, global ids and byte
    counting (`_count`)."""

    def model_state(self, model: nn.Module, spool_dir: Path | None = None) -> dict[str, torch.Tensor] | Path | None:
        """The whole trainable weights on rank 0, by parameter name: a dict for an adapter (small), a
        safetensors file for a full model (written as the stages' tensors arrive, never whole in memory)."""
        lay = self.layout
        mine = [(lay.names[i], lay.params[i].detach()) for i in range(len(lay.params))
                if lay.trainable[i] and lay.primary(i) == self.rank]
        gathered = self._gather(mine, {})
        if gathered is None:
            return None
        specs, tensors, _ = gathered
        if self.full:
            return spool_tensor_file(spool_dir, "trainable", tensors, specs, {"format": "pt"})
        return {name: t.cpu() for name, t in tensors}

    def load_model_state(self, model: nn.Module, weights: TensorReader) -> None:
        """Only this stage's tensors are read from the checkpoint."""
        lay = self.layout
        with torch.no_grad():
            for name in weights.keys():
                i = lay.index[name]
                if self._holds(i):
                    lay.params[i].copy_(weights.get(name).to(lay.params[i].device, lay.params[i].dtype))

    def optimizer_state(self, optimizer: torch.optim.Optimizer, spool_dir: Path | None = None) -> Path | None:
        """The whole model's optimizer state on rank 0, as `optimizer.state_dict()` of one process keys it
        (its integer ids, its groups), streamed into a safetensors file (`checkpoint.read_optimizer_file`)."""
        lay = self.layout
        index = {id(p): i for i, p in enumerate(lay.params)}
        entries: list[tuple[str, torch.Tensor]] = []
        scalars: dict[str, dict[str, Any]] = {}
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            if lay.primary(index[id(p)]) != self.rank:
                continue  # a tied copy: its state is the first stage's
            gid = self.global_ids[id(p)]
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    entries.append((optimizer_file_key(gid, key), value))
                else:
                    scalars.setdefault(str(gid), {})[key] = value
        gathered = self._gather(entries, scalars)
        if gathered is None:
            return None
        specs, tensors, extras = gathered
        merged = {int(gid): values for extra in extras for gid, values in extra.items()}
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": ids}
                  for group, ids in zip(optimizer.state_dict()["param_groups"], self.global_groups)]
        return spool_tensor_file(spool_dir, "optim", tensors, specs, optimizer_file_metadata(groups, merged))

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """A whole-model state (any strategy's checkpoint): this stage's parameters take their entries."""
        saved = {int(i): st for i, st in state["state"].items()}
        local = [p for group in optimizer.param_groups for p in group["params"]]
        mine = {j: saved[self.global_ids[id(p)]] for j, p in enumerate(local) if self.global_ids[id(p)] in saved}
        groups, start = [], 0
        for group, saved_group in zip(optimizer.param_groups, state["param_groups"]):
            count = len(group["params"])
            groups.append({**{k: v for k, v in saved_group.items() if k != "params"},
                           "params": list(range(start, start + count))})
            start += count
        optimizer.load_state_dict({"state": mine, "param_groups": groups})

    def _gather(self, entries: list[tuple[str, torch.Tensor]], extra: dict[str, Any]):
        """Every rank's (name, tensor) entries to rank 0: (specs, an iterator over them, every rank's
        `extra`) there, None elsewhere. Each rank sends a JSON header (no pickle), then its tensors in
        order; rank 0 must consume the iterator to the end (the others are sending)."""
        header = {"specs": [[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in entries],
                  "extra": extra}
        if not self.is_main:
            self._send_json(header)
            for _, t in entries:
                t = t.detach().contiguous()
                self._count(t, checkpoint=True)
                dist.send(t, dst=0)
            return None
        headers = [header] + [self._recv_json(r) for r in range(1, self.world)]
        specs = [(n, getattr(torch, d), tuple(s)) for h in headers for n, d, s in h["specs"]]

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            yield from ((n, t.detach()) for n, t in entries)
            for r in range(1, self.world):
                for n, d, s in headers[r]["specs"]:
                    buf = torch.empty(s, dtype=getattr(torch, d), device=self.device)
                    dist.recv(buf, src=r)
                    yield n, buf

        return specs, tensors(), [h["extra"] for h in headers]

    def _send_json(self, obj: dict) -> None:
        raw = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(self.device)
        size = torch.tensor([raw.numel()], dtype=torch.int64, device=self.device)
        self._count(raw, checkpoint=True)
        dist.send(size, dst=0)
        dist.send(raw, dst=0)

    def _recv_json(self, src: int) -> dict:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.recv(size, src=src)
        raw = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.recv(raw, src=src)
        return json.loads(bytes(raw.cpu().numpy()).decode())
