"""Routing a module's calls through a function of ours, for the checks that run a model's own
code two ways (:mod:`fsdpfn.transforms._verify`, :mod:`fsdpfn.transforms._verify_loss`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

from torch import nn

__all__ = ["intercept"]


@contextlib.contextmanager
def intercept(
    modules: Mapping[str, nn.Module], calls: Callable[[str, nn.Module, Callable, tuple, dict], Any]
) -> Iterator[None]:
    """Routes each named module's calls through ``calls(name, module, original_forward, args, kwargs)``."""
    installed = []
    for name, module in modules.items():
        # An instance's own forward (a patched method, a remat wrapper that steps aside while the
        # check runs) is what its calls run.
        original = module.__dict__.get("forward") or type(module).forward.__get__(module)
        busy = [False]

        def forward(*args, _name=name, _module=module, _orig=original, _busy=busy, **kwargs):
            if _busy[0]:
                return _orig(*args, **kwargs)
            _busy[0] = True
            try:
                return calls(_name, _module, _orig, args, kwargs)
            finally:
                _busy[0] = False

        installed.append((module, module.__dict__.get("forward")))
        module.forward = forward
    try:
        yield
    finally:
        for module, previous in installed:
            del module.forward
            if previous is not None:
                module.forward = previous
