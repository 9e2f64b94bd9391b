"""How many steps the parity tests (a sharded run against one process, step by step) train.

[Note: how many steps a parity test runs]
A sharded step takes three paths over a run: the first step (the differential check of
fsdpfn.verify, then the step), the first ``CHECKED_STEPS`` steps (the batch checks of every
data-parallel peer), and every later step (the steady path, with optimizer state and any buffers
the runtime keeps carried from the steps before). Nothing in fsdpfn depends on the step index
after that. So ``PARITY_STEPS`` = ``CHECKED_STEPS`` + 2: two steady steps, the second of which
runs on state the first steady step left, compared with one process after every step. More steps
repeat the same path at the same cost per step (on 2 cores, 4-8 ranks: seconds each), and the
tolerance notes' bounds grow with the number of steps, so they hold at this count a fortiori.
"""

import functools

from fsdpfn.transforms import CHECKED_STEPS

PARITY_STEPS = CHECKED_STEPS + 2


def one_process(fn):
    """Remembers a one-process reference per arguments, in each process that computes it.

    A parity test's ranks each train the reference themselves (no collective, nothing to send),
    and its configurations (strategy, style, prefetch) share one: a pool worker computed each
    reference once per configuration, and a 4-rank test on 2 cores pays every rank's copy. The
    references seed themselves (``torch.manual_seed`` first), so they are functions of their
    arguments; callers read them and never write them."""
    cache: dict = {}

    @functools.wraps(fn)
    def cached(*args):
        key = repr(args)
        if key not in cache:
            cache[key] = fn(*args)
        return cache[key]

    return cached
