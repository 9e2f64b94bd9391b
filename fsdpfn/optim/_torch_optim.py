"""A ``torch.optim.Optimizer`` face for imperative loops: any ``fsdpfn.optim`` transform run on
``param.grad`` of (sharded) parameters, with ``param_groups`` that lr schedulers drive.

[Note: the torch.optim face]
The adapter holds, per parameter group, one transform and its state, and ``step()`` is the pure
loop's three lines: ``updates, state = transform.update(grads, state, params)``, then each
update added to its parameter in place (the same addition as :func:`apply_updates`, so the face
gives the functional form's bits). The transform is built from a factory and the group's
hyperparameters (``TorchOptimizer(params, optim.muon, lr=0.02)`` calls ``optim.muon(lr=...)``),
with every learning rate (``lr`` and any ``*_lr``) passed as a schedule that reads the group's
current value: an ``lr_scheduler`` writing ``group["lr"]`` changes the very next update, as in
``torch.optim``. Any other hyperparameter a scheduler or the user changes (``momentum`` under
``OneCycleLR``) rebuilds the transform from the factory at the next step, checked as when it
was first built; the state is kept.

``state_dict()`` is ``{"state": {"<group>": {path: leaf}}, "param_groups": [...]}``: the
transform states' leaves keyed by their pytree paths (DTensors sharded like the parameters,
Python counters) and each group's hyperparameters and ``param_names``. Like fsdpfn's own
checkpoints it never depends on the flat layout, so ``fsdpfn.checkpoint.save`` /
``torch.distributed.checkpoint`` write it and load it into the ``state_dict()`` of an optimizer
on another plan or world size, which ``load_state_dict`` then adopts.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping, cast

import optree
import torch

from fsdpfn.optim._base import GradientTransformation
from fsdpfn.optim._checks import check_real, check_transform
from fsdpfn.optim._tree import flat_state, local

__all__ = ["TorchOptimizer"]

_NOT_HYPER = ("params", "param_names")


def _named(params: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs from a dict, named pairs or plain tensors (named by index)."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            f"TorchOptimizer: {where} is a single tensor; pass a dict {{name: param}}, named_parameters() or a list"
        )
    if isinstance(params, Mapping):
        return [(str(n), p) for n, p in params.items()]
    items = list(params)
    if all(isinstance(x, tuple) and len(x) == 2 for x in items):
        return [(str(n), p) for n, p in items]
    return [(str(i), p) for i, p in enumerate(items)]


def _is_lr(key: str, value: Any) -> bool:
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    tensor = isinstance(value, torch.Tensor) and value.numel() == 1
    return (key == "lr" or key.endswith("_lr")) and (number or tensor)


def _check_grad(name: str, p: torch.Tensor, g: torch.Tensor) -> None:
    """A gradient placed like its parameter: a plain local gradient of a sharded parameter would
    be orthogonalised as if its rows were the whole matrix, a silently wrong update."""
    if getattr(g, "placements", None) != getattr(p, "placements", None) or g.shape != p.shape:
        raise ValueError(
            f"TorchOptimizer: the gradient of {name!r} is a {type(g).__name__} {tuple(g.shape)} "
            f"{getattr(g, 'placements', '')}, its parameter a {type(p).__name__} {tuple(p.shape)} {getattr(p, 'placements', '')}; "
            "gradients must be placed like their parameters (fsdpfn.unshard's backward gives sharded DTensor gradients)"
        )


def _plain(value: Any) -> bool:
    """Data a checkpoint can hold: numbers, strings, bools, ``None``, scalar tensors, and tuples,
    lists and dicts of them (not dtypes or functions, which come from the constructor)."""
    if value is None or isinstance(value, (bool, numbers.Real, str)):
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality are compared by identity
        return False


class TorchOptimizer(torch.optim.Optimizer):
    """Runs an ``fsdpfn.optim`` transform as a ``torch.optim.Optimizer`` (see
    ``fsdpfn/optim/_torch_optim.py``, [Note: the torch.optim face]).

    Args:
      params: the parameters: a dict ``{name: param}`` (``fsdpfn.shard(model, plan,
        requires_grad=True)``), ``model.named_parameters()``, a list of tensors (named by
        position), or a list of groups ``{"params": ..., **hyperparameters}``. Names are what
        the transform sees (``muon``'s labels and ``blocks`` use them).
      transform: a factory called with the hyperparameters (``optim.muon``, ``optim.adamw``,
        or ``lambda lr: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr))``), or a
        built ``GradientTransformation`` (then no hyperparameters: nothing can change them).
      **hyperparameters: the factory's keyword arguments, the group defaults. ``lr`` and
        ``*_lr`` numbers are live: schedulers drive them.

    Raises:
      ValueError: a setting is invalid (the factory's check, when built or rebuilt), a
        parameter has no gradient while others of its group have one, or a state dict does
        not fit (the message names the group, parameter or path).

    Example:
      >>> opt = fsdpfn.optim.TorchOptimizer({"w": torch.nn.Parameter(torch.ones(4, 4))}, fsdpfn.optim.muon, lr=0.02)
      >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
      >>> opt.param_groups[0]["params"][0].grad = torch.eye(4)
      >>> opt.step(); sched.step()
      >>> opt.param_groups[0]["lr"]
      0.01
      >>> sorted(opt.state_dict()["state"]["0"])[:2]
      ['inner_states/adamw/count', 'inner_states/muon/0/momentum_buffer/w']
    """

    def __init__(
        self,
        params: Any,
        transform: Callable[..., GradientTransformation] | GradientTransformation,
        **hyperparameters: Any,
    ):
        built = hasattr(transform, "init") and hasattr(transform, "update")
        if built:
            check_transform("TorchOptimizer", "transform", transform)
            if hyperparameters:
                raise ValueError(
                    f"TorchOptimizer: hyperparameters {sorted(hyperparameters)} were given with a built transform, which "
                    "cannot take them; pass its factory instead, e.g. TorchOptimizer(params, optim.muon, lr=0.02)"
                )
        elif not callable(transform):
            raise ValueError(
                f"TorchOptimizer: transform must be a factory of transforms or a transform, got {type(transform).__name__}"
            )
        self._factory = None if built else cast("Callable[..., GradientTransformation]", transform)
        self._fixed = transform if built else None
        self._arg_keys: list[tuple[str, ...]] = []
        self._transforms: list[Any] = []
        self._built_with: list[dict[str, Any]] = []
        self._states: list[Any] = []
        items = params if isinstance(params, Mapping) else list(params)
        groups = (
            [dict(g) for g in items]
            if isinstance(items, list) and items and all(isinstance(g, dict) for g in items)
            else [{"params": items}]
        )
        for i, g in enumerate(groups):
            g["params"] = _named(g["params"], f"params of group {i}")
        super().__init__(groups, dict(hyperparameters))

    # --- groups -------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, then this group's transform built and its state
        initialised (so ``state_dict()`` is complete before the first step)."""
        if "param_names" not in param_group:
            param_group = {**param_group, "params": _named(param_group["params"], "params")}
        # The factory's arguments: the defaults and this group's own, not what schedulers add.
        self._arg_keys.append(tuple(dict.fromkeys([*self.defaults, *(k for k in param_group if k not in _NOT_HYPER)])))
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._transforms.append(None)
        self._built_with.append({})
        self._build(len(self.param_groups) - 1)
        self._states.append(self._transforms[-1].init(self._tree(group, "params")))

    def _build(self, i: int) -> None:
        """Group ``i``'s transform from the factory: learning rates live, the rest as they are."""
        if self._factory is None:
            self._transforms[i] = self._fixed
            return
        group, kwargs, fixed = self.param_groups[i], {}, {}
        for k in self._arg_keys[i]:
            if _is_lr(k, group[k]):
                check_real("TorchOptimizer", k, group[k], lo=0.0, fix="A learning rate is a number >= 0.")
                kwargs[k] = lambda count, g=group, k=k: g[k]  # what the group holds now
            else:
                kwargs[k] = fixed[k] = group[k]
        self._transforms[i] = check_transform("TorchOptimizer", "the factory's result", self._factory(**kwargs))
        self._built_with[i] = fixed

    def _current(self, i: int) -> GradientTransformation:
        """Group ``i``'s transform, rebuilt first if a hyperparameter other than a learning rate
        changed since it was built (checked by the factory, as when first built)."""
        group, built = self.param_groups[i], self._built_with[i]
        fixed_now = [k for k in self._arg_keys[i] if not _is_lr(k, group[k])]
        if self._factory is not None and (
            set(fixed_now) != set(built) or any(not _same(group[k], built[k]) for k in built)
        ):
            self._build(i)
        return self._transforms[i]

    @staticmethod
    def _tree(group: dict[str, Any], what: str) -> dict[str, Any]:
        params = group["params"]
        leaves = params if what == "params" else [p.grad for p in params]
        return dict(zip(group["param_names"], leaves))

    # --- step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every group whose parameters have gradients (``param.grad``, DTensors
        for sharded parameters), in place. A group without any gradient is skipped, as in
        ``torch.optim``; a group where only some parameters have one raises (its transform
        updates all of them together, and the distributed Newton–Schulz needs every rank to hold
        the same leaves)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, group in enumerate(self.param_groups):
            grads = self._tree(group, "grads")
            missing = [n for n, g in grads.items() if g is None]
            if len(missing) == len(grads):
                continue
            if missing:
                raise ValueError(
                    f"TorchOptimizer: parameters {missing[:4]} of group {i} have no gradient while others have one; give them "
                    "a zero gradient, or put them in a parameter group of their own (a group without gradients is skipped)"
                )
            params = self._tree(group, "params")
            for name, p in params.items():
                _check_grad(name, p, grads[name])
            updates, self._states[i] = self._current(i).update(grads, self._states[i], params)
            for name, p in params.items():
                u = updates[name]
                if u is not None:
                    lp = local(p)
                    lp.add_(local(u).to(lp.dtype))
        return loss

    # --- state dict ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {"<group index>": {path: leaf}}, "param_groups": [hyperparameters and
        param_names]}``; leaves are the live state (DTensors sharded like the parameters), so a
        DCP load into this dict fills them in place. Hyperparameters that are not plain data
        (a dtype, a labels function) stay out: they come from the constructor. See [Note: the
        torch.optim face]."""
        state = {str(i): flat_state(s)[0] for i, s in enumerate(self._states)}
        groups = [{k: v for k, v in g.items() if k != "params" and _plain(v)} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Adopts ``state_dict`` (from :meth:`state_dict`, possibly saved on another plan or
        world size and loaded into this optimizer's own ``state_dict()`` by
        ``fsdpfn.checkpoint.load`` or DCP): the groups' hyperparameters and every state leaf,
        checked against this optimizer's (names, paths, shapes, placements)."""
        groups, states = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, list) or not isinstance(states, Mapping) or len(groups) != len(self.param_groups):
            raise ValueError(
                f"TorchOptimizer.load_state_dict: expected {{'state': ..., 'param_groups': [{len(self.param_groups)} groups]}} as "
                "state_dict() gives, got "
                + (f"{len(groups)} groups" if isinstance(groups, list) else f"{type(state_dict).__name__}")
            )
        new_states = []
        for i, (mine, saved) in enumerate(zip(self.param_groups, groups)):
            if list(saved.get("param_names", ())) != list(mine["param_names"]):
                raise ValueError(
                    f"TorchOptimizer.load_state_dict: group {i} holds parameters {list(mine['param_names'])[:4]}..., the saved "
                    f"group {list(saved.get('param_names', ()))[:4]}...; build the optimizer with the same parameters and groups"
                )
            new_states.append(self._adopt(i, states.get(str(i), {})))
        for mine, saved in zip(self.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k not in _NOT_HYPER})
        self._states = new_states

    def _adopt(self, i: int, saved: Mapping[str, Any]) -> Any:
        entries, spec = flat_state(self._states[i])
        leaves = []
        for path, ours in entries.items():
            if path not in saved:
                raise ValueError(
                    f"TorchOptimizer.load_state_dict: group {i} state {path!r} is missing from the state dict"
                )
            value = saved[path]
            if isinstance(ours, torch.Tensor):
                ok = isinstance(value, torch.Tensor) and type(value) is type(ours) and value.shape == ours.shape
                ok = ok and getattr(value, "placements", None) == getattr(ours, "placements", None)
                if not ok:
                    got = f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))} {getattr(value, 'placements', '')}"
                    raise ValueError(
                        f"TorchOptimizer.load_state_dict: group {i} state {path!r} is {got}, this optimizer holds "
                        f"{type(ours).__name__} {tuple(ours.shape)} {getattr(ours, 'placements', '')}; load the checkpoint into "
                        "this optimizer's state_dict() (fsdpfn.checkpoint.load reshards it) and pass the result"
                    )
                value = value.to(ours.dtype)
            leaves.append(value)
        return optree.tree_unflatten(spec, leaves)
