"""The timeline engine: tasks on FIFO streams with dependencies, sharing the compute unit and
the links.

[Note: sharing]
A task needs one resource: ``"compute"`` or a link level (``"intra"``, ``"inter"``). Tasks on
one stream run in order; a task starts once its stream's previous task and its dependencies
are done. Running tasks share, fluid-style:

- comm tasks on the same link level split its bandwidth equally;
- while compute and any communication run together, each runs at ``1 / (2 - overlap)`` of its
  speed, so a compute of length C and a transfer of length M started together end after
  ``max(C, M) + (1 - overlap) * min(C, M)`` (``Hardware.overlap``: 0.811 on the GPU presets,
  whose compute runs 18.9% slower beside a collective, as measured on GPUs; near 0 on CPUs,
  where gloo's threads take the cores that compute).

Time advances from one task completion to the next, so the result is exact for this model.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Task", "run"]


@dataclasses.dataclass
class Task:
    """One piece of work on a stream. ``start``/``end`` are filled in by :func:`run`."""

    stream: str
    resource: str
    seconds: float
    deps: tuple[int, ...] = ()
    kind: str = ""
    unit: str = ""
    nbytes: float = 0.0
    op: int = -1
    micro_batch: int = 0
    start: float = -1.0
    end: float = -1.0


def run(tasks: list[Task], overlap: float = 1.0) -> float:
    """Fills every task's ``start`` and ``end`` and returns the makespan (see [Note: sharing]).

    Example:
      >>> ts = [Task("compute", "compute", 2.0), Task("ag", "intra", 1.0), Task("compute", "compute", 1.0, deps=(1,))]
      >>> run(ts, overlap=1.0), run([dataclasses.replace(t) for t in ts], overlap=0.0)
      (3.0, 4.0)
    """
    n = len(tasks)
    prev_in_stream: dict[str, int] = {}
    deps: list[tuple[int, ...]] = []
    for i, t in enumerate(tasks):
        for d in t.deps:
            if not 0 <= d < i:
                raise ValueError(f"task {i} ({t.kind} {t.unit!r}) depends on task {d}, which is not an earlier task")
        p = prev_in_stream.get(t.stream)
        deps.append(t.deps + ((p,) if p is not None else ()))
        prev_in_stream[t.stream] = i
    waiting = [len(d) for d in deps]
    users: list[list[int]] = [[] for _ in range(n)]
    for i, ds in enumerate(deps):
        for d in ds:
            users[d].append(i)
    left = [max(0.0, t.seconds) for t in tasks]
    active: set[int] = set()
    now = 0.0
    done = 0
    ready = [i for i in range(n) if waiting[i] == 0]
    slow = 1.0 / (2.0 - overlap)

    def finish(i: int) -> None:
        nonlocal done
        tasks[i].end = now
        done += 1
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)

    while done < n:
        while ready:  # start what can start; zero-length tasks end at once
            i = ready.pop()
            tasks[i].start = now
            if left[i] <= 0.0:
                finish(i)
            else:
                active.add(i)
        if done == n:
            break
        if not active:
            stuck = [i for i in range(n) if tasks[i].end < 0]
            raise RuntimeError(f"timeline deadlock: {len(stuck)} tasks can never start (first: {tasks[stuck[0]]})")
        computing = any(tasks[i].resource == "compute" for i in active)
        per_link: dict[str, int] = {}
        for i in active:
            if tasks[i].resource != "compute":
                per_link[tasks[i].resource] = per_link.get(tasks[i].resource, 0) + 1
        communicating = bool(per_link)
        rates = {}
        for i in active:
            r = tasks[i].resource
            if r == "compute":
                rates[i] = slow if communicating else 1.0
            else:
                rates[i] = (slow if computing else 1.0) / per_link[r]
        dt = min(left[i] / rates[i] for i in active)
        now += dt
        for i in list(active):
            left[i] -= rates[i] * dt
            if left[i] <= 1e-12 * max(1.0, tasks[i].seconds):
                active.discard(i)
                finish(i)
    return max((t.end for t in tasks), default=0.0)
