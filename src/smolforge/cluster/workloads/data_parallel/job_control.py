"""The per-job control actor: the one thing a job's workers talk to.

It lives on the coordinator's node (it asks for the `smolforge-head` resource), so it writes
artifacts straight into the coordinator's artifact store: rank 0 hands it a checkpoint in
checksummed pieces through the Ray object store (`begin_artifact`, `put_piece`, `commit_artifact`:
a piece at a time, so neither side holds a whole checkpoint in memory) and waits for the
acknowledgement, and every rank fetches the checkpoint to resume from (`artifact_manifest`,
`get_piece`) and the uploaded dataset from it. No shared filesystem is assumed.

The job runner (in the coordinator process) sets the stop / regroup flags and drains the progress
reports the workers push; workers poll the flags in the background, so none of this sits on the
training step's critical path.

For elastic strategies (DiLoCo) it is also the membership service: when ranks must re-form their
process group (a member died, one joins), each one `enter`s the next epoch with the address where it
could host the rendezvous, and `view` returns the decision once every live member is in (or after
a grace period, leaving out who never came): the members, the host's address and a fresh secret.
A member asked to leave (`job leave`: `set_leaving`) reads so in `poll`, says `member_left` itself at
its next boundary and goes; the others re-form without it as they do for a lost member.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

from smolforge.cluster.control.artifacts import ArtifactStore
from smolforge.cluster.nodes.ray_glue import HEAD_RESOURCE

REGROUP_GRACE_S = 60.0  # how long a re-forming group waits for a member that neither comes nor is known gone


class JobControl:
    """Ray actor class (wrapped with ray.remote by `create_control`)."""

    def __init__(self, job_id: str, artifacts_root: str):
        self.job_id = job_id
        self.store = ArtifactStore(artifacts_root)
        self.stop: str | None = None
        self.regroup = False
        self.regroup_now = False
        self.items: list[dict] = []
        self.lock = threading.Lock()  # threaded actor: reports and drains may overlap
        self.uploads: dict[str, tuple[str, str, Any]] = {}  # upload id -> (kind, name, DirReceiver)
        self.start_members(0)

    def set_stop(self, code: str | None) -> None:
        self.stop = code

    def set_regroup(self, at_checkpoint: bool) -> None:
        if at_checkpoint:
            self.regroup = True
        else:
            self.regroup_now = True

    def set_leaving(self, members: list[int]) -> None:
        """The members that leave the group at their next boundary (a lent node given back)."""
        self.leaving = set(members)

    def reset(self) -> None:
        self.stop, self.regroup, self.regroup_now, self.leaving = None, False, False, set()

    def poll(self) -> dict:
        return {"stop": self.stop, "regroup": self.regroup, "regroup_now": self.regroup_now,
                "joiners": sorted(self.joiners), "leave": sorted(self.leaving)}

    # -- elastic membership -----------------------------------------------------------------------

    def start_members(self, n: int) -> None:
        """A new group of members 0..n-1 (the runner, as it starts one)."""
        with self.lock:
            self.alive: set[int] = set(range(n))
            self.gone: set[int] = set()
            self.entries: dict[int, dict[int, tuple[str, int]]] = {}  # epoch -> member -> rendezvous address
            self.first_entry: dict[int, float] = {}
            self.decisions: dict[int, dict] = {}
            self.joiners: dict[int, tuple[str, int]] = {}  # waiting to be taken in at the next epoch
            self.admitting: set[int] = set()  # epochs the members re-form to take joiners in
            self.leaving: set[int] = set()  # members asked to leave at their next boundary (`job leave`)

    def member_left(self, member: int) -> None:
        """The runner saw the member's process or node die, or the member leaves as asked (it says so
        itself before it goes, so the others' next epoch never waits for it)."""
        with self.lock:
            self.alive.discard(member)
            self.gone.add(member)
            self.joiners.pop(member, None)
            self._decide_all()

    def enter(self, epoch: int | None, member: int, addr: tuple[str, int], admit: bool = False) -> None:
        """A member is ready for group epoch `epoch`; `None`: a joiner, for the next epoch that admits
        (one the members re-form to take joiners in, not one that only drops a lost peer)."""
        with self.lock:
            if member in self.gone:
                return
            if epoch is None:
                self.joiners[member] = tuple(addr)
                return
            self.entries.setdefault(epoch, {})[member] = tuple(addr)
            self.first_entry.setdefault(epoch, time.time())
            if admit:
                self.admitting.add(epoch)
            self._decide_all()

    def view(self, epoch: int | None, member: int) -> dict | None:
        """The decision for `epoch` once made (None: not yet); a joiner gets the first one taking it in."""
        with self.lock:
            self._decide_all()
            if epoch is None:
                for e in sorted(self.decisions):
                    if member in self.decisions[e]["members"]:
                        return self.decisions[e]
                return {"excluded": True} if member in self.gone else None
            d = self.decisions.get(epoch)
            if d is not None and member not in d["members"]:
                return {"excluded": True}
            return d

    def taken_in(self) -> list[int]:
        """Every member some group epoch took in (a joiner in here trains with the group, however late
        its result comes back; one not in here is still waiting for an epoch that admits it)."""
        with self.lock:
            return sorted({m for d in self.decisions.values() for m in d["members"]})

    def _decide_all(self) -> None:
        for epoch in sorted(self.entries):
            if epoch in self.decisions:
                continue
            came = self.entries[epoch]
            late = time.time() - self.first_entry[epoch] > REGROUP_GRACE_S
            if not (self.alive <= set(came) or late):
                continue
            for m in self.alive - set(came):  # never came within the grace period: left out
                self.gone.add(m)
                self.items.append({"type": "event", "kind": "member_left", "ts": time.time(),
                                   "message": f"member {m} did not reach the group's epoch {epoch} within "
                                              f"{REGROUP_GRACE_S:.0f} s: left out", "data": {"member": m}})
            joined = dict(self.joiners) if epoch in self.admitting else {}
            for m in joined:
                self.joiners.pop(m)
            hosts = {**joined, **{m: a for m, a in came.items() if m not in self.gone}}
            members = sorted(hosts)
            self.alive = set(members)
            self.decisions[epoch] = {"epoch": epoch, "members": members, "joined": sorted(joined),
                                     "host": members[0], "addr": hosts[members[0]],
                                     "secret": secrets.token_hex(16)}

    def report(self, batch: list[dict]) -> None:
        with self.lock:
            self.items.extend(batch)

    def drain(self) -> list[dict]:
        with self.lock:
            out, self.items = self.items, []
        return out

    def put_artifact(self, kind: str, name: str, payload: dict, keep_last: int | None = None) -> dict:
        t = time.time()
        meta = self.store.put(self.job_id, kind, name, payload, keep_last=keep_last)
        meta["seconds"] = time.time() - t
        meta.pop("sha256", None)
        return meta

    def begin_artifact(self, kind: str, name: str) -> str:
        """Start an artifact that arrives in pieces (`parallel.transfer.send_dir`); its upload id."""
        receiver = self.store.begin(self.job_id, kind, name)
        upload_id = secrets.token_hex(8)
        with self.lock:
            self.uploads[upload_id] = (kind, name, receiver)
        return upload_id

    def put_piece(self, upload_id: str, rel: str, offset: int, data: bytes) -> None:
        kind, name, receiver = self.uploads[upload_id]
        try:
            receiver.write(rel, offset, data)
        except BaseException:
            self.abort_artifact(upload_id)  # a bad path or a piece out of order: the upload is void
            raise

    def commit_artifact(self, upload_id: str, sha256: dict[str, str], keep_last: int | None = None) -> dict:
        """Every file's digest checked, the artifact swapped in; what `put_artifact` returns."""
        t = time.time()
        with self.lock:
            kind, name, receiver = self.uploads.pop(upload_id)
        meta = self.store.commit(self.job_id, kind, name, receiver, sha256, keep_last=keep_last)
        meta["seconds"] = time.time() - t
        meta.pop("sha256", None)
        return meta

    def abort_artifact(self, upload_id: str) -> None:
        with self.lock:
            entry = self.uploads.pop(upload_id, None)
        if entry is not None:
            entry[2].abort()

    def artifact_manifest(self, kind: str, name: str) -> dict[str, dict]:
        return self.store.manifest(self.job_id, kind, name)

    def get_piece(self, kind: str, name: str, rel: str, offset: int, size: int) -> bytes:
        return self.store.piece(self.job_id, kind, name, rel, offset, size)

    def get_artifact(self, kind: str, name: str) -> dict:
        return self.store.get(self.job_id, kind, name)

    def get_upload(self, digest: str) -> bytes:
        return self.store.read_upload(digest)

    def ping(self) -> bool:
        return True


def create_control(job_id: str, artifacts_root: str) -> Any:
    """A fresh control actor for one run of a job, pinned to the coordinator's node."""
    import ray


    actor = ray.remote(JobControl).options(
        num_cpus=0, resources={HEAD_RESOURCE: 0.001}, max_restarts=0, max_concurrency=8,
    ).remote(job_id, artifacts_root)
    ray.get(actor.ping.remote(), timeout=120)
    return actor
