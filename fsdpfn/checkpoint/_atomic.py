"""Atomic commit of checkpoint directories: write aside, then rename, then repoint ``latest``.

[Note: atomic checkpoints]
DCP writes in place, so a rank killed mid-save would leave a half-written directory. A
checkpoint root therefore looks like::

    root/
      latest                       # text: the name of the newest complete checkpoint
      step_00000010/               # complete checkpoints:
        .metadata                  #   DCP's metadata, merged from every rank's (rank 0 writes it)
        rank_0/__0_0.distcp        #   each rank's shards, in its own subdirectory
        rank_1/__0_0.distcp
        fsdpfn.json                #   the manifest: values, plan, sizes and checksums of the above
      step_00000020/
      .partial-step_00000030-9f2c  # a save in progress, or one that was killed

Every rank writes into the ``.partial-*`` directory; only after every rank has reported its
files (one all-gather) does rank 0 write ``.metadata`` and ``fsdpfn.json``, rename the directory
to its final name (one ``rename``, atomic on POSIX) and then replace ``latest`` with
``os.replace`` (atomic too). A kill at any point before that leaves ``latest`` naming the
previous checkpoint, which is untouched. Readers resolve ``root`` through ``latest``, falling
back past damaged checkpoints (see [Note: falling back]). The ranks must share the filesystem
(one node, or a shared mount).
"""

from __future__ import annotations

import os
import shutil
import warnings

from fsdpfn.checkpoint._manifest import INFO, METADATA, CheckpointError, check_present, read_manifest
from fsdpfn.checkpoint._manifest import verify as verify_files

__all__ = ["candidates", "check_complete", "commit", "latest", "partial_dir", "prune", "resolve"]

LATEST = "latest"
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
    """``path`` is one checkpoint (it has DCP's ``.metadata`` or a manifest), not a root of them."""
    return os.path.isfile(os.path.join(path, METADATA)) or os.path.isfile(os.path.join(path, INFO))


def check_complete(ckpt: str) -> dict:
    """The manifest of ``ckpt`` once every file it lists is there with its recorded size.

    Raises:
      CheckpointError: naming the missing, truncated or unparsable file.
    """
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"checkpoint {ckpt!r} does not exist (deleted?)", ckpt)
    info = read_manifest(ckpt)
    check_present(ckpt, info)
    return info


def _pointer(root: str) -> str | None:
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def candidates(root: str) -> list[str]:
    """Checkpoints under ``root`` in the order a load tries them (see [Note: falling back]).

    [Note: falling back]
    First the one ``root/latest`` names, then the other checkpoint directories whose names sort
    before it (directories with a ``.metadata`` or an ``fsdpfn.json``), newest (last in name order,
    the order ``keep`` prunes by) first. Names after the
    one ``latest`` names are never used: they belong to a run abandoned by a resume from an
    earlier step. Without a readable ``latest`` every checkpoint directory is a candidate.
    """
    names = (
        sorted(
            (n for n in os.listdir(root) if not n.startswith(".") and is_checkpoint_dir(os.path.join(root, n))),
            reverse=True,
        )
        if os.path.isdir(root)
        else []
    )
    head = _pointer(root)
    if head is None:
        return [os.path.join(root, n) for n in names]
    return [os.path.join(root, head)] + [os.path.join(root, n) for n in names if n < head]


def skipped_warning(what: str, skipped: list[tuple[str, str]], used: str | None) -> str:
    lines = "\n".join(f"  {os.path.basename(path)}: {reason}" for path, reason in skipped)
    tail = f"; using {used!r}" if used else "; no intact checkpoint is left"
    return f"{what}: skipped {len(skipped)} checkpoint(s) that are missing, incomplete or damaged{tail}:\n{lines}"


def latest(root: str | os.PathLike, *, verify: bool = False) -> str | None:
    """The newest complete checkpoint directory under ``root``, or ``None`` if there is none.

    A checkpoint that ``root/latest`` names but that is missing or incomplete (a file gone or
    truncated, an unparsable ``fsdpfn.json``) is skipped with a warning naming it and why, and
    the newest complete one before it is returned instead (see [Note: falling back]).

    Args:
      root: a checkpoint root; or a checkpoint directory, which is returned as is (a load of it
        raises if it is damaged: an explicit directory never falls back).
      verify: also compare every file's SHA-256 with the manifest (reads the whole checkpoint;
        by default only sizes are checked, and :func:`fsdpfn.checkpoint.load` verifies the
        checksums of what it reads).

    Example:
      >>> for step in (100, 200):
      ...     _ = fsdpfn.checkpoint.save("runs/gpt/ckpt", {"params": params, "step": step}, plan)
      >>> latest("runs/gpt/ckpt")
      'runs/gpt/ckpt/step_00000200'
    """
    root = os.fspath(root)
    if is_checkpoint_dir(root):
        return root
    skipped = []
    for ckpt in candidates(root):
        try:
            info = check_complete(ckpt)
            if verify:
                verify_files(ckpt, info, info.get("files") or ())
        except CheckpointError as e:
            skipped.append((ckpt, str(e)))
            continue
        if skipped:
            warnings.warn(skipped_warning("fsdpfn.checkpoint.latest", skipped, ckpt), stacklevel=2)
        return ckpt
    if skipped:
        warnings.warn(skipped_warning("fsdpfn.checkpoint.latest", skipped, None), stacklevel=2)
    return None


def no_checkpoint(path: str) -> FileNotFoundError:
    partial = os.path.isdir(path) and any(n.startswith(_PARTIAL) for n in os.listdir(path))
    hint = " (only unfinished saves are there: a save was interrupted before any completed)" if partial else ""
    return FileNotFoundError(
        f"no complete checkpoint at {path!r}{hint}; expected a directory written by "
        "fsdpfn.checkpoint.save (with a 'latest' file), or one of its step_* directories"
    )


def resolve(path: str | os.PathLike) -> str:
    """:func:`latest`, raising when there is no checkpoint; an explicit checkpoint directory
    must be complete.

    Raises:
      FileNotFoundError: no complete checkpoint under the root ``path``.
      CheckpointError: the checkpoint directory ``path`` is incomplete.
    """
    path = os.fspath(path)
    if is_checkpoint_dir(path):
        check_complete(path)
        return path
    found = latest(path)
    if found is None:
        raise no_checkpoint(path)
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
    current = _pointer(root)
    names = sorted(n for n in os.listdir(root) if not n.startswith(".") and is_checkpoint_dir(os.path.join(root, n)))
    for n in names[: max(len(names) - keep, 0)]:
        if n != current:
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)
