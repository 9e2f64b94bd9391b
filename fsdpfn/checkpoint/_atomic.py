"""Atomic commit of checkpoint directories: write aside, then rename, then repoint ``latest``.

[Note: atomic checkpoints]
DCP writes in place, so a rank killed mid-save would leave a half-written directory. A
checkpoint root therefore looks like::

    root/
      latest                       # text: the name of the newest complete checkpoint
      step_00000010/               # complete checkpoints (DCP files + fsdpfn.json)
      step_00000020/
      .partial-step_00000030-9f2c  # a save in progress, or one that was killed

Every rank writes into the ``.partial-*`` directory; only after every rank has finished (DCP's
own final gather, then a barrier) does rank 0 rename it to its final name (one ``rename``, atomic
on POSIX) and then replace ``latest`` with ``os.replace`` (atomic too). A kill at any point
before that leaves ``latest`` naming the previous checkpoint, which is untouched. Readers resolve
``root`` through ``latest``. The ranks must share the filesystem (one node, or a shared mount).
"""

from __future__ import annotations

import os
import shutil

__all__ = ["latest", "resolve", "commit", "partial_dir", "prune", "METADATA", "INFO"]

LATEST = "latest"
METADATA = ".metadata"  # DCP's global metadata file
INFO = "fsdpfn.json"
_PARTIAL = ".partial-"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    """Replaces the file ``path`` with ``text`` in one ``os.replace``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA)) and os.path.isfile(os.path.join(path, INFO))


def latest(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directory under ``root``, or ``None`` if there is none.

    ``root`` may also be a checkpoint directory itself, which is returned as is.

    Example:
      >>> latest("runs/gpt/ckpt")  # doctest: +SKIP
      'runs/gpt/ckpt/step_00000200'
    """
    root = os.fspath(root)
    if is_checkpoint_dir(root):
        return root
    pointer = os.path.join(root, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(root, name)
    return path if is_checkpoint_dir(path) else None


def resolve(path: str | os.PathLike) -> str:
    """:func:`latest`, raising ``FileNotFoundError`` with a hint when there is no checkpoint."""
    found = latest(path)
    if found is None:
        path = os.fspath(path)
        partial = os.path.isdir(path) and any(n.startswith(_PARTIAL) for n in os.listdir(path))
        hint = " (only unfinished saves are there: a save was interrupted before any completed)" if partial else ""
        raise FileNotFoundError(
            f"no complete checkpoint at {path!r}{hint}; expected a directory written by "
            "fsdpfn.checkpoint.save (with a 'latest' file), or one of its step_* directories"
        )
    return found


def partial_dir(root: str, name: str, token: str) -> str:
    return os.path.join(root, f"{_PARTIAL}{name}-{token}")


def clean_partials(root: str, keep: str | None = None) -> None:
    """Removes leftovers of interrupted saves (rank 0, before a new save starts)."""
    if not os.path.isdir(root):
        return
    for n in os.listdir(root):
        p = os.path.join(root, n)
        if n.startswith(_PARTIAL) and p != keep:
            shutil.rmtree(p, ignore_errors=True)


def commit(root: str, partial: str, name: str) -> str:
    """Renames ``partial`` to ``root/name`` and points ``latest`` at it (rank 0 only)."""
    final = os.path.join(root, name)
    _fsync_dir(partial)
    if os.path.exists(final):
        # Re-saving a step (e.g. after a resume): move the old one aside first. ``latest`` is
        # repointed below, so the window where ``final`` is missing only matters if ``latest``
        # named it, and then the old copy is still in the trash directory until the end.
        trash = partial + ".old"
        os.rename(final, trash)
        os.rename(partial, final)
        write_text_atomic(os.path.join(root, LATEST), name + "\n")
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(partial, final)
        write_text_atomic(os.path.join(root, LATEST), name + "\n")
    _fsync_dir(root)
    return final


def prune(root: str, keep: int) -> None:
    """Keeps the ``keep`` newest complete checkpoints (by name order), always keeping ``latest``."""
    current = latest(root)
    names = sorted(n for n in os.listdir(root) if not n.startswith(".") and is_checkpoint_dir(os.path.join(root, n)))
    for n in names[: max(len(names) - keep, 0)]:
        p = os.path.join(root, n)
        if current is None or os.path.abspath(p) != os.path.abspath(current):
            shutil.rmtree(p, ignore_errors=True)
