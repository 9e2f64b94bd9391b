"""Every ``>>>`` example in fsdpfn's docstrings runs, as written, on one gloo rank.

Every module of the package is walked with ``pkgutil`` (private ones too: the public functions
live in ``_private`` modules and are re-exported), and its examples run with ``doctest``
(``ELLIPSIS``, ``NORMALIZE_WHITESPACE``) inside a 1-rank worker of the fsdpfn pytest plugin,
where the default process group is initialised, so collectives, meshes and checkpoints work.
Each docstring runs in a fresh temporary working directory (checkpoint examples write
``runs/...``). An example keeps ``# doctest: +SKIP`` only when it cannot run in one CPU process
(``torchrun``, CUDA, a ``launch`` of several ranks), with the reason beside it.

Every docstring's examples see the module's own globals, overlaid with a fresh copy of this
namespace, so examples read as a user's code:

  ========================  ==================================================================
  ``torch``, ``F``, ``nn``  ``torch``, ``torch.nn.functional``, ``torch.nn``
  ``os``, ``dataclasses``   the standard modules
  ``fsdpfn``                the package; ``optim``, ``comm``, ``checkpoint``, ``runtime``,
                            ``testing``, ``transforms`` its subpackages
  ``GPT``, ``GPTConfig``    ``fsdpfn.models``
  ``cfg``, ``model``        ``GPTConfig(vocab_size=64, seq_len=16, width=32, depth=2)``,
                            ``GPT(cfg)`` (seed 0); its units: ``""`` (the root),
                            ``blocks.0``, ``blocks.1``
  ``mesh``                  ``fsdpfn.testing.mesh()``: the 1-rank CPU ``DeviceMesh``
  ``plan``                  ``fsdpfn.plan(model, mesh)`` (zero3)
  ``params``                ``fsdpfn.shard(model, plan)``: ``{name: DTensor}``
  ``x``, ``y``              tokens and next-token targets, ``(2, 8)`` ints below 64 (seed 0)
  ``rt``                    ``fsdpfn.runtime.Runtime(model, plan)``
  ``loss_fn``               ``loss_fn(params, x, y)``: cross-entropy of ``rt.apply(params, x)``
  ``grads``, ``loss``       ``rt.value_and_grad(loss_fn)(params, x, y)``
  ``opt``, ``state``        ``fsdpfn.optim.adamw(lr=1e-3)`` and ``opt.init(params)``
  ========================  ==================================================================

Run one module's examples by hand: ``python -m pytest tests/test_doctests.py -k _plan``.
"""

from __future__ import annotations

import doctest
import importlib
import os
import pkgutil
import tempfile

import pytest

import fsdpfn

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _module_names() -> list[str]:
    names = ["fsdpfn"]
    for info in pkgutil.walk_packages(fsdpfn.__path__, prefix="fsdpfn."):
        names.append(info.name)
    return sorted(names)


MODULES = _module_names()


def namespace() -> dict:
    """A fresh copy of the names every example may use (see the module docstring)."""
    import dataclasses
    import os

    import torch
    import torch.nn.functional as F
    from torch import nn

    from fsdpfn import checkpoint, comm, optim, runtime, testing, transforms
    from fsdpfn.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=16, width=32, depth=2)
    model = GPT(cfg)
    mesh = testing.mesh()
    plan = fsdpfn.plan(model, mesh)
    params = fsdpfn.shard(model, plan)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    x, y = tokens[:, :-1], tokens[:, 1:]
    rt = runtime.Runtime(model, plan)

    def loss_fn(params, x, y):
        return F.cross_entropy(rt.apply(params, x).flatten(0, 1), y.flatten())

    grads, loss = rt.value_and_grad(loss_fn)(params, x, y)
    opt = optim.adamw(lr=1e-3)
    state = opt.init(params)
    return dict(
        torch=torch, F=F, nn=nn, dataclasses=dataclasses, os=os,
        fsdpfn=fsdpfn, optim=optim, comm=comm, checkpoint=checkpoint, runtime=runtime,
        testing=testing, transforms=transforms, GPT=GPT, GPTConfig=GPTConfig,
        cfg=cfg, model=model, mesh=mesh, plan=plan, params=params, x=x, y=y, rt=rt,
        loss_fn=loss_fn, grads=grads, loss=loss, opt=opt, state=state,
    )  # fmt: skip


def _run_module_examples(rank: int, world_size: int, module: str) -> tuple[int, int, str]:
    """Runs ``module``'s examples here; ``(examples run, examples skipped, failure report)``."""
    mod = importlib.import_module(module)
    tests = [t for t in doctest.DocTestFinder().find(mod, module) if t.examples]
    runner = doctest.DocTestRunner(
        verbose=False, optionflags=FLAGS
    )  # not from sys.argv: pytest -v would make every example "fail"
    report: list[str] = []
    skipped = 0
    cwd = os.getcwd()
    for test in sorted(tests, key=lambda t: t.name):
        skipped += sum(1 for e in test.examples if e.options.get(doctest.SKIP))
        test.globs.update(namespace())
        # A fresh working directory per docstring: checkpoint examples write runs/... there.
        with tempfile.TemporaryDirectory(prefix="fsdpfn_doctest_") as tmp:
            os.chdir(tmp)
            try:
                runner.run(test, out=report.append, clear_globs=True)
            finally:
                os.chdir(cwd)
    attempted = sum(len(t.examples) for t in tests) - skipped
    return attempted, skipped, "".join(report)


def test_the_walk_finds_every_module():
    assert {"fsdpfn._plan", "fsdpfn.comm._collectives", "fsdpfn.runtime._runtime", "fsdpfn.testing._harness"} <= set(
        MODULES
    )


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(run_on_ranks, module):
    [(attempted, skipped, report)] = run_on_ranks(_run_module_examples, 1, module)
    assert not report, f"{module}: docstring examples failed ({attempted} run, {skipped} skipped):\n{report}"
