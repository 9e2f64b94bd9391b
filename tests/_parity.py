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

from fsdpfn.transforms import CHECKED_STEPS

PARITY_STEPS = CHECKED_STEPS + 2
