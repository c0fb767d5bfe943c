"""The split-learning client: keeps the data, the labels, the bottom and the top; the trunk is remote.

One optimizer step, for each micro-batch j of step s:
    bottom(ids) = h1  --Forward(s, j, h1)-->  server: trunk(h1) = h2, graph kept
    top(h2) -> logits -> loss (labels never leave this process) -> backward -> dL/dh2
    --Backward(s, j, dL/dh2)-->  server: backprop, trunk LoRA grads accumulate, returns dL/dh1
    h1.backward(dL/dh1): bottom LoRA grads accumulate
then the global gradient norm (client + trunk, the trunk's comes with the last Backward) gives one
clip coefficient, and Step(s, lr, coef) moves the trunk while the client's AdamW moves bottom and
top. The batches (the engine's `SampleSource` over its `SampleOrder`, the same step count), loss
normalisation (summed token loss / the step's target tokens), schedule and clipping are those of
`smolforge.train.engine`, so with the fp32 codec a split run reproduces a one-process run of the
same model step for step.

Why this is not the one driver (`smolforge.train.driver`), which fine-tuning runs, ranks and
distillation students share: its parts assume one process holds the whole trainable model. Here
(1) an optimizer step spans two processes (the client's AdamW and the server's trunk step under one
clip coefficient from both sides' gradient norms), where `Trainer.step` clips and steps locally;
(2) a checkpoint is two-sided (client and trunk LoRA, resumed at the newest step both sides hold),
not `train.checkpoint`'s; (3) a lost session rolls the loop back to that checkpoint mid-run, which
`Trainer.run` has no notion of; (4) the learning rate is sent to the server each step (`lr_lambda`),
not kept by a torch scheduler. What fits is shared: the data source, the step count, `StepInfo`,
`TrainHooks`, the thread count.
"""

from __future__ import annotations

import hashlib
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from smolforge.config import DataSpec, PeftSpec
from smolforge.data.collate import collate
from smolforge.errors import SmolforgeError
from smolforge.models.loading import pick_device
from smolforge.paths import atomic_write_json
from smolforge.split import checkpoint as ckpt
from smolforge.split.client import SessionLost, TrunkClient
from smolforge.split.codec import CODECS, decode, encode, encode_raw
from smolforge.split.lora import apply_lora, load_lora_state, lora_state, save_peft_adapter
from smolforge.split.partition import load_parts, load_tokenizer_locked, positions_for
from smolforge.split.protocol import PROTOCOL_VERSION, TOKEN_ENV, pb
from smolforge.split.rng import seeded_rng
from smolforge.split.server import grad_norms
from smolforge.split.settings import SplitTraining
from smolforge.telemetry.progress import StepProgress
from smolforge.telemetry.sinks import run_name
from smolforge.telemetry.writers import MetricsWriter
from smolforge.train.driver import StepInfo, available_cpus
from smolforge.train.engine import SampleOrder, SampleSource, TrainHooks, steps_for
from smolforge.train.evaluate import perplexity, token_loss_sum
from smolforge.train.resume_point import SAMPLES_KEY, STATE_KEY, StepMeaning, data_fingerprint, resume_point
from smolforge.train.rendering import load_checked_splits
from smolforge.train.schedule import lr_lambda
from smolforge.train.strategy import Strategy
from smolforge.rundir import check_run_dir, record

# the top-level names a split client run writes in its --output-dir (its manifest: `rundir`)
SPLIT_OUTPUTS = ("checkpoints", "lora_adapter", "split_run.json", "summary.json", "metrics.jsonl", "tensorboard",
                 "wandb", "merged_model")

class SplitTrainConfig(SplitTraining):
    """Everything `smolforge split train` takes (the seed's flag names, snake_cased): the training
    settings a split job shares (`settings.SplitTraining`), and what the command says itself where a
    job's runner decides it (the server's address, token and TLS, output and session, resume, sinks)."""

    server_host: str = "127.0.0.1"
    server_port: int = Field(50051, ge=1, le=65535)
    token: str | None = Field(None, description=f"default: ${TOKEN_ENV}")
    tls_ca: str | None = None
    tls_server_name: str | None = None
    output_dir: str = "outputs/split"
    resume: bool = False
    session_name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    quiet: bool = False
    tensorboard: bool = False
    wandb: str | None = Field(None, description="W&B project: an offline run under output_dir/wandb")
    reconnect_timeout: float = Field(300.0, gt=0)
    num_threads: int | None = Field(None, ge=1)

    def peft(self) -> PeftSpec:
        return PeftSpec(method="lora", r=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout,
                        target_modules=self.target_modules)

    def data_spec(self) -> DataSpec:
        return DataSpec(path=self.dataset, eval_path=self.eval_dataset, format=self.data_format,
                        max_samples=self.max_train_samples, max_eval_samples=self.max_eval_samples,
                        max_length=self.max_seq_length)

    def default_session_name(self) -> str:
        """Stable across restarts of the same run (it names the server's checkpoints)."""
        if self.session_name:
            return self.session_name
        return "run-" + hashlib.sha256(str(Path(self.output_dir).resolve()).encode()).hexdigest()[:12]


@dataclass
class SplitTrainResult:
    output_dir: str
    adapter_dir: str | None
    steps: int
    final_loss: float | None
    losses: list[float] = field(default_factory=list)  # per step of this process, index = step - first - 1
    first_step: int = 0
    eval: dict[str, Any] = field(default_factory=dict)
    best_eval_loss: float | None = None
    seconds: float = 0.0
    steps_per_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_per_step: float = 0.0
    trainable_params: int = 0
    trunk_trainable_params: int = 0
    total_params: int = 0
    stopped: str | None = None
    checkpoint_dir: str | None = None
    resumed_from: int | None = None
    rollbacks: int = 0
    retries: int = 0
    codec: str = "fp32"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_log(step: int, loss: float, lr: float, grad_norm: float, steps_per_s: float) -> str:
    return f"Step {step} | Loss {loss:.4f} | LR {lr:.2e} | Grad Norm {grad_norm:.4f} | Steps/s {steps_per_s:.2f}"


def eval_log(val_loss: float, best: float) -> str:
    return f"Val Loss {val_loss:.4f} | Best {best:.4f}"


class SplitTrainer:
    """One client run. `train()` does the loop; the pieces are methods so tests can drive them."""

    def __init__(self, cfg: SplitTrainConfig, hooks: TrainHooks | None = None, *, splits=None, tokenizer=None,
                 client: TrunkClient | None = None):
        self.cfg = cfg
        self.hooks = hooks or TrainHooks()
        if cfg.codec not in CODECS:
            raise SmolforgeError(f"unknown codec {cfg.codec!r}", fix=f"use one of {', '.join(CODECS)}")
        torch.set_num_threads(cfg.num_threads or available_cpus())
        self.device = pick_device(cfg.device)
        self.log = (lambda msg: None) if cfg.quiet else _printer()
        self.tokenizer = tokenizer or load_tokenizer_locked(cfg.model)
        # only the bottom's and the top's tensors are read: the trunk's layers never get storage here
        loaded = load_parts(cfg.model, cfg.split_point_1, cfg.split_point_2, ("bottom", "top"), self.device)
        self.fingerprint, self.total_params, parts = loaded.fingerprint, loaded.total_params, loaded.parts
        self.arch = parts.arch
        self.bottom, self.top = parts.bottom, parts.top
        self.peft = cfg.peft()
        self.bottom_params = apply_lora(self.bottom, self.peft, cfg.seed, self.arch.canonical)
        self.top_params = apply_lora(self.top, self.peft, cfg.seed, self.arch.canonical)
        self.params = self.bottom_params + self.top_params
        self.bottom.to(self.device).train()
        self.top.to(self.device).train()
        self.initial_lora = self._client_state()
        self.optimizer = self._new_optimizer()
        self.splits = splits if splits is not None else _load_splits(cfg, self.tokenizer)
        if not len(self.splits.train):
            raise SmolforgeError(f"dataset {cfg.dataset!r} has no training rows", fix="check --dataset and its format")
        self.eval_rows = [] if cfg.max_eval_samples == 0 else list(self.splits.eval)
        self.per_step = cfg.batch_size * cfg.gradient_accumulation_steps
        self.order = SampleOrder(len(self.splits.train), self.per_step, cfg.seed)
        self.step_meaning = split_step_meaning(cfg, self.splits.train)
        self.total_steps = steps_for(cfg.max_steps, cfg.num_epochs, self.order)
        # the engine's data source, one process: the same rows and micro-batches as `smolforge train`
        self.data = SampleSource(self.splits.train, self.order, self.total_steps, cfg.batch_size,
                                 self.tokenizer.pad_token_id, Strategy())
        self.session_name = cfg.default_session_name()
        self.out_dir = Path(cfg.output_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        token = cfg.token if cfg.token is not None else (os.environ.get(TOKEN_ENV) or None)
        # `client`: a connection made by the caller (a split job's follows its trunk when it is placed again)
        self.client = client or TrunkClient(cfg.server_host, cfg.server_port, token, cfg.tls_ca, cfg.tls_server_name,
                                            rpc_timeout=cfg.rpc_timeout, reconnect_timeout=cfg.reconnect_timeout)
        self.session_id = ""
        self.trunk_trainable = 0
        self.best_eval: float | None = None
        self.dtype = next(self.top.parameters()).dtype
        self.last_trunk_state: dict[str, torch.Tensor] | None = None
        self.train_bytes = 0
        self.tokens_seen = 0

    # ----------------------------------------------------------------- state

    def _new_optimizer(self):
        if not self.params:
            return None
        return torch.optim.AdamW(self.params, lr=self.cfg.learning_rate, weight_decay=self.cfg.weight_decay)

    def _client_state(self) -> dict[str, torch.Tensor]:
        return {**lora_state(self.bottom, self.arch.canonical), **lora_state(self.top, self.arch.canonical)}

    def _load_client_state(self, state: dict[str, torch.Tensor]) -> None:
        load_lora_state(self.bottom, state, self.arch.canonical)
        load_lora_state(self.top, state, self.arch.canonical)

    def _run_state(self) -> dict[str, Any]:
        return {"model": self.cfg.model, "fingerprint": self.fingerprint,
                "split_points": [self.cfg.split_point_1, self.cfg.split_point_2],
                "lora": self.peft.model_dump(), "seed": self.cfg.seed, "session": self.session_name}

    def open_session(self, resume_step: int) -> int:
        req = pb.OpenSessionRequest(
            model_id=self.cfg.model, model_fingerprint=self.fingerprint, split_point_1=self.cfg.split_point_1,
            split_point_2=self.cfg.split_point_2, codec=self.cfg.codec, session_name=self.session_name,
            resume_step=resume_step, seed=self.cfg.seed, weight_decay=self.cfg.weight_decay,
            mixed_precision=self.cfg.mixed_precision, client_version=PROTOCOL_VERSION)
        reply = self.client.call("OpenSession", req)
        self.session_id = reply.session_id
        self.trunk_trainable = int(reply.trainable_params)
        if reply.step != max(0, resume_step):
            raise SmolforgeError(f"trunk server resumed at step {reply.step}, expected {resume_step}",
                                 fix="restart both sides with --resume")
        return int(reply.step)

    def restore(self, step: int) -> None:
        """Put the client back at `step`: a checkpoint, or the seeded initial state for 0."""
        if step == 0:
            self._load_client_state(self.initial_lora)
            self.optimizer = self._new_optimizer()
            self.best_eval = None
            return
        path, state = ckpt.read(self.ckpt_root, step)
        run = self._run_state()
        for key in ("fingerprint", "split_points", "lora"):
            if state.get(key) != run[key]:
                raise SmolforgeError(f"checkpoint {path} was made with another {key.replace('_', ' ')} "
                                     f"({state.get(key)} vs {run[key]})",
                                     fix="resume with the settings the run was started with, or use a new --output-dir")
        note = resume_point(state, self.step_meaning, self.per_step, where=str(path), flags=SPLIT_FLAGS).note
        if note:  # a step means the same rows as when it was saved (else refused, exit 2)
            self.log(note)
        self._load_client_state(ckpt.load_tensors(path, "client_lora"))
        self.optimizer = self._new_optimizer()
        if self.optimizer is not None:
            self.optimizer.load_state_dict(ckpt.load_blob(path, "optim")["optimizer"])
        rng = ckpt.load_tensors(path, "rng")
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        self.last_trunk_state = ckpt.load_tensors(path, "trunk_lora")
        self.best_eval = state.get("best_eval_loss")
        if state.get("total_steps") not in (None, self.total_steps):
            self.log(f"note: the run was started for {state['total_steps']} steps and now runs {self.total_steps}; "
                     "the learning-rate schedule changes from here")

    def connect(self, resume: bool) -> int:
        """Open the session, at the newest checkpoint both sides hold when resuming; returns its step."""
        info = self.client.info(self.session_name)
        step = 0
        if resume:
            step = ckpt.shared_step(ckpt.valid_steps(self.ckpt_root), list(info.checkpoint_steps))
        self.restore(step)
        return self.open_session(step)

    def recover(self, why: str) -> int:
        self.log(f"trunk server lost this session ({why}); reconnecting and rolling back to a shared checkpoint")
        step = self.connect(resume=True)
        self.log(f"resumed at step {step} with {self.client.address}")
        return step

    def save(self, step: int) -> Path:
        reply = self.client.call("SaveCheckpoint", pb.SaveCheckpointRequest(session_id=self.session_id, step=step,
                                                                           return_weights=True))
        trunk = {w.name: decode(w.tensor) for w in reply.weights}
        self.last_trunk_state = trunk
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        epoch, k = divmod(step, self.order.steps_per_epoch)
        state = {**self._run_state(), "total_steps": self.total_steps, "best_eval_loss": self.best_eval,
                 "data_position": {"epoch": epoch, "step_in_epoch": k, "samples_done": step * self.per_step},
                 SAMPLES_KEY: step * self.per_step, STATE_KEY: self.step_meaning.to_state(),  # `train.resume_point`
                 "codec": self.cfg.codec}
        blobs = {"optim": {"optimizer": self.optimizer.state_dict()}} if self.optimizer is not None else {}
        path = ckpt.write(self.ckpt_root, step, {"client_lora": self._client_state(), "trunk_lora": trunk, "rng": rng},
                          blobs, state, keep_last=self.cfg.keep_last)
        if self.hooks.on_checkpoint:
            self.hooks.on_checkpoint(path, step)
        return path

    # ----------------------------------------------------------------- compute

    def _amp(self):
        """bf16 autocast with --mixed-precision (no loss scaling needed, unlike fp16)."""
        if self.cfg.mixed_precision:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _forward_remote(self, h1: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, step: int, micro: int,
                        train: bool) -> torch.Tensor:
        req = pb.ForwardRequest(session_id=self.session_id, step=step, micro_batch=micro, train=train,
                                hidden=encode(h1.detach(), self.cfg.codec),
                                attention_mask=encode_raw(mask.to(torch.uint8)),
                                positions=encode_raw(pos.to(torch.int32)))
        reply = self.client.call("Forward", req)
        if train:
            self.train_bytes += req.ByteSize() + reply.ByteSize()
        return decode(reply.hidden).to(self.device, self.dtype)

    def run_step(self, step0: int) -> tuple[float, float, float]:
        """Optimizer step `step0 + 1`; returns (loss, grad norm, lr)."""
        s = step0 + 1
        micro = self.data.batches(step0)
        targets = sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro)
        denom = float(max(1, targets))
        loss_total = 0.0
        trunk_norms: list[float] = []
        for j, m in enumerate(micro):
            ids, mask, labels = (m[k].to(self.device) for k in ("input_ids", "attention_mask", "labels"))
            pos = positions_for(mask)
            self.tokens_seen += int(mask.sum())
            with seeded_rng(self.cfg.seed, "bottom", s, j, self.device), self._amp():
                h1 = self.bottom(ids, mask, pos)
            h2 = self._forward_remote(h1, mask, pos, s, j, train=True).requires_grad_(True)
            with seeded_rng(self.cfg.seed, "top", s, j, self.device), self._amp():
                logits = self.top(h2, mask, pos)
            loss_sum, _ = token_loss_sum(logits, labels)
            (loss_sum / denom).backward()
            req = pb.BackwardRequest(session_id=self.session_id, step=s, micro_batch=j,
                                     grad=encode(h2.grad, self.cfg.codec), last_micro_batch=j == len(micro) - 1)
            reply = self.client.call("Backward", req)
            self.train_bytes += req.ByteSize() + reply.ByteSize()
            if h1.requires_grad:
                h1.backward(decode(reply.grad).to(self.device, h1.dtype))
            if j == len(micro) - 1:
                trunk_norms = list(reply.trunk_grad_norms)
            loss_total += float(loss_sum.detach())
        grad_norm, coef = self._clip(trunk_norms)
        lr = self.cfg.learning_rate * lr_lambda(step0, self.total_steps, self.cfg.warmup_steps, self.cfg.scheduler, 0.0)
        req = pb.StepRequest(session_id=self.session_id, step=s, lr=lr, clip_coef=coef)
        reply = self.client.call("Step", req)
        self.train_bytes += req.ByteSize() + reply.ByteSize()
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss_total / denom, grad_norm, lr

    @torch.no_grad()
    def _clip(self, trunk_norms: list[float]) -> tuple[float, float]:
        """Global gradient norm and clip coefficient, exactly as clip_grad_norm_ on the whole model.

        torch stacks the per-tensor norms in parameter order and takes their norm in float32; the
        model's order is bottom, trunk, top, so the client stacks its own norms around the
        trunk's. Its gradients are scaled here; the trunk scales its own with the same coefficient.
        """
        norms = grad_norms(self.bottom_params) + [float(x) for x in trunk_norms] + grad_norms(self.top_params)
        if not norms:
            return 0.0, 1.0
        total = torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float32), 2.0)
        if not self.cfg.max_grad_norm:
            return float(total), 1.0
        coef = torch.clamp(self.cfg.max_grad_norm / (total + 1e-6), max=1.0)
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(coef)
        return float(total), float(coef)

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """Val loss over the held-out rows: forward only, the server keeps no graph."""
        rows = self.eval_rows
        if not len(rows):
            return {}
        self.bottom.eval()
        self.top.eval()
        total, count = 0.0, 0
        try:
            bs = self.cfg.batch_size * 2
            for i in range(0, len(rows), bs):
                m = collate(list(rows[i:i + bs]), self.tokenizer.pad_token_id)
                ids, mask, labels = (m[k].to(self.device) for k in ("input_ids", "attention_mask", "labels"))
                pos = positions_for(mask)
                with self._amp():
                    h2 = self._forward_remote(self.bottom(ids, mask, pos), mask, pos, step, 0, train=False)
                    logits = self.top(h2, mask, pos)
                s, n = token_loss_sum(logits, labels)
                total += float(s)
                count += n
        finally:
            self.bottom.train()
            self.top.train()
        if not count:
            return {}
        loss = total / count
        self.best_eval = loss if self.best_eval is None else min(self.best_eval, loss)
        return {"eval_loss": loss, "perplexity": perplexity(loss), "best_eval_loss": self.best_eval}

    # ----------------------------------------------------------------- the loop

    def train(self) -> SplitTrainResult:
        cfg = self.cfg
        t0 = time.perf_counter()
        n_client = sum(p.numel() for p in self.params)
        self.log(f"split training {cfg.model}: bottom [0, {cfg.split_point_1}) and top [{cfg.split_point_2}, "
                 f"{self.arch.num_layers}) here, trunk on {self.client.address} "
                 f"({'TLS' if self.client.tls else 'plaintext'}), codec {cfg.codec}")
        record(check_run_dir(self.out_dir, "split"), SPLIT_OUTPUTS)  # never into another kind of run's dir
        start = self.connect(cfg.resume)
        resumed_from = start if start else None
        if start:
            self.log(f"resumed from the checkpoint at step {start} (shared with the server)")
        self.log(f"trainable params: client {n_client:,} + trunk {self.trunk_trainable:,} || all params: "
                 f"{self.total_params:,}; {len(self.splits.train)} train / {len(self.eval_rows)} eval rows; "
                 f"{self.total_steps} steps")
        writer = MetricsWriter(self.out_dir, tensorboard=cfg.tensorboard, append=start > 0, wandb=cfg.wandb,
                               run_name=run_name("split", "client", 0, cfg.learning_rate, cfg.batch_size),
                               config=cfg.model_dump(mode="json"))
        result = SplitTrainResult(output_dir=str(self.out_dir), adapter_dir=None, steps=start, final_loss=None,
                                  first_step=start, trainable_params=n_client, total_params=self.total_params,
                                  resumed_from=resumed_from, codec=cfg.codec)
        progress = StepProgress(self.total_steps, "split train", quiet=cfg.quiet, completed=start)
        step = start
        t_loop, steps_here, tokens0 = time.perf_counter(), 0, self.tokens_seen
        stopped = None
        try:
            while step < self.total_steps:
                try:
                    loss, grad_norm, lr = self.run_step(step)
                except SessionLost as lost:
                    step = self._roll_back(result, str(lost), writer, progress)
                    continue
                step += 1
                steps_here += 1
                result.losses.append(loss)
                elapsed = time.perf_counter() - t_loop
                rate = steps_here / max(elapsed, 1e-9)
                info = StepInfo(step=step, max_steps=self.total_steps, loss=loss, lr=lr, grad_norm=grad_norm,
                                tokens_per_s=(self.tokens_seen - tokens0) / max(elapsed, 1e-9),
                                samples_done=step * self.per_step,
                                samples_total=self.total_steps * self.per_step,
                                epoch=self.data.epoch(step))
                writer.log("train", step, loss=loss, lr=lr, grad_norm=grad_norm, steps_per_s=rate)
                if step % cfg.log_interval == 0 or step == self.total_steps:
                    self.log(step_log(step, loss, lr, grad_norm, rate))
                progress.update(step, f"loss {loss:.4f} · {rate:.2f} steps/s")
                if self.hooks.on_step:
                    self.hooks.on_step(info)
                try:
                    if cfg.eval_interval and step % cfg.eval_interval == 0 and step != self.total_steps:
                        self._eval_and_log(step, writer)
                    stopped = self.hooks.should_stop() if self.hooks.should_stop else None
                    if (cfg.save_interval and step % cfg.save_interval == 0 and step != self.total_steps) \
                            or stopped == "pause":
                        result.checkpoint_dir = str(self.save(step))
                except SessionLost as lost:
                    step = self._roll_back(result, str(lost), writer, progress)
                    stopped = None
                    continue
                if stopped:
                    break
        finally:
            progress.close()
        loop_s = time.perf_counter() - t_loop
        result.steps = step
        result.final_loss = result.losses[-1] if result.losses else None
        result.steps_per_s = steps_here / max(loop_s, 1e-9)
        result.bytes_per_step = self.train_bytes / max(1, steps_here)
        result.stopped = stopped
        if stopped is None:
            result.eval = self._eval_and_log(step, writer)
            result.checkpoint_dir = str(self.save(step))
            adapter = self.out_dir / "lora_adapter"
            save_peft_adapter({**self._client_state(), **(self.last_trunk_state or {})}, self.peft,
                              self.arch.model_type, self.cfg.model, adapter, tokenizer=self.tokenizer)
            result.adapter_dir = str(adapter)
            atomic_write_json(self.out_dir / "split_run.json", {**self._run_state(), "steps": step,
                                                               "adapter": adapter.name, "codec": cfg.codec})
        self._close_session()
        result.best_eval_loss = self.best_eval
        result.trunk_trainable_params = self.trunk_trainable
        result.bytes_sent, result.bytes_received = self.client.bytes_sent, self.client.bytes_received
        result.retries = self.client.retries
        result.seconds = time.perf_counter() - t0
        writer.close()
        atomic_write_json(self.out_dir / "summary.json", result.to_dict())
        return result

    def _roll_back(self, result: SplitTrainResult, why: str, writer, progress) -> int:
        """After SessionLost: reconnect, restore the shared checkpoint, forget the undone steps' losses."""
        result.rollbacks += 1
        step = self.recover(why)
        if step < result.first_step:
            result.losses.clear()
            result.first_step = step
        else:
            del result.losses[step - result.first_step:]
        writer.log("rollback", step, reason=why)
        progress.update(step, f"rolled back to step {step}")
        return step

    def _eval_and_log(self, step: int, writer) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.evaluate(step)
        if metrics:
            writer.log("eval", step, **metrics)
            self.log(eval_log(metrics["eval_loss"], metrics["best_eval_loss"]))
            if self.hooks.on_eval:  # as the engine's: the evaluation's seconds beside its metrics
                self.hooks.on_eval({"step": step, **metrics, "eval_s": round(time.perf_counter() - t0, 4)})
        return metrics

    def _close_session(self) -> None:
        """Free the server's session now (paused runs reopen it from their checkpoint)."""
        try:
            self.client.call("CloseSession", pb.CloseSessionRequest(session_id=self.session_id), retry=False)
        except (SmolforgeError, SessionLost):
            pass  # the server frees it after its timeout anyway

    def close(self) -> None:
        self.client.close()


# `split train`'s flags for the settings a refused resume names (`train.resume_point`); it has no --resume-new-data
SPLIT_FLAGS = {"batch_size": "--batch-size", "grad_accum": "--gradient-accumulation-steps", "seed": "--seed",
               "max_length": "--max-seq-length", "packing": None, "new_data": None}


def split_step_meaning(cfg: SplitTrainConfig, rows: list) -> StepMeaning:
    """What one step of a split run is (one process: the client's batch x accumulation; no packing)."""
    return StepMeaning(rows_per_step=cfg.batch_size * cfg.gradient_accumulation_steps, batch_size=cfg.batch_size,
                       grad_accum=cfg.gradient_accumulation_steps, world=1, seed=cfg.seed,
                       max_length=cfg.max_seq_length, packing=False, data_rows=len(rows),
                       data_sha256=data_fingerprint(rows))


def _load_splits(cfg: SplitTrainConfig, tokenizer):
    return load_checked_splits(cfg.data_spec(), tokenizer)


def _printer():
    from rich.console import Console

    con = Console(stderr=True, highlight=False)
    return lambda msg: con.print(msg, markup=False, soft_wrap=True)


def train_split(cfg: SplitTrainConfig, hooks: TrainHooks | None = None, *, splits=None,
                tokenizer=None) -> SplitTrainResult:
    """Run split training as `cfg` says against a running trunk server; returns the summary."""
    trainer = SplitTrainer(cfg, hooks, splits=splits, tokenizer=tokenizer)
    try:
        return trainer.train()
    finally:
        trainer.close()
