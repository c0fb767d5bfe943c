"""Inference through the split: a reply from a split-trained model without merging it.

The client loads what `smolforge split train` left in its output directory (the newest checkpoint,
or `step`: its bottom/top LoRA, its copy of the trunk's LoRA and the run's settings), runs the
bottom and the top here, each with its own KV cache, and the trunk on a trunk server that serves
the same base model and split points. The server receives the trunk LoRA when the generation opens
and keeps the trunk layers' KV cache until the client closes it (or it sits idle past the server's
bound). The prompt goes through once; each new token then costs one position on both sides.
Greedy decoding gives the tokens HF `generate` gives on the merged model (`split merge`), which
is what the tests hold it to.

If the server loses the generation (it restarted, or freed it when idle), the client opens a new
one and replays its prefix (prompt + tokens so far) with fresh caches on both sides, a few times
at most, so a reply survives a trunk that is placed again.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from pydantic import Field

from smolforge.config import PeftSpec, Spec
from smolforge.errors import SmolforgeError
from smolforge.models.families import cut_at_stop, stop_ids
from smolforge.models.loading import pick_device
from smolforge.models.partition import generation_positions
from smolforge.split import checkpoint as ckpt
from smolforge.split.client import SessionLost, TrunkClient
from smolforge.split.codec import decode, encode, encode_raw
from smolforge.split.lora import apply_lora, load_lora_state, targets
from smolforge.split.partition import load_parts, load_tokenizer_locked
from smolforge.split.protocol import PROTOCOL_VERSION, TOKEN_ENV, pb
from smolforge.train.engine import available_cpus

MAX_RECOVERIES = 3


class SplitGenerateConfig(Spec):
    """Everything `smolforge split generate` takes."""

    run_dir: str = Field(..., description="the --output-dir of `smolforge split train`")
    prompt: str = Field(..., min_length=1)
    server_host: str = "127.0.0.1"
    server_port: int = Field(50051, ge=1, le=65535)
    token: str | None = Field(None, description=f"default: ${TOKEN_ENV}")
    tls_ca: str | None = None
    tls_server_name: str | None = None
    step: int | None = Field(None, ge=1, description="the checkpoint to load (default: the newest)")
    max_new_tokens: int = Field(64, ge=1, le=8192)
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False, description="0: greedy")
    seed: int = 0
    raw: bool = Field(False, description="send the prompt as is, without the chat template")
    codec: Literal["fp32", "fp16", "bf16", "int8"] = "fp32"
    device: str = "cpu"
    num_threads: int | None = Field(None, ge=1)
    rpc_timeout: float = Field(120.0, gt=0)
    reconnect_timeout: float = Field(30.0, gt=0)


@dataclass
class SplitRun:
    """What one checkpoint of a split run holds for inference."""

    run_dir: Path
    step: int
    model: str
    split_points: tuple[int, int]
    lora: PeftSpec
    fingerprint: str
    client_lora: dict[str, torch.Tensor]
    trunk_lora: dict[str, torch.Tensor]


def load_run(run_dir: str | Path, step: int | None = None) -> SplitRun:
    """Checkpoint `step` (default: the newest) of the split run in `run_dir`."""
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    steps = ckpt.valid_steps(root) if root.is_dir() else []
    if not steps:
        raise SmolforgeError(f"{run_dir} holds no split-training checkpoint", where="--run-dir",
                             fix="point --run-dir at the --output-dir of a `smolforge split train` run")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise SmolforgeError(f"{run_dir} has no valid checkpoint at step {step}", where="--step",
                             fix=f"use one of {steps}, or leave --step out for the newest")
    path, state = ckpt.read(root, step)
    sp1, sp2 = state["split_points"]
    return SplitRun(run_dir=run_dir, step=step, model=state["model"], split_points=(int(sp1), int(sp2)),
                    lora=PeftSpec(**state["lora"]), fingerprint=state["fingerprint"],
                    client_lora=ckpt.load_tensors(path, "client_lora"),
                    trunk_lora=ckpt.load_tensors(path, "trunk_lora"))


@dataclass
class SplitGenerateResult:
    text: str
    token_ids: list[int]  # the new tokens
    prompt_tokens: int
    stopped: str  # "eos" or "max_new_tokens"
    model: str
    checkpoint_step: int
    server: str
    client_forward_positions: list[int] = field(default_factory=list)  # per bottom/top forward
    trunk_cache_lengths: list[int] = field(default_factory=list)  # the server's cache after each step
    recoveries: int = 0
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


OnToken = Callable[[int, torch.Tensor], None]


class SplitGenerator:
    """The client side: bottom and top with the run's LoRA, a connection to the trunk server."""

    def __init__(self, cfg: SplitGenerateConfig, *, tokenizer=None, client: TrunkClient | None = None):
        self.cfg = cfg
        self.run = load_run(cfg.run_dir, cfg.step)
        torch.set_num_threads(cfg.num_threads or available_cpus())
        self.device = pick_device(cfg.device)
        self.tokenizer = tokenizer or load_tokenizer_locked(self.run.model)
        loaded = load_parts(self.run.model, *self.run.split_points, ("bottom", "top"), self.device)  # only its parts
        self.stops = stop_ids(self.tokenizer, loaded.parts.top)  # every token that ends a reply (the family's answer)
        self.fingerprint = loaded.fingerprint
        if self.fingerprint != self.run.fingerprint:
            raise SmolforgeError(f"the model {self.run.model!r} loaded here is not the one {cfg.run_dir} was trained "
                                 f"on (fingerprint {self.fingerprint}, the run's {self.run.fingerprint})",
                                 where="--run-dir", fix="load the same base model files the run was trained with")
        parts = loaded.parts
        self.arch, self.bottom, self.top = parts.arch, parts.bottom, parts.top
        for part in (self.bottom, self.top):
            apply_lora(part, self.run.lora, 0, self.arch.canonical)
            load_lora_state(part, self.run.client_lora, self.arch.canonical)
            part.to(self.device).eval()
        self.dtype = next(self.top.parameters()).dtype
        token = cfg.token if cfg.token is not None else (os.environ.get(TOKEN_ENV) or None)
        # `client`: a connection made by the caller (a split job's follows its trunk when it is placed again)
        self.client = client or TrunkClient(cfg.server_host, cfg.server_port, token, cfg.tls_ca, cfg.tls_server_name,
                                            rpc_timeout=cfg.rpc_timeout, reconnect_timeout=cfg.reconnect_timeout)
        self.forward_positions: list[int] = []
        self.trunk_cache_lengths: list[int] = []
        self.recoveries = 0

    def open_request(self, max_positions: int) -> pb.OpenGenerationRequest:
        """The request opening a generation of up to `max_positions` with the run's trunk LoRA."""
        spec, trunk = self.run.lora, self.run.trunk_lora
        lora = pb.LoraSpec(enabled=bool(trunk), r=spec.r, alpha=spec.alpha, dropout=0.0,
                           target_modules=targets(spec, self.arch.model_type))
        return pb.OpenGenerationRequest(
            model_id=self.run.model, model_fingerprint=self.fingerprint, split_point_1=self.run.split_points[0],
            split_point_2=self.run.split_points[1], codec=self.cfg.codec, lora=lora, max_positions=max_positions,
            client_version=PROTOCOL_VERSION,
            trunk_lora=[pb.NamedTensor(name=k, tensor=encode(v, "fp32")) for k, v in sorted(trunk.items())])

    def _open(self, max_positions: int) -> str:
        return self.client.call("OpenGeneration", self.open_request(max_positions)).generation_id

    def _close(self, generation_id: str) -> None:
        try:
            self.client.call("CloseGeneration", pb.CloseGenerationRequest(generation_id=generation_id), retry=False)
        except (SmolforgeError, SessionLost):
            pass  # the server frees it after its idle bound anyway

    def _through(self, gid: str, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, past: int,
                 caches: tuple) -> torch.Tensor:
        """Bottom here, trunk there, top here, for the new positions `x`; the last position's logits."""
        h1 = self.bottom(x, mask, pos, caches[0])
        req = pb.GenerateStepRequest(generation_id=gid, past_length=past, hidden=encode(h1, self.cfg.codec),
                                     attention_mask=encode_raw(mask.to(torch.uint8)),
                                     positions=encode_raw(pos.to(torch.int32)))
        reply = self.client.call("GenerateStep", req)
        if reply.cache_length != past + x.shape[1]:
            raise SmolforgeError(f"the trunk server's cache holds {reply.cache_length} positions, this client "
                                 f"sent {past + x.shape[1]}", where=self.client.address,
                                 fix="use the same smolforge version on both sides")
        self.forward_positions.append(x.shape[1])
        self.trunk_cache_lengths.append(reply.cache_length)
        h2 = decode(reply.hidden).to(self.device, self.dtype)
        return self.top(h2, mask, pos, caches[1])[:, -1]

    def _lost(self, why: str) -> None:
        self.recoveries += 1
        if self.recoveries > MAX_RECOVERIES:
            raise SmolforgeError(f"the trunk server at {self.client.address} lost this generation "
                                 f"{self.recoveries} times ({why})", where=self.client.address,
                                 fix="check the server's log (a restart loop, or an idle bound shorter than a step)")

    @torch.no_grad()
    def generate_ids(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                     seed: int = 0, stops: frozenset[int] = frozenset(), pad_id: int = 0,
                     on_token: OnToken | None = None) -> torch.Tensor:
        """The new tokens [rows, <= max_new_tokens] for left-padded prompts `ids` [rows, T]; a row ends at any
        id of `stops` (the model's stop set), and rows that ended get `pad_id`."""
        stop = torch.tensor(sorted(stops), dtype=torch.long, device=self.device)
        ids, mask = ids.to(self.device), mask.to(self.device)
        rows = ids.shape[0]
        rng = torch.Generator(device=self.device).manual_seed(seed) if temperature > 0 else None
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        new: list[torch.Tensor] = []
        gid, past, caches = "", 0, ()
        try:
            while len(new) < max_new_tokens:
                if not gid:  # a fresh generation: the whole prefix goes through, fresh caches on both sides
                    gid, past = self._open(ids.shape[1] + max_new_tokens - len(new)), 0
                    caches = (self.bottom.new_cache(), self.top.new_cache())
                try:
                    logits = self._through(gid, ids[:, past:], mask, generation_positions(mask)[:, past:], past,
                                           caches)
                except SessionLost as lost:
                    gid = ""
                    self._lost(str(lost))
                    continue
                past = ids.shape[1]
                token = pick(logits, temperature, rng)
                token = torch.where(done, torch.full_like(token, pad_id), token)
                new.append(token)
                if on_token:
                    on_token(len(new), token)
                done |= torch.isin(token, stop)
                if bool(done.all()) or len(new) == max_new_tokens:
                    break
                ids = torch.cat([ids, token[:, None]], dim=1)
                mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
        finally:
            if gid:
                self._close(gid)
        return torch.stack(new, dim=1) if new else ids.new_zeros(rows, 0)

    def reply(self, prompt: str, *, on_token: OnToken | None = None) -> SplitGenerateResult:
        """One reply to `prompt` (the chat template applied unless `raw`), as `smolforge generate` gives."""
        from smolforge.data.encode import render

        cfg, tok = self.cfg, self.tokenizer
        t0 = time.perf_counter()
        text = prompt if cfg.raw else render(tok, [{"role": "user", "content": prompt}], add_generation_prompt=True)
        enc = tok(text, return_tensors="pt", add_special_tokens=cfg.raw)
        new = self.generate_ids(enc["input_ids"], enc["attention_mask"], cfg.max_new_tokens,
                                temperature=cfg.temperature, seed=cfg.seed, stops=self.stops,
                                pad_id=tok.pad_token_id or 0, on_token=on_token)[0].tolist()
        stopped = "eos" if new and new[-1] in self.stops else "max_new_tokens"
        return SplitGenerateResult(
            text=tok.decode(cut_at_stop(new, self.stops, keep=False), skip_special_tokens=True), token_ids=new, prompt_tokens=enc["input_ids"].shape[1],
            stopped=stopped, model=self.run.model, checkpoint_step=self.run.step, server=self.client.address,
            client_forward_positions=list(self.forward_positions), trunk_cache_lengths=list(self.trunk_cache_lengths),
            recoveries=self.recoveries, seconds=time.perf_counter() - t0, bytes_sent=self.client.bytes_sent,
            bytes_received=self.client.bytes_received)

    def close(self) -> None:
        self.client.close()


def pick(logits: torch.Tensor, temperature: float, rng: torch.Generator | None) -> torch.Tensor:
    """Greedy at temperature 0 (HF's argmax), else a draw from softmax(logits / temperature)."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=rng).squeeze(-1)


def generate(cfg: SplitGenerateConfig, *, on_token: OnToken | None = None, tokenizer=None,
             client: TrunkClient | None = None) -> SplitGenerateResult:
    """One reply from the split run in `cfg.run_dir`, its trunk on the server `cfg` names (or `client` reaches).

    `on_token(n, tokens)` sees each new token as it comes (a chat streams it)."""
    gen = SplitGenerator(cfg, tokenizer=tokenizer, client=client)
    try:
        return gen.reply(cfg.prompt, on_token=on_token)
    finally:
        gen.close()
