"""Generate the gRPC stubs for `split.proto` with the pinned grpcio-tools.

Why generate instead of committing the stubs: generated code must match the protobuf runtime
that is installed, and the pinned grpcio-tools in the venv guarantees that. `ensure_generated()`
runs at import of `smolforge.split.protocol`, so a fresh checkout works without a build step; the
Makefile also runs `python -m smolforge.split.gen_proto` at install time.

The stubs go to `_generated/` next to this file. They are written into a temp directory and
renamed into place under a file lock, so concurrent processes (a test starting several servers)
never see half-written modules. A `PROTO_SHA256` file records which `.proto` they came from: they
are regenerated when missing or when the `.proto` changed (a content check, which survives
checkouts that scramble file times).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from smolforge.errors import SmolforgeError

HERE = Path(__file__).resolve().parent
PROTO = HERE / "split.proto"
OUT = HERE / "_generated"
STAMP = "PROTO_SHA256"
MODULES = ("split_pb2.py", "split_pb2_grpc.py")


def _proto_digest() -> str:
    return hashlib.sha256(PROTO.read_bytes()).hexdigest()


def is_current(out: Path = OUT) -> bool:
    """True when every stub exists and was generated from the current `.proto`."""
    try:
        stamp = (out / STAMP).read_text().strip()
    except OSError:
        return False
    return stamp == _proto_digest() and all((out / m).exists() for m in MODULES)


def _generate_into(tmp: Path) -> None:
    from grpc_tools import protoc

    args = ["grpc_tools.protoc", f"-I{HERE}", f"--python_out={tmp}", f"--grpc_python_out={tmp}", str(PROTO)]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"grpc_tools.protoc failed on {PROTO} (exit {code})")
    grpc_mod = tmp / "split_pb2_grpc.py"
    text = grpc_mod.read_text()
    # protoc writes a top-level import; inside a package it must be relative.
    fixed = text.replace("import split_pb2 as split__pb2", "from . import split_pb2 as split__pb2")
    if fixed == text:
        raise RuntimeError("unexpected grpc stub layout: no `import split_pb2` line to fix")
    grpc_mod.write_text(fixed)
    (tmp / "__init__.py").write_text('"""Stubs generated from ../split.proto by gen_proto.py; do not edit."""\n')
    (tmp / STAMP).write_text(_proto_digest() + "\n")


def ensure_generated(force: bool = False) -> Path:
    """Make `_generated/` current; returns its path. Cheap when the stubs are already current."""
    if not force and is_current():
        return OUT
    if not os.access(HERE, os.W_OK):
        raise SmolforgeError(f"the gRPC stubs in {OUT} are missing or stale and {HERE} is not writable",
                             fix="run `python -m smolforge.split.gen_proto` as a user who can write there")
    # The lock lives in the temp dir (one per package location), not in the source tree.
    tag = hashlib.sha256(str(HERE).encode()).hexdigest()[:12]
    lock_path = Path(tempfile.gettempdir()) / f"smolforge-gen-proto-{tag}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not force and is_current():  # another process generated them while we waited
                return OUT
            tmp = Path(tempfile.mkdtemp(dir=HERE, prefix=".gen-"))
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; other users import these stubs too
            try:
                _generate_into(tmp)
                old = None
                if OUT.exists():
                    old = HERE / f".old-generated-{os.getpid()}"
                    os.replace(OUT, old)
                os.replace(tmp, OUT)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return OUT


def main() -> int:
    out = ensure_generated(force="--force" in sys.argv[1:])
    print(f"gRPC stubs current in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
