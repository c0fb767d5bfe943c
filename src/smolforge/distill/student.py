"""Streaming students: train on teacher shards as they appear, with KD + CE, any PEFT method.

A student is the one driver around the one trainer (`smolforge.train.driver`, `train.loop.Trainer`)
with two parameters of its own: its data source (`StreamSource`) is a stream of teacher shards that
may still be being written (a student starts on the first shard while the teachers make the rest),
and its loss is KD + CE (`smolforge.distill.losses.mixed_loss`). So it has the engine's AMP,
clipping, accumulation, schedules, resume, checkpoints and strategies, by construction.

Data order is deterministic given the order in which shards arrived (recorded in checkpoints):
epoch 0 is each shard's seeded permutation in arrival order; later epochs are seeded
permutations of every row. So a resumed student sees exactly the rows it would have seen.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from smolforge.config import DataSpec, PeftSpec, default_lr
from smolforge.data.encode import encode_all, encode_example, ensure_chat_template, render
from smolforge.data.formats import Example
from smolforge.data.splits import read_spec
from smolforge.distill.losses import KDConfig, mixed_loss
from smolforge.distill.on_policy import OnPolicySampler, OnPolicySettings, is_on_policy_step
from smolforge.distill.rows import Row
from smolforge.distill.shard_source import ShardSource
from smolforge.distill.store import Shard, tokenizer_hash
from smolforge.errors import SmolforgeError
from smolforge.models.families import turn_end_id
from smolforge.models.loading import load_model, load_tokenizer
from smolforge.models.peft_methods import apply_peft, trainable_summary
from smolforge.train.driver import Outcome, Run, RunHooks, RunSettings, StepInfo, drive, prepare_process
from smolforge.train.evaluate import eval_loss_sums, exact_match_counts, perplexity
from smolforge.train.faults import HoldAt, fault_hold_step, held_message, stay_held
from smolforge.train.rendering import system_role
from smolforge.train.strategy import Strategy

IGNORE = -100
EventFn = Callable[..., None]


@dataclass
class StudentConfig:
    """One student run. `output_dir` is e.g. `<run>/output/student_0`; the adapter goes in `<peft>_adapter/`."""

    base_model: str
    output_dir: str
    peft: PeftSpec = field(default_factory=PeftSpec)
    kd: KDConfig = field(default_factory=KDConfig)
    max_steps: int | None = None
    epochs: float = 1.0
    batch_size: int = 8
    grad_accum: int = 1
    lr: float | None = None  # None: the PEFT method's default (config.DEFAULT_LR)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    scheduler: str = "cosine"
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0
    max_length: int = 256
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"  # as TrainConfig.precision: the engine's measured choice of autocast dtype
    dtype: str = "fp32"  # the base's weights, as TrainConfig.dtype (a LoRA adapter stays fp32 on a bf16 base)
    teacher_dtype: str = "fp32"  # the on-policy teacher's weights (DistillSettings.teacher_dtype)
    num_threads: int | None = None
    save_every: int = 0
    keep_last: int = 2
    resume: bool = False
    eval_data: str | None = None  # dataset whose held-out split is used for eval ('bundled', a JSONL)
    max_eval_samples: int | None = 200
    eval_accuracy: bool = True
    max_new_tokens: int = 16
    # On-policy distillation (GKD): the fraction of steps trained on the student's own samples, scored by
    # `teacher_model` loaded in this process (default: the store's teacher). See distill/on_policy.py.
    on_policy_ratio: float = 0.0
    on_policy_temperature: float = 1.0
    on_policy_start: float = 0.0  # the fraction of the steps trained off-policy before any on-policy step
    teacher_model: str | None = None
    wait_timeout_s: float = 900.0  # how long to wait for one shard before giving up
    poll_s: float = 0.2
    quiet: bool = True

    def __post_init__(self) -> None:
        if self.lr is None:
            self.lr = default_lr(self.peft.method)


# ------------------------------------------------------------------------------ rows from records

def template_tail_ids(tokenizer) -> list[int]:
    """Tokens the chat template puts after an assistant turn's end (`families.turn_end_id`: the template's
    end-of-turn token, else eos; ChatML's `<|im_end|>` and Phi-3's `<|end|>` are followed by a newline).

    The data module trains on them (they are part of the assistant turn), so a student trained on
    teacher ids must see them too, or its held-out loss is not comparable with plain SFT.
    """

    end = turn_end_id(tokenizer)
    eos = tokenizer.convert_ids_to_tokens(end) if end is not None else None
    if not eos:
        return []
    text = render(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "MARK"}], False)
    at = text.rfind("MARK")
    after = text[at + len("MARK"):]
    if not after.startswith(eos):
        return []
    tail = after[len(eos):]
    return tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []


def rows_from_shard(shard: Shard, tokenizer, same_tokenizer: bool, max_length: int,
                    tail_ids: list[int] | None = None) -> list[Row]:
    """Student rows: teacher ids + top-k when tokenizers agree, else re-tokenized teacher text.

    With the teacher's ids, a response that ended its turn (`families.turn_end_id`) also gets the template's
    tail tokens (`template_tail_ids`) as CE-only targets (the teacher gave no logits for them).
    """

    rows: list[Row] = []
    eos = turn_end_id(tokenizer)
    tail_ids = list(tail_ids or [])
    for rec in shard.records:
        if same_tokenizer:
            prompt, resp = list(rec.prompt_ids), list(rec.response_ids)
            if not prompt or not resp or len(prompt) >= max_length:
                continue
            n_kd = len(resp)
            if resp[-1] == eos:
                resp = resp + tail_ids
            resp = resp[: max_length - len(prompt)]
            n_kd = min(n_kd, len(resp))
            row = Row(prompt + resp, [IGNORE] * len(prompt) + resp)
            if rec.has_topk:
                row.topk_logprobs = np.asarray(rec.topk_logprobs[:n_kd], dtype=np.float32)
                row.topk_indices = np.asarray(rec.topk_indices[:n_kd], dtype=np.int64)
                row.tail = np.asarray(rec.tail_mass[:n_kd], dtype=np.float32)
            rows.append(row)
        else:
            ex = Example(source=f"shard {shard.shard_id}",
                         messages=list(rec.prompt_messages) + [{"role": "assistant", "content": rec.response_text}])
            ids, labels = encode_example(tokenizer, ex, system_role(tokenizer))
            ids, labels = ids[:max_length], labels[:max_length]
            if all(x == IGNORE for x in labels[1:]):
                continue
            rows.append(Row(ids, labels))
    return rows


def collate_rows(rows: list[Row], pad_id: int, k: int) -> dict[str, torch.Tensor]:
    """Right-padded batch plus teacher rows aligned with the target tokens in row-major order."""
    width = max(len(r.input_ids) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    lp, ix, tail, weight = [], [], [], []
    for i, r in enumerate(rows):
        L = len(r.input_ids)
        input_ids[i, :L] = torch.tensor(r.input_ids)
        labels[i, :L] = torch.tensor(r.labels)
        attention[i, :L] = 1
        targets = sum(1 for x in r.labels[1:] if x != IGNORE)
        n_kd = 0 if r.topk_logprobs is None else min(len(r.topk_logprobs), targets)
        if n_kd:
            lp.append(torch.from_numpy(r.topk_logprobs[:n_kd]))
            ix.append(torch.from_numpy(r.topk_indices[:n_kd]))
            tail.append(torch.from_numpy(r.tail[:n_kd]))
            weight.append(torch.ones(n_kd))
        rest = targets - n_kd  # tokens without teacher logits (template tail, text-only rows): CE only
        if rest:
            lp.append(torch.zeros(rest, k))
            ix.append(torch.arange(k).repeat(rest, 1))
            tail.append(torch.zeros(rest))
            weight.append(torch.zeros(rest))
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention}
    if k > 0 and any(r.topk_logprobs is not None for r in rows):
        batch.update(teacher_logprobs=torch.cat(lp), teacher_indices=torch.cat(ix), teacher_tail=torch.cat(tail),
                     kd_weight=torch.cat(weight))
    return batch


# ------------------------------------------------------------------------------------ the stream

class RowStream:
    """Deterministic row order over shards arriving one by one (see module docstring)."""

    def __init__(self, source: ShardSource, to_rows: Callable[[Shard], list[Row]], seed: int,
                 on_shard: Callable[[Shard, int], None] | None = None, replay_order: list[int] | None = None):
        self.source, self.to_rows, self.seed = source, to_rows, seed
        self.on_shard = on_shard
        self.shard_rows: dict[int, list[Row]] = {}
        self.arrival: list[int] = []
        self.stream: list[Row] = []
        self.exhausted = False
        self.epoch = 0
        self._replay = list(replay_order or [])

    def _perm(self, n: int, salt: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + salt)
        return torch.randperm(n, generator=g).tolist()

    @property
    def order(self) -> list[int]:
        """The shard order to record in a checkpoint: what arrived, then what is still to be replayed."""
        return self.arrival + self._replay

    def _pull(self) -> bool:
        """Add one shard (epoch 0) or one more epoch to the stream; False when nothing more can come."""
        if not self.exhausted:
            shard = self.source.get_shard(self._replay[0]) if self._replay else self.source.next_shard()
            if self._replay:
                self._replay.pop(0)  # only once fetched: a stop while waiting keeps it in `order`
            if shard is not None:
                rows = self.to_rows(shard)
                self.shard_rows[shard.shard_id] = rows
                self.arrival.append(shard.shard_id)
                self.stream += [rows[i] for i in self._perm(len(rows), 7919 * (shard.shard_id + 1))]
                if self.on_shard:
                    self.on_shard(shard, len(rows))
                return True
            self.exhausted = True
        all_rows = [r for sid in sorted(self.shard_rows) for r in self.shard_rows[sid]]
        if not all_rows:
            return False
        self.epoch += 1
        self.stream += [all_rows[i] for i in self._perm(len(all_rows), -self.epoch)]
        return True

    def take(self, start: int, count: int) -> list[Row]:
        while len(self.stream) < start + count:
            if not self._pull():
                got = (f"{len(self.arrival)} shard(s) arrived ({', '.join(map(str, self.arrival))}), none with a "
                       "usable row" if self.arrival else "no shard arrived: the teachers reported none for it")
                raise SmolforgeError(f"the teacher produced no usable training rows for this student: {got}",
                                     fix="check max_length (prompts longer than it are dropped) and the teacher's outputs")
        return self.stream[start:start + count]


# ----------------------------------------------------------------------------------- the student

@dataclass
class StudentResult:
    output_dir: str
    adapter_dir: str | None
    steps: int
    final_loss: float | None
    mode: str  # "logit" (top-k KD) or "sequence" (teacher text only)
    eval: dict[str, Any] = field(default_factory=dict)
    shards: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    started_at: float = 0.0
    first_step_at: float | None = None
    tokens_per_s: float = 0.0
    trainable_params: int = 0
    total_params: int = 0
    stopped: str | None = None
    warnings: list[str] = field(default_factory=list)
    on_policy_steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def evaluate_student(model, tokenizer, eval_data: str | None, cfg: StudentConfig, device,
                     eval_examples: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Eval loss/perplexity and exact-match accuracy on held-out examples (the engine's eval code).

    The examples come from `eval_data`'s held-out split, or as records ({"messages": [...]}) sent by
    the orchestrator, so a student on a node without the dataset file can still evaluate.
    """

    if eval_examples is not None:
        examples = [Example("eval", messages=r["messages"]) for r in eval_examples]
    elif eval_data:
        _train, examples, _fmt, _skipped = read_spec(DataSpec(path=eval_data, max_eval_samples=cfg.max_eval_samples,
                                                              max_samples=1), prompts_only=True)
    else:
        return {}
    rows, stats = encode_all(tokenizer, examples, cfg.max_length, system_role=system_role(tokenizer))
    examples = stats.kept  # as rendered: system turns folded where the template has no system role
    out: dict[str, Any] = {"examples": len(examples)}  # the held-out examples scored (after max_eval_samples)
    loss_sum, count = eval_loss_sums(model, rows, tokenizer.pad_token_id, 32, device)
    if count:
        out["eval_loss"] = loss_sum / count
        out["perplexity"] = perplexity(out["eval_loss"])
    with_answers = [e for e in examples if e.messages]
    if cfg.eval_accuracy and with_answers:
        correct, total = exact_match_counts(model, tokenizer, with_answers, cfg.max_new_tokens, 64, device)
        if total:
            out["accuracy"] = correct / total
    return out


def _on_policy_sampler(cfg: StudentConfig, store_teacher: str | None, tokenizer, my_hash: str,
                       device: torch.device, k: int) -> OnPolicySampler:
    """The teacher that scores the student's samples, loaded in this process (once per student run)."""
    from smolforge.distill.teacher import HFTeacher

    name = cfg.teacher_model or store_teacher
    if not name:
        raise SmolforgeError("on-policy distillation needs the teacher model, and the store does not name one",
                             fix="pass teacher_model (--teacher) with --on-policy-ratio")
    teacher = HFTeacher(name, device=str(device), dtype=cfg.teacher_dtype)
    if teacher.tok_hash != my_hash:
        raise SmolforgeError(f"on-policy distillation needs the teacher ({name}) and the student ({cfg.base_model}) "
                             "to share a tokenizer: the teacher scores the student's own token ids",
                             fix="use --on-policy-ratio 0 for a student with another tokenizer (sequence-level KD)")
    return OnPolicySampler(OnPolicySettings(ratio=cfg.on_policy_ratio, temperature=cfg.on_policy_temperature,
                                            max_new_tokens=cfg.max_new_tokens, top_k=k or 32), teacher, tokenizer, cfg.seed)


def _hold(who: str, step: int, at: int, emit: EventFn, should_stop: Callable[[], str | None] | None) -> None:
    """Fault `hold-step` N = `at` (`smolforge.train.faults`): say so in a `held` event (what a test
    waits for), then stay after `step` until released or until the job asks this student to stop (a
    pause or cancel then lands at this step, as the loop's next stop decision)."""
    emit("held", step=step, message=held_message(who, step))

    def asked() -> str | None:
        what = should_stop() if should_stop else None
        return f"the job asked for a {what}" if what else None

    stay_held(who, step, at, asked)


class StreamSource:
    """The student's data (a driver `Source`, `smolforge.train.driver`): each step's rows of a stream of
    teacher shards (`RowStream`), rank r taking its slice; some steps rewritten on-policy.

    It also decides logit versus sequence-level KD as shards arrive (a teacher whose tokenizer differs
    from the student's gives text only), recording that, the shards and the first step in `result`.
    """

    def __init__(self, cfg: StudentConfig, source: ShardSource, latest: Path | None, *, tokenizer,
                 teacher_tokenizer_hash: str | None, result: StudentResult, emit: EventFn, strategy: Strategy,
                 model: torch.nn.Module, device: torch.device):
        self.cfg, self.tokenizer, self.result, self.emit = cfg, tokenizer, result, emit
        self.strategy, self.model, self.device = strategy, model, device
        self.my_hash = tokenizer_hash(tokenizer)
        self.same = teacher_tokenizer_hash is None or teacher_tokenizer_hash == self.my_hash
        self.k, self.teacher = 0, None  # top-k of the teacher's logits (0: none); its name (on-policy)
        self.tail_ids = template_tail_ids(tokenizer)
        self.sampler: OnPolicySampler | None = None  # built on the first on-policy step (loads the teacher)
        # Resume: the shard order of the checkpoint is replayed exactly.
        replay = list(json.loads((latest / "state.json").read_text()).get("shard_order", [])) if latest else []
        self.stream = RowStream(source, self._to_rows, cfg.seed, on_shard=self._on_shard, replay_order=replay)
        self.per_step = cfg.batch_size * cfg.grad_accum
        self.rows_per_step = self.per_step * strategy.world
        self.expected = source.expected_rows()
        if cfg.max_steps:
            self.steps = cfg.max_steps
        elif self.expected:
            self.steps = max(1, math.ceil(cfg.epochs * self.expected / self.rows_per_step))
        else:
            raise SmolforgeError("cannot tell how many steps to train: the teacher plan is unknown",
                                 fix="pass max_steps")

    def _to_rows(self, shard: Shard) -> list[Row]:
        cfg, result = self.cfg, self.result
        if shard.manifest.get("tokenizer_hash") != self.my_hash and self.same:
            self.same = False
        if not self.same and result.mode != "sequence":
            result.mode = "sequence"
            msg = (f"student {cfg.base_model} has a different tokenizer than teacher "
                   f"{shard.manifest.get('teacher')} (vocab hash {self.my_hash} != {shard.manifest.get('tokenizer_hash')}): "
                   "falling back to sequence-level KD (training on the teacher's text, no logits)")
            warnings.warn(msg, stacklevel=2)
            result.warnings.append(msg)
            self.emit("student_sequence_kd", warning=msg)
        if self.same and shard.manifest.get("has_logits", True):
            self.k = int(shard.manifest.get("k", 0))
        self.teacher = self.teacher or shard.manifest.get("teacher")
        return rows_from_shard(shard, self.tokenizer, self.same, cfg.max_length, self.tail_ids)

    def _on_shard(self, shard: Shard, n_rows: int) -> None:
        info = {"shard": shard.shard_id, "sha256": shard.manifest["sha256"], "rows": n_rows, "time": time.time()}
        self.result.shards.append(info)
        self.emit("student_shard", **info)

    def batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        # The global batch of a step is world × per_step rows of the stream; rank r takes its slice.
        cfg, rank = self.cfg, self.strategy.rank
        rows = self.stream.take((step * self.strategy.world + rank) * self.per_step, self.per_step)  # waits for shards
        if self.result.first_step_at is None:
            self.result.first_step_at = time.time()
            self.emit("student_started", step=step, shards_ready=len(self.stream.arrival))
        on_policy = is_on_policy_step(cfg.on_policy_ratio, cfg.seed, step, first=int(cfg.on_policy_start * self.steps))
        if on_policy:
            if self.sampler is None:
                self.sampler = _on_policy_sampler(cfg, self.teacher, self.tokenizer, self.my_hash, self.device, self.k)
            with self.strategy.whole_model(self.model):
                rows = self.sampler.rewrite(rows, self.model, self.device, step, rank)
            self.result.on_policy_steps += 1
        k = self.sampler.s.top_k if on_policy and self.sampler else self.k
        micro = [collate_rows(rows[j:j + cfg.batch_size], self.tokenizer.pad_token_id, k)
                 for j in range(0, len(rows), cfg.batch_size)]
        if on_policy:
            for m in micro:
                m["on_policy"] = torch.ones(())
        return micro

    def epoch(self, done: int) -> float:
        return done * self.rows_per_step / self.expected if self.expected else 0.0

    def note(self) -> str:
        return f" · shards {len(self.stream.arrival)}"

    def replay_state(self) -> dict[str, Any]:
        return {"shard_order": self.stream.order}


def student_settings(cfg: StudentConfig, strategy: Strategy) -> RunSettings:
    """What the driver reads of a `StudentConfig`: no periodic eval, and no final checkpoint (a student's
    product is its adapter; a checkpoint exists to resume or to move it to another node)."""
    return RunSettings(output_dir=cfg.output_dir, peft_method=cfg.peft.method, lr=float(cfg.lr),
                       weight_decay=cfg.weight_decay, scheduler=cfg.scheduler, warmup_steps=cfg.warmup_steps,
                       min_lr_ratio=cfg.min_lr_ratio, precision=cfg.precision, max_grad_norm=cfg.max_grad_norm,
                       save_every=cfg.save_every, keep_last=cfg.keep_last, resume=cfg.resume,
                       quiet=cfg.quiet or not strategy.is_main, label=f"student {Path(cfg.output_dir).name}",
                       final_checkpoint=False, checkpoint_meta={"model": cfg.base_model})


def _load_student(cfg: StudentConfig, device: torch.device, model, tokenizer) -> tuple[Any, torch.nn.Module]:
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.base_model)
    ensure_chat_template(tokenizer)
    if model is None:
        # Seed only what we build: a caller passing `model` seeded its init itself, and torch's RNG is
        # process-wide, so seeding here would reset it under another thread building its own student.
        torch.manual_seed(cfg.seed)
        model = load_model(cfg.base_model, device=device, dtype=cfg.dtype, training=True)
        model = apply_peft(model, cfg.peft)
    model.to(device)
    return tokenizer, model


def train_student(cfg: StudentConfig, source: ShardSource, *, teacher_tokenizer_hash: str | None = None,
                  on_event: EventFn | None = None, should_stop: Callable[[], str | None] | None = None,
                  on_step: Callable[[dict], None] | None = None, model=None, tokenizer=None,
                  eval_examples: list[dict[str, Any]] | None = None,
                  on_checkpoint: Callable[[Path, int], None] | None = None,
                  strategy: Strategy | None = None) -> StudentResult:
    """Train one student from a shard stream; writes `<output_dir>/<peft>_adapter/` and summary.json.

    The run is the one driver's (`smolforge.train.driver`) with the shard stream as its data
    (`StreamSource`) and KD + CE as its loss. `on_checkpoint(path, step)` follows every `save_every`
    checkpoint (not a pause's, which goes back with the result): on a cluster the worker ships it to
    the driver, so a student whose worker dies restarts from it elsewhere. `strategy` shares the
    student's steps with other ranks (each takes its slice of every step's rows of the stream).
    """
    strategy = strategy or Strategy()
    emit = on_event or (lambda *a, **k: None)
    if hasattr(source, "attach_events"):
        source.attach_events(emit)
    t_start = time.time()
    device = prepare_process(cfg.num_threads, cfg.device, strategy)
    tokenizer, model = _load_student(cfg, device, model, tokenizer)
    trainable, total_params = trainable_summary(model)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = StudentResult(output_dir=str(out_dir), adapter_dir=None, steps=0, final_loss=None, mode="logit",
                           started_at=t_start, trainable_params=trainable, total_params=total_params)
    hold = HoldAt(fault_hold_step())  # fault injection for tests (train/faults.py): read once, here
    who = "student" if strategy.world == 1 else f"student rank {strategy.rank}"

    def step_hook(info: StepInfo) -> None:
        if on_step:
            on_step({"step": info.step, "max_steps": info.max_steps, "loss": info.loss, "lr": info.lr,
                     "tokens_per_s": info.tokens_per_s, "samples_done": info.samples_done,
                     "samples_total": info.samples_total})
        if hold.due(info.step):
            _hold(who, info.step, hold.step, emit, should_stop)

    def evaluate() -> dict[str, Any]:  # the main rank evaluates alone, on the whole weights
        with strategy.whole_model(model):
            return evaluate_student(model, tokenizer, cfg.eval_data, cfg, device, eval_examples) if strategy.is_main else {}

    def summarize(o: Outcome) -> StudentResult:
        result.steps, result.final_loss, result.stopped = o.steps, o.final_loss, o.stopped
        result.tokens_per_s, result.eval, result.adapter_dir = o.tokens_per_s, o.eval, o.adapter_dir
        if o.stopped is None and strategy.is_main:
            emit("student_finished", steps=result.steps, eval=result.eval, adapter=result.adapter_dir)
        result.seconds = time.time() - t_start
        return result

    return drive(Run(
        settings=student_settings(cfg, strategy), model=model, tokenizer=tokenizer, device=device, strategy=strategy,
        source=lambda latest: StreamSource(cfg, source, latest, tokenizer=tokenizer, result=result, emit=emit,
                                           teacher_tokenizer_hash=teacher_tokenizer_hash, strategy=strategy,
                                           model=model, device=device),
        loss_sum=lambda logits, m: mixed_loss(logits.float(), m, cfg.kd, 1.0).loss,
        evaluate=evaluate, summarize=summarize,
        hooks=RunHooks(on_step=step_hook, should_stop=should_stop,
                       on_checkpoint=(lambda path, step, pausing: None if pausing else on_checkpoint(path, step))
                       if on_checkpoint else None,
                       on_resume=lambda path, step: emit("student_resumed", step=step, checkpoint=str(path)),
                       on_start=lambda _start, steps: emit("student_waiting", steps=steps))))
