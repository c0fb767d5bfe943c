"""The trunk server: runs layers [sp1, sp2) for any number of clients, one session each.

What it keeps per session: its own LoRA on the trunk (the frozen base weights are loaded once and
shared by all sessions), an AdamW over that LoRA, and the autograd graph of every in-flight
(step, micro-batch) between its Forward and its Backward. Gradients accumulate over a step's
micro-batches; the optimizer steps when the client says so, with the client's learning rate and
clip coefficient, so the trunk moves in lockstep with the bottom and top.

Robustness rules:
- every call but Health needs the bearer token (UNAUTHENTICATED otherwise);
- a malformed message is INVALID_ARGUMENT and the session stays usable; nothing crashes the server;
- an unknown session is NOT_FOUND, which tells a client that the server restarted, so it rolls
  back to the last checkpoint both sides share;
- a repeated Backward returns the cached answer and a repeated Step is a no-op, so a client may
  retry a call whose reply was lost without applying a gradient twice;
- a session idle for longer than the timeout (a client that vanished) is freed.

Generation sessions (inference through the split: `OpenGeneration`, `GenerateStep`,
`CloseGeneration`) live in `trunk_generate`: a trained trunk LoRA sent by the client and a KV
cache each, under the same token and the same rules.
"""

from __future__ import annotations

import copy
import hmac
import logging
import math
import re
import secrets
import threading
import time
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from torch import nn

from smolforge import __version__
from smolforge.config import PeftSpec
from smolforge.errors import SmolforgeError
from smolforge.net import is_loopback, bind_refusal
from smolforge.models.loading import pick_device
from smolforge.paths import home, safe_join
from smolforge.split import checkpoint as ckpt
from smolforge.split.calls import CallError, check_length, check_mask, check_positions, model_context, not_found
from smolforge.split.calls import invalid as _invalid
from smolforge.split.calls import precondition as _precondition
from smolforge.split.codec import CODECS, CodecError, decode, encode
from smolforge.split.lora import apply_lora, load_lora_state, lora_state, targets
from smolforge.split.partition import Trunk, load_parts
from smolforge.split.protocol import (
    AUTH_HEADER,
    SERVER_OPTIONS,
    MAX_MESSAGE_BYTES,
    OPEN_METHODS,
    pb,
    pb_grpc,
    server_credentials,
)
from smolforge.split.rng import seeded_rng
from smolforge.split.trunk_generate import Generations
from smolforge.train.engine import available_cpus

log = logging.getLogger("smolforge.split.server")
SESSION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass
class ServeConfig:
    """Everything `smolforge split serve` takes."""

    model: str
    split_point_1: int
    split_point_2: int
    use_lora: bool = True
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    target_modules: list[str] | None = None
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 50051
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    checkpoint_dir: str | None = None
    session_timeout: float = 900.0
    max_sessions: int = 8
    max_inflight: int = 64
    keep_last: int = 3
    num_threads: int | None = None
    max_workers: int = 8
    generation_timeout: float = 300.0  # free a generation (and its KV cache) idle this long
    max_generations: int = 16

    def peft(self) -> PeftSpec:
        return PeftSpec(method="lora", r=self.lora_rank, alpha=self.lora_alpha, dropout=self.lora_dropout,
                        target_modules=self.target_modules)


@dataclass
class Session:
    id: str
    name: str
    trunk: Trunk
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer | None
    codec: str
    seed: int
    mixed_precision: bool
    has_dropout: bool
    step: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    inflight: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    done: dict[tuple[int, int], pb.BackwardReply] = field(default_factory=dict)

    def touch(self) -> None:
        self.last_seen = time.monotonic()


def _has_dropout(module: nn.Module, config) -> bool:
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules()):
        return True
    return float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0


class TrunkService(pb_grpc.TrunkServicer):
    """The gRPC servicer. Model state is built once; sessions come and go."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        # only the trunk's tensors are read: embeddings, head and the client's layers never get storage here
        loaded = load_parts(cfg.model, cfg.split_point_1, cfg.split_point_2, ("trunk",), self.device)
        self.arch, self.fingerprint, self.base = loaded.parts.arch, loaded.fingerprint, loaded.parts.trunk
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.base.train()
        self.peft = cfg.peft()
        self.ckpt_root = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else home() / "split" / "server-checkpoints"
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.rng_lock = threading.Lock()  # dropout draws from the process-wide RNG
        self.max_positions = model_context(self.base.config)  # every Forward is checked against it
        # what the trunk computed and what it refused before computing (tests and `describe` read it)
        self.counts: Counter[str] = Counter()
        self.generations = Generations(self.arch, self.base.config, self.device, self._new_trunk,
                                       timeout=cfg.generation_timeout, limit=cfg.max_generations)

    # ----------------------------------------------------------------- helpers

    def _session(self, session_id: str) -> Session:
        with self.lock:
            sess = self.sessions.get(session_id)
        if sess is None:
            raise not_found("session", session_id)
        sess.touch()
        return sess

    def _session_root(self, name: str) -> Path:
        if not SESSION_NAME.match(name or ""):
            raise _invalid(f"session name {name!r} must be 1-64 letters, digits, '.', '_' or '-'")
        return safe_join(self.ckpt_root, name)

    def info_reply(self, session_name: str = "") -> pb.InfoReply:
        steps = ckpt.valid_steps(self._session_root(session_name)) if session_name else []
        return pb.InfoReply(
            model_id=self.cfg.model, model_type=self.arch.model_type, model_fingerprint=self.fingerprint,
            num_layers=self.arch.num_layers, hidden_size=self.arch.hidden_size,
            split_point_1=self.cfg.split_point_1, split_point_2=self.cfg.split_point_2, codecs=list(CODECS),
            active_sessions=len(self.sessions), checkpoint_steps=steps, version=__version__,
            device=str(self.device), lora=self._lora_msg(), max_message_bytes=MAX_MESSAGE_BYTES,
            active_generations=self.generations.active())

    def _lora_msg(self) -> pb.LoraSpec:
        return pb.LoraSpec(enabled=self.cfg.use_lora, r=self.peft.r, alpha=self.peft.alpha, dropout=self.peft.dropout,
                           target_modules=targets(self.peft, self.arch.model_type))

    def _new_trunk(self, seed: int, peft: PeftSpec | None | str = "server") -> tuple[Trunk, list[nn.Parameter]]:
        """A session's trunk with this server's LoRA; a generation brings its own `peft` (None: no LoRA)."""
        # A structural copy whose frozen base weights are the shared tensors (the memo maps them to
        # themselves): each session adds only its LoRA and optimizer state.
        memo = {id(p): p for p in self.base.parameters()}
        trunk = copy.deepcopy(self.base, memo)
        spec = (self.peft if self.cfg.use_lora else None) if isinstance(peft, str) else peft
        params = apply_lora(trunk, spec, seed, self.arch.canonical) if spec is not None else []
        trunk.to(self.device)
        return trunk, params

    def _tensor(self, msg: pb.Tensor, what: str) -> torch.Tensor:
        try:
            return decode(msg)
        except CodecError as err:
            raise _invalid(f"{what}: {err}") from None

    def _inputs(self, req: pb.ForwardRequest) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The hidden states, mask and positions of a Forward, checked before anything is computed: the
        sequence within the model's context (from the declared shape, before decoding), the shapes, the
        positions below the context. INVALID_ARGUMENT otherwise (counted in `counts["refused"]`)."""
        try:
            return self._checked_inputs(req)
        except CallError:
            self.counts["refused"] += 1
            raise

    def _checked_inputs(self, req: pb.ForwardRequest) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_length(req.hidden.shape, self.max_positions)
        hidden = self._tensor(req.hidden, "hidden")
        if hidden.ndim != 3 or hidden.shape[0] < 1 or hidden.shape[1] < 1 or hidden.shape[2] != self.arch.hidden_size:
            raise _invalid(f"hidden must be [batch, seq, {self.arch.hidden_size}], got {list(hidden.shape)}")
        if not hidden.is_floating_point():
            raise _invalid("hidden must be a floating tensor")
        b, t = hidden.shape[:2]
        mask = check_mask(self._tensor(req.attention_mask, "attention_mask"), b, t)
        return hidden, mask, check_positions(self._tensor(req.positions, "positions"), b, t, limit=self.max_positions)

    def _autocast(self, sess: Session):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=sess.mixed_precision)

    # ----------------------------------------------------------------- RPCs

    def _check_pairing(self, req) -> None:
        """The client's model and split points must be this server's (OpenSession, OpenGeneration)."""
        cfg = self.cfg
        if (req.split_point_1, req.split_point_2) != (cfg.split_point_1, cfg.split_point_2):
            raise _precondition(
                f"split points differ: this server runs the trunk layers [{cfg.split_point_1}, {cfg.split_point_2}) "
                f"(--split-point-1 {cfg.split_point_1} --split-point-2 {cfg.split_point_2}), the client asked for "
                f"[{req.split_point_1}, {req.split_point_2}); start the client with the server's split points")
        if req.model_fingerprint != self.fingerprint:
            raise _precondition(
                f"model differs: this server serves {cfg.model!r} (fingerprint {self.fingerprint}), the client loaded "
                f"{req.model_id!r} (fingerprint {req.model_fingerprint or 'none'}); "
                "both sides need the same checkpoint")
        if req.codec not in CODECS:
            raise _invalid(f"unknown codec {req.codec!r}; use one of {', '.join(CODECS)}")

    def OpenSession(self, req: pb.OpenSessionRequest, context) -> pb.OpenSessionReply:
        cfg = self.cfg
        self._check_pairing(req)
        if not (math.isfinite(req.weight_decay) and req.weight_decay >= 0):
            raise _invalid(f"weight_decay must be finite and >= 0, got {req.weight_decay}")
        root = self._session_root(req.session_name)
        with self.lock:
            replaced = [s for s in self.sessions.values() if s.name == req.session_name]
            if len(self.sessions) - len(replaced) >= cfg.max_sessions:
                raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the server holds its maximum of {cfg.max_sessions} sessions; try again later")
        trunk, params = self._new_trunk(int(req.seed))
        optimizer = None
        if params:
            optimizer = torch.optim.AdamW(params, lr=0.0, weight_decay=float(req.weight_decay))
        step = 0
        if req.resume_step > 0:
            try:
                path, state = ckpt.read(root, int(req.resume_step))
            except FileNotFoundError:
                have = ckpt.valid_steps(root)
                raise _precondition(f"this server holds no checkpoint of session {req.session_name!r} at step "
                                    f"{req.resume_step} (it holds {have or 'none'})") from None
            if state.get("fingerprint") != self.fingerprint:
                raise _precondition(f"the checkpoint at {path} was made with another model")
            if params:
                load_lora_state(trunk, ckpt.load_tensors(path, "trunk_lora"), self.arch.canonical)
            if optimizer is not None:
                optimizer.load_state_dict(ckpt.load_blob(path, "optim")["optimizer"])
            step = int(state["step"])
        sess = Session(id=secrets.token_hex(16), name=req.session_name, trunk=trunk, params=params,
                       optimizer=optimizer, codec=req.codec, seed=int(req.seed),
                       mixed_precision=bool(req.mixed_precision), has_dropout=_has_dropout(trunk, self.base.config),
                       step=step)
        sess.trunk.train()
        with self.lock:
            for old in replaced:
                self.sessions.pop(old.id, None)
            self.sessions[sess.id] = sess
        log.info("session %s opened (%s, codec %s, step %d%s)", req.session_name, sess.id[:8], req.codec, step,
                 f", replaced {len(replaced)}" if replaced else "")
        return pb.OpenSessionReply(session_id=sess.id, step=step, trainable_params=sum(p.numel() for p in params),
                                   server_model_id=cfg.model, lora=self._lora_msg(),
                                   session_timeout_s=cfg.session_timeout)

    def Forward(self, req: pb.ForwardRequest, context) -> pb.ForwardReply:
        sess = self._session(req.session_id)
        hidden, mask, pos = self._inputs(req)
        hidden, mask, pos = hidden.to(self.device), mask.to(self.device), pos.to(self.device)
        dtype = next(self.base.parameters()).dtype
        self.counts["forwards"] += 1
        with sess.lock:
            if not req.train:
                with torch.no_grad(), self._autocast(sess):
                    sess.trunk.eval()
                    try:
                        out = sess.trunk(hidden.to(dtype), mask, pos)
                    finally:
                        sess.trunk.train()
                return pb.ForwardReply(hidden=encode(out, sess.codec))
            if req.step != sess.step + 1:
                raise _precondition(f"forward for step {req.step}, but this session is at step {sess.step} "
                                    f"(the next step is {sess.step + 1})")
            key = (int(req.step), int(req.micro_batch))
            if key not in sess.inflight and len(sess.inflight) >= self.cfg.max_inflight:
                raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{len(sess.inflight)} micro-batches await their backward; send those first")
            h_in = hidden.to(dtype).requires_grad_(True)
            lock = self.rng_lock if sess.has_dropout else _NoLock()
            with lock, seeded_rng(sess.seed, "trunk", key[0], key[1], self.device), self._autocast(sess):
                h_out = sess.trunk(h_in, mask, pos)
            sess.inflight[key] = (h_in, h_out)
            sess.done.pop(key, None)
            reply = pb.ForwardReply(hidden=encode(h_out.detach(), sess.codec))
        sess.touch()
        return reply

    def Backward(self, req: pb.BackwardRequest, context) -> pb.BackwardReply:
        sess = self._session(req.session_id)
        key = (int(req.step), int(req.micro_batch))
        with sess.lock:
            if key in sess.done:
                return sess.done[key]  # a retry whose first reply was lost
            if key not in sess.inflight:
                raise _precondition(f"no forward in flight for step {key[0]} micro-batch {key[1]}")
            h_in, h_out = sess.inflight[key]
            grad = self._tensor(req.grad, "grad")
            if tuple(grad.shape) != tuple(h_out.shape) or not grad.is_floating_point():
                raise _invalid(f"grad must have the forward output's shape {list(h_out.shape)}, got {list(grad.shape)}")
            h_out.backward(grad.to(self.device, h_out.dtype))
            del sess.inflight[key]
            reply = pb.BackwardReply(grad=encode(h_in.grad, sess.codec))
            if req.last_micro_batch:
                reply.trunk_grad_norms.extend(grad_norms(sess.params))
            sess.done[key] = reply
        sess.touch()
        return reply

    def Step(self, req: pb.StepRequest, context) -> pb.StepReply:
        sess = self._session(req.session_id)
        with sess.lock:
            if req.step <= sess.step:
                return pb.StepReply(step=sess.step)  # already applied: a retried call
            if req.step != sess.step + 1:
                raise _precondition(f"step {req.step} asked for, but this session is at step {sess.step}")
            if not (math.isfinite(req.lr) and req.lr >= 0):
                raise _invalid(f"learning rate must be finite and >= 0, got {req.lr}")
            if not (math.isfinite(req.clip_coef) and 0 < req.clip_coef <= 1):
                raise _invalid(f"clip_coef must be in (0, 1], got {req.clip_coef}")
            if sess.inflight:
                raise _precondition(f"{len(sess.inflight)} micro-batches of this step still await their backward")
            if sess.optimizer is not None:
                with torch.no_grad():
                    for p in sess.params:
                        if p.grad is not None:
                            p.grad.mul_(req.clip_coef)
                for group in sess.optimizer.param_groups:
                    group["lr"] = req.lr
                sess.optimizer.step()
                sess.optimizer.zero_grad(set_to_none=True)
            sess.step = int(req.step)
            sess.done = {k: v for k, v in sess.done.items() if k[0] >= sess.step}
        return pb.StepReply(step=sess.step)

    def Health(self, req, context) -> pb.HealthReply:
        return pb.HealthReply(status="ok")

    def Info(self, req: pb.InfoRequest, context) -> pb.InfoReply:
        return self.info_reply(req.session_name)

    def SaveCheckpoint(self, req: pb.SaveCheckpointRequest, context) -> pb.SaveCheckpointReply:
        sess = self._session(req.session_id)
        with sess.lock:
            if req.step != sess.step:
                raise _precondition(f"checkpoint for step {req.step} asked for, "
                                    f"but this session is at step {sess.step}")
            weights = lora_state(sess.trunk, self.arch.canonical)
            blobs = {"optim": {"optimizer": sess.optimizer.state_dict()}} if sess.optimizer is not None else {}
            state = {"session": sess.name, "model": self.cfg.model, "fingerprint": self.fingerprint,
                     "split_points": [self.cfg.split_point_1, self.cfg.split_point_2], "seed": sess.seed,
                     "lora": self.peft.model_dump() if self.cfg.use_lora else None}
            path = ckpt.write(self._session_root(sess.name), sess.step, {"trunk_lora": weights}, blobs, state,
                              keep_last=self.cfg.keep_last)
        log.info("session %s: checkpoint at step %d in %s", sess.name, sess.step, path)
        reply = pb.SaveCheckpointReply(step=sess.step)
        if req.return_weights:
            reply.weights.extend(pb.NamedTensor(name=k, tensor=encode(v, "fp32")) for k, v in sorted(weights.items()))
        return reply

    def CloseSession(self, req: pb.CloseSessionRequest, context) -> pb.CloseSessionReply:
        with self.lock:
            sess = self.sessions.pop(req.session_id, None)
        if sess is not None:
            log.info("session %s closed (%s)", sess.name, sess.id[:8])
        return pb.CloseSessionReply(closed=sess is not None)

    def OpenGeneration(self, req: pb.OpenGenerationRequest, context) -> pb.OpenGenerationReply:
        self._check_pairing(req)
        return self.generations.open(req)

    def GenerateStep(self, req: pb.GenerateStepRequest, context) -> pb.GenerateStepReply:
        return self.generations.step(req)

    def CloseGeneration(self, req: pb.CloseGenerationRequest, context) -> pb.CloseGenerationReply:
        return self.generations.close(req.generation_id)

    # ----------------------------------------------------------------- housekeeping

    def reap(self) -> list[str]:
        """Free sessions (and generations) idle for longer than their timeouts; returns the sessions' names."""
        self.generations.reap()
        now = time.monotonic()
        with self.lock:
            stale = [s for s in self.sessions.values()
                     if now - s.last_seen > self.cfg.session_timeout and not s.lock.locked()]
            for s in stale:
                del self.sessions[s.id]
        for s in stale:
            log.info("session %s timed out after %.0f s idle; freed", s.name, self.cfg.session_timeout)
        return [s.name for s in stale]


def grad_norms(params: list[nn.Parameter]) -> list[float]:
    """Each gradient's 2-norm, computed as torch.nn.utils.clip_grad_norm_ does (float32, per tensor)."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return []
    return [float(n) for n in torch._foreach_norm(grads, 2.0)]


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _guard(method):
    """Run an RPC, turning CallError into its status and anything unexpected into INTERNAL."""

    def wrapper(request, context):
        try:
            return method(request, context)
        except CallError as err:
            context.abort(err.code, err.message)
        except SmolforgeError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, err.render())
        except Exception as err:  # noqa: BLE001 - the server must outlive any one bad call
            log.exception("internal error in %s", getattr(method, "__name__", "rpc"))
            context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")

    return wrapper


class _Guarded:
    """Wraps every RPC of a servicer with `_guard` (every one `split.proto` declares: none is missed)."""

    def __init__(self, service: TrunkService):
        for method in pb.DESCRIPTOR.services_by_name["Trunk"].methods:
            setattr(self, method.name, _guard(getattr(service, method.name)))


class TokenAuth(grpc.ServerInterceptor):
    """Refuse every call without `authorization: Bearer <token>` (Health excepted)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

        def deny(request_iterator, context):
            # Never iterated: the request's bytes are not read (HTTP/2 flow control holds them at
            # the sender), so a 300 MiB unauthenticated Forward costs nothing here.
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong token: pass --token (or set SMOLFORGE_SPLIT_TOKEN) "
                          "as the server was started")

        # A stream-request handler for every (unary) method: the server reads a message only when
        # the handler asks for it, and this one never asks. A unary handler would receive and
        # deserialize the whole payload before the abort.
        self._deny = grpc.stream_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        if details.method in OPEN_METHODS:
            return continuation(details)
        given = next((v for k, v in details.invocation_metadata if k == AUTH_HEADER), "")
        given = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given, self._expected):
            return continuation(details)
        return self._deny


class TrunkServer:
    """A running trunk server: `.port`, `.stop()`, `.wait()`."""

    def __init__(self, cfg: ServeConfig, allow_no_token: bool = False):
        if not cfg.token and not allow_no_token:
            raise SmolforgeError("the trunk server needs a token", fix="pass --token-file F (or set SMOLFORGE_SPLIT_TOKEN)")
        if not cfg.token and not is_loopback(cfg.host):
            raise SmolforgeError(f"--no-token with --host {cfg.host}: anyone on that network could train on this server",
                                 where="--host", fix="keep --no-token for --host 127.0.0.1, or give the server a token")
        torch.set_num_threads(cfg.num_threads or _cpus())
        self.cfg = cfg
        # a used port is one message in a second, before the model loads (asked of the OS: gRPC would log
        # its own failure line); the listener itself opens only once the trunk is loaded, so a client that
        # finds the port open finds the server ready
        refused = bind_error(cfg.host, cfg.port, "--port") if cfg.port else None
        if refused:
            raise refused
        self.service = TrunkService(cfg)
        interceptors = [TokenAuth(cfg.token)] if cfg.token else []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.max_workers), interceptors=interceptors,
                                  options=SERVER_OPTIONS)
        address = f"{cfg.host}:{cfg.port}"
        creds = server_credentials(cfg.tls_cert, cfg.tls_key)
        try:
            self.port = self.server.add_secure_port(address, creds) if creds else self.server.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if not self.port:  # taken between the probe and now
            self.server.stop(None)
            raise bind_error(cfg.host, cfg.port, "--port") or SmolforgeError(
                f"cannot listen on {address}", where="--port", fix="pick a free --port")
        pb_grpc.add_TrunkServicer_to_server(_Guarded(self.service), self.server)
        self.tls = creds is not None
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="split-session-reaper", daemon=True)

    def start(self) -> "TrunkServer":
        self.server.start()
        self._reaper.start()
        return self

    def _reap_loop(self) -> None:
        period = max(0.05, min(5.0, min(self.cfg.session_timeout, self.cfg.generation_timeout) / 4))
        while not self._stop.wait(period):
            self.service.reap()

    def stop(self, grace: float | None = 1.0) -> None:
        self._stop.set()
        self.server.stop(grace).wait()

    def wait(self) -> None:
        self.server.wait_for_termination()

    def describe(self) -> str:
        a, cfg = self.service.arch, self.cfg
        return (f"split trunk server listening on {cfg.host}:{self.port} ({'TLS' if self.tls else 'plaintext'}, "
                f"{'token' if cfg.token else 'NO token'}): {cfg.model} ({a.model_type}, {a.num_layers} layers), "
                f"trunk layers [{cfg.split_point_1}, {cfg.split_point_2}), "
                f"LoRA {'r=' + str(cfg.lora_rank) if cfg.use_lora else 'off'}, device {self.service.device}")


def bind_error(host: str, port: int, flag: str) -> SmolforgeError | None:
    """The one message for a trunk that cannot listen on `host:port` (`net.bind_refusal`); None: it can."""
    return bind_refusal(host, port, flag)


def _cpus() -> int:
    return available_cpus()


def serve(cfg: ServeConfig, allow_no_token: bool = False) -> TrunkServer:
    """Load the trunk and start serving; returns the running server."""
    return TrunkServer(cfg, allow_no_token=allow_no_token).start()
