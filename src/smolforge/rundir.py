"""A run's output directory and the manifest of what it wrote there (issue 43, item 4).

Every kind of run that writes an `--output-dir` (train, demo, distill, export, split) claims it here
first. The claim writes `.smolforge-run.json`: the run's kind and the top-level names it writes. The
rules, one place for every kind:

- a directory whose manifest names another kind is refused (exit 2, nothing deleted): a demo never
  writes into a train run's directory, an export never into a demo's;
- a name the run is about to replace that the manifest does not record (a file a user added, or a
  run from before manifests) is refused, never deleted;
- only recorded names are ever removed (`remove_recorded`), so a file a user added survives.

The manifest is written atomically (`paths.atomic_write_json`) before the run writes what it names.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from smolforge.errors import SmolforgeError
from smolforge.paths import atomic_replace_dir, atomic_write_json

MANIFEST = ".smolforge-run.json"
KINDS = ("train", "demo", "distill", "export", "split")


@dataclass
class RunDir:
    """A claimed run directory: its path, the kind that owns it and the names that kind wrote."""

    path: Path
    kind: str
    written: set[str] = field(default_factory=set)


def read_manifest(path: str | Path) -> dict | None:
    """The manifest of `path` (None when it has none); a damaged one is refused (exit 2), not guessed."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str) \
                or not isinstance(data.get("written", []), list):
            raise ValueError("not a manifest")
    except (ValueError, UnicodeDecodeError) as err:
        raise SmolforgeError(f"{file} is damaged ({err})", where="--output-dir",
                             fix="choose another --output-dir, or move that directory away (nothing was deleted)") \
            from None
    return data


def check_run_dir(path: str | Path, kind: str, replaces: Iterable[str] = (), *, where: str = "--output-dir",
                  adopt: Iterable[str] = (), unrecorded_ok: bool = True) -> RunDir:
    """Whether a `kind` run may write into `path`, replacing the top-level names `replaces`.

    Refused (SmolforgeError, exit 2; nothing is deleted): `path` is a file; its manifest names another
    kind; one of `replaces` exists there and no manifest records it (a user's file, or an unknown run's).
    `adopt`: names a run from before manifests is known to have written (an export's summary lists its
    files), recorded as this kind's when the directory has no manifest. `unrecorded_ok=False` (a run that
    starts afresh, the demo) also refuses a non-empty directory without a manifest: whatever is there
    (a run from before manifests, marked or not) is not known to be its own. Writes nothing."""
    if kind not in KINDS:
        raise ValueError(f"unknown run kind {kind!r}")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise SmolforgeError(f"{out} is a file, not a directory", where=where,
                             fix="choose another --output-dir (nothing was deleted)")
    manifest = read_manifest(out) if out.is_dir() else None
    if manifest is None and not unrecorded_ok and out.is_dir() and any(out.iterdir()):
        raise SmolforgeError(f"{out} holds files that no {MANIFEST} records (a run from before manifests, or "
                             "someone's work)", where=where,
                             fix=f"choose a new or empty {where}, or move those files away (nothing was deleted)")
    if manifest is not None and manifest["kind"] != kind:
        raise SmolforgeError(f"{out} holds a `{manifest['kind']}` run's outputs; a {kind} run would replace them",
                             where=where, fix=f"choose another {where} for the {kind} run, or move that run "
                                              "away (nothing was deleted)")
    written = set(manifest.get("written", [])) if manifest is not None else set(adopt)
    foreign = sorted(name for name in replaces if (out / name).exists() and name not in written)
    if foreign:
        raise SmolforgeError(f"{out} already holds {', '.join(foreign)}, which no earlier {kind} run wrote there "
                             f"(no {MANIFEST} records it)", where=where,
                             fix=f"choose another {where}, or move {', '.join(foreign)} away (nothing was deleted)")
    return RunDir(out, kind, written)


def claim_run_dir(path: str | Path, kind: str, replaces: Iterable[str] = (), *, where: str = "--output-dir",
                  adopt: Iterable[str] = (), unrecorded_ok: bool = True) -> RunDir:
    """`check_run_dir`, then make `path` and record `kind` and `replaces` in its manifest (before the run
    writes them). Errors: as check_run_dir; an OSError when the directory cannot be made."""
    replaces = list(replaces)
    run = check_run_dir(path, kind, replaces, where=where, adopt=adopt, unrecorded_ok=unrecorded_ok)
    return record(run, replaces)


def record(run: RunDir, names: Iterable[str]) -> RunDir:
    """Add top-level `names` to what `run` wrote in its directory (the manifest, rewritten atomically)."""
    run.written |= set(names)
    run.path.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run.path / MANIFEST, {"kind": run.kind, "written": sorted(run.written)})
    return run


def remove_recorded(run: RunDir, names: Iterable[str]) -> list[str]:
    """Delete those of `names` that `run`'s manifest records (a run starting afresh); the names removed.
    A name not recorded is left alone, whatever it is: it is not this kind of run's to delete."""
    removed = []
    for name in names:
        target = run.path / name
        if name not in run.written or Path(name).name != name or not (target.exists() or target.is_symlink()):
            continue
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
        removed.append(name)
    return removed


def replace_with(run: RunDir, tmp: str | Path) -> None:
    """Swap the freshly written directory `tmp` in as `run.path`, atomically (`paths.atomic_replace_dir`).

    What the manifest records is replaced by tmp's entries (or goes, when tmp lacks it); every other
    entry of `run.path` (a file a user added) is carried into tmp first by hard link (a copy where links
    fail), so it survives the swap. tmp's manifest records tmp's own names. Refused (exit 2, nothing
    changed) when tmp writes a name that `run.path` holds and the manifest does not record."""
    tmp = Path(tmp)
    new = {p.name for p in tmp.iterdir() if p.name != MANIFEST}
    out = run.path
    if out.is_dir():
        foreign = sorted(n for n in new if (out / n).exists() and n not in run.written)
        if foreign:
            raise SmolforgeError(f"{out} already holds {', '.join(foreign)}, which no earlier {run.kind} run wrote "
                                 "there", where="--output-dir",
                                 fix=f"choose another --output-dir, or move {', '.join(foreign)} away "
                                     "(nothing was replaced)")
        for entry in out.iterdir():
            if entry.name not in run.written and entry.name != MANIFEST:
                _link_into(entry, tmp / entry.name)
    run.written = new
    atomic_write_json(tmp / MANIFEST, {"kind": run.kind, "written": sorted(new)})
    atomic_replace_dir(tmp, out)


def _link_into(src: Path, dst: Path) -> None:
    """`src` (a file, a link or a tree) at `dst` without copying bytes where the filesystem allows."""
    if src.is_symlink():
        dst.symlink_to(os.readlink(src))
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(str(src), str(dst))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
