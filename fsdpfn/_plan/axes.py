"""Named mesh axes and their roles: the one place that knows what each mesh dim is for.

A plan runs on a ``DeviceMesh`` whose dims are named. Each name has a *role*:

=================  ==============================================================================
role               what the axis does
=================  ==============================================================================
``shard``          data parallel; parameters, gradients and optimizer state are sharded over it
                   (FSDP / ZeRO). Its all-gather and reduce-scatter run here.
``replicate``      data parallel; everything is replicated over it, gradients are all-reduced
                   (DDP; the outer axis of HSDP).
``tp``             tensor parallel; matmul weights are split over it (``colwise``/``rowwise``),
                   the activation collectives run here, gradients are never averaged over it.
``ep``             expert parallel; the packed experts of a mixture-of-experts layer are split
                   over it (dim 0, the expert index) and tokens travel to their experts by
                   all-to-all. It is data parallel too: every rank reads its own batch, so
                   gradients are averaged over it. The ``shard`` axis beside it is then the
                   *expert data-parallel* axis: a rank's experts are spread over it whole (split
                   along dim 0 again, the expert index), while dense parameters are sharded
                   over ``ep`` x ``shard`` flattened. A replicate axis may come first (HSDP
                   over experts): every parameter is replicated over it and every gradient
                   all-reduced over it, and tokens travel over ``ep`` within each replica.
``cp``             context parallel; activations are split along the sequence over it (each rank
                   a head and a tail chunk, see :func:`fsdpfn.context_parallel_shard`) and
                   attention exchanges keys and values over it
                   (:func:`fsdpfn.context_parallel_attention`). Parameters are not split over it,
                   so, like dense parameters beside ``ep``, they are sharded over ``shard`` x
                   ``cp`` flattened (every cp rank holds a distinct shard, as torchtitan's
                   ``dp_shard x cp``), and gradients are averaged over it. cp ranks read the
                   same sequences, so it is not part of :attr:`MeshAxes.dp_size`.
``pp``             pipeline parallel; the model's units are cut into stages (the plan's
                   :class:`fsdpfn.Stages`) and each pp rank holds and runs only its stages'
                   units, passing activations forward and gradients back by send/recv. Every
                   other axis works within a stage as it does without pp. It is not data
                   parallel: parameters are neither sharded nor averaged over it, and pp ranks
                   read the same micro-batches.
=================  ==============================================================================

Conventional names map to roles by themselves (``shard``, ``dp_shard``, ``dp``, ``fsdp``,
``edp``, ``efsdp`` -> ``shard``; ``replicate``, ``dp_replicate``, ``ddp`` -> ``replicate``; ``tp`` -> ``tp``; ``ep``
-> ``ep``; ``cp`` -> ``cp``; ``pp`` -> ``pp``); any other name needs ``axes={name: role}``. A 1-D mesh is the shard axis whatever
its name, except a name (or ``axes`` role) of tp, ep, cp or pp (refused, see below), and a 2-D mesh named
``("replicate", "shard")`` is HSDP, as they always were.

[Note: a 1-D ep mesh]
A 1-D mesh named ``"ep"`` used to be plain sharding, so the experts were sharded like any weight
and never dispatched: the user asked for expert parallelism and silently got none. It is refused
rather than made an ep plan because an ep plan gathers each layer's experts over the ``shard``
axis beside ``ep``, a mesh dim (and process group) the 1-D mesh does not have; making one
behind the user's back would create process groups collectively at an unexpected point. The
``(ep, 1)`` mesh named ``("ep", "edp")`` is the same computation and costs nothing.

[Note: a 1-D mesh of another parallelism]
The same holds for every role that is not data parallelism: a 1-D mesh named ``"cp"`` was
sharding over 4 ranks with cp = 1 (each rank reading whole sequences), one named ``"tp"`` plain
sharding with no layer split, each without a word. One rule refuses them all, the role read from
the name or from ``axes``, and the message builds the 2-D mesh that says the same with its
data-parallel partner of size 1. ``replicate`` stays a 1-D data-parallel mesh: the plan's
strategy says whether parameters are replicated or sharded over it.

Everything else (groups, sizes, the data-parallel world, DTensor placements) is derived here from
the roles, never from how many dims the mesh has. The module imports nothing from fsdpfn.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Mapping, cast

__all__ = ["Role", "MeshAxes", "DEFAULT_ROLES"]


class Role(str, enum.Enum):
    """What a mesh axis is for (see the module docstring).

    Example:
      >>> Role("tp"), Role.SHARD.is_data_parallel
      (<Role.TP: 'tp'>, True)
    """

    SHARD = "shard"
    REPLICATE = "replicate"
    TP = "tp"
    EP = "ep"
    CP = "cp"
    PP = "pp"

    @property
    def is_data_parallel(self) -> bool:
        """Gradients are averaged over this axis (``shard``, ``replicate``, ``ep`` and ``cp``)."""
        return self in (Role.SHARD, Role.REPLICATE, Role.EP, Role.CP)

    def __str__(self) -> str:
        return self.value


DEFAULT_ROLES: Mapping[str, Role] = {
    "shard": Role.SHARD,
    "dp_shard": Role.SHARD,
    "dp": Role.SHARD,
    "fsdp": Role.SHARD,
    "edp": Role.SHARD,
    "efsdp": Role.SHARD,
    "replicate": Role.REPLICATE,
    "dp_replicate": Role.REPLICATE,
    "ddp": Role.REPLICATE,
    "tp": Role.TP,
    "ep": Role.EP,
    "cp": Role.CP,
    "pp": Role.PP,
}


# [Note: a 1-D mesh of another parallelism]: per role, the data-parallel axis it needs beside it,
# whether that axis comes first in the mesh that says the same (size 1), and why it is needed.
_PARTNER: Mapping[Role, tuple[str, bool, str]] = {
    Role.EP: (
        "edp",
        False,
        "expert parallelism gathers each layer's experts over an expert data-parallel axis beside it",
    ),
    Role.PP: ("dp", False, "pipeline parallelism needs a data-parallel axis beside it"),
    Role.TP: ("dp", True, "tensor parallelism splits layers over it, beside a data-parallel axis"),
    Role.CP: ("dp", True, "context parallelism splits sequences over it, beside a data-parallel axis"),
}


def _one_dim_message(name: str, n: int, role: Role) -> str:
    partner, first, why = _PARTNER[role]
    shape, dims = ((1, n), (partner, name)) if first else ((n, 1), (name, partner))
    article = "an" if role is Role.EP else "a"
    return (
        f"a 1-D mesh named {name!r} of {n} ranks is {article} {role.value} axis with nothing beside it: {why} "
        f"(size 1 is fine). Build init_device_mesh('cpu', {shape}, mesh_dim_names={dims}) (or 'cuda'); "
        "for plain sharding over every rank, name the axis 'dp'"
    )


def _as_role(value: Any, where: str) -> Role:
    try:
        return Role(str(value.value if isinstance(value, Role) else value))
    except ValueError:
        raise ValueError(f"{where}: unknown role {value!r}; choose one of {', '.join(r.value for r in Role)}") from None


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The axes of a mesh: their sizes, names and roles. Frozen and validated.

    Attributes:
      shape: ranks along each mesh dim.
      names: the dims' names.
      roles: each dim's :class:`Role`.

    Example:
      >>> axes = MeshAxes.from_shape({"dp": 2, "tp": 2})
      >>> axes.size(Role.SHARD), axes.tp_size, axes.dp_size, axes.dim(Role.TP)
      (2, 2, 2, 1)
      >>> MeshAxes.from_shape((2, 4)).roles  # a bare 2-D shape means HSDP
      (<Role.REPLICATE: 'replicate'>, <Role.SHARD: 'shard'>)
    """

    shape: tuple[int, ...]
    names: tuple[str, ...]
    roles: tuple[Role, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "names", tuple(self.names))
        object.__setattr__(self, "roles", tuple(_as_role(r, "MeshAxes") for r in self.roles))
        if not (len(self.shape) == len(self.names) == len(self.roles)) or not self.shape:
            raise ValueError(
                f"MeshAxes needs one name and one role per mesh dim, got shape {self.shape}, names {self.names}, roles {self.roles}"
            )
        if any(s < 1 for s in self.shape):
            raise ValueError(f"mesh dims must have >= 1 rank, got shape {self.shape}")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"mesh dim names must be distinct, got {self.names}")
        for role in Role:
            dims = [n for n, r in zip(self.names, self.roles) if r is role]
            if len(dims) > 1:
                raise ValueError(
                    f"mesh axes {dims} all have role {role.value!r}; give each role to one axis (flatten them into one mesh dim)"
                )
        if Role.SHARD not in self.roles:
            example = (
                "init_device_mesh('cpu', (1, tp), mesh_dim_names=('dp', 'tp'))"
                if Role.CP not in self.roles
                else f"init_device_mesh('cpu', {(1, *self.shape)}, mesh_dim_names={('dp', *self.names)}): FSDP then "
                "shards over dp x cp"
            )
            raise ValueError(
                f"mesh {dict(zip(self.names, self.shape))} has no data-parallel shard axis; add one (size 1 is fine), "
                f"e.g. {example}"
            )
        if Role.EP in self.roles:
            ep = self.names[self.roles.index(Role.EP)]
            tp = [n for n, r in zip(self.names, self.roles) if r is Role.TP]
            rep = self.dim(Role.REPLICATE)
            if tp or (rep is not None and rep != 0):
                why = (
                    f"axis {tp[0]!r} (tp) cannot be combined with it yet"
                    if tp
                    else f"a replicate axis ({self.names[cast(int, rep)]!r}) must be the first mesh dim, outside {ep!r} and the shard axis"
                )
                raise NotImplementedError(
                    f"mesh {dict(zip(self.names, self.shape))}: expert parallelism (axis {ep!r}) runs beside a data-parallel "
                    f"shard axis and, optionally, a replicate axis before both; {why}. Use a mesh such as "
                    f"init_device_mesh('cpu', (ep, edp), mesh_dim_names=('ep', 'edp')) or "
                    f"init_device_mesh('cpu', (r, ep, edp), mesh_dim_names=('replicate', 'ep', 'edp'))"
                )
            if Role.CP in self.roles:
                cp = self.names[self.roles.index(Role.CP)]
                shard = cast(int, self.dim(Role.SHARD))
                if self.roles.index(Role.CP) < max(cast(int, self.dim(Role.EP)), shard):
                    # An expert weight's rows are cut over shard x cp flattened, one group of
                    # mesh dims side by side: cp must come after the ep and shard axes.
                    raise NotImplementedError(
                        f"mesh {dict(zip(self.names, self.shape))}: context parallelism (axis {cp!r}) beside expert "
                        f"parallelism (axis {ep!r}) needs the cp axis after the {ep!r} and shard axes (expert weights are "
                        f"sharded over shard x cp flattened); use a mesh such as init_device_mesh('cpu', (ep, edp, cp), "
                        "mesh_dim_names=('ep', 'edp', 'cp'))"
                    )

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_names(cls, shape, names, axes: Mapping[str, Any] | None = None) -> "MeshAxes":
        """Axes from dim sizes and names, roles from ``axes`` (``{name: role}``) or the
        conventional names. ``names=None``: a 1-D mesh is the shard axis, a 2-D one HSDP."""
        shape = tuple(shape)
        axes = dict(axes or {})
        if names is None:
            if len(shape) == 1:
                names = ("shard",)
            elif len(shape) == 2:
                names = ("replicate", "shard")
            else:
                raise ValueError(
                    f"a {len(shape)}-D mesh needs dim names; build it with init_device_mesh(..., mesh_dim_names=(...)) "
                    "using names such as 'replicate', 'shard', 'tp'"
                )
        names = tuple(names)
        for key in axes:
            if key not in names:
                raise ValueError(f"axes={axes!r} names {key!r}, which is not a mesh dim; the mesh's dims are {names}")
        if len(shape) == 1:
            role = _as_role(axes.get(names[0], DEFAULT_ROLES.get(names[0], Role.SHARD)), f"axes[{names[0]!r}]")
            if role in _PARTNER:  # see [Note: a 1-D mesh of another parallelism]
                raise ValueError(_one_dim_message(names[0], shape[0], role))
        if len(shape) == 1 and names[0] not in axes and DEFAULT_ROLES.get(names[0]) is not Role.SHARD:
            # A 1-D mesh has always meant plain sharding over it, whatever it is called.
            return cls(shape, names, (Role.SHARD,))
        roles = []
        for name in names:
            if name in axes:
                roles.append(_as_role(axes[name], f"axes[{name!r}]"))
            elif name in DEFAULT_ROLES:
                roles.append(DEFAULT_ROLES[name])
            else:
                known = ", ".join(sorted(DEFAULT_ROLES))
                raise ValueError(
                    f"mesh axis {name!r} has no role. Name it one of {known}, or say what it is for with "
                    f"fsdpfn.plan(..., axes={{{name!r}: 'shard' | 'replicate' | 'tp' | 'ep' | 'cp' | 'pp'}})"
                )
        return cls(shape, names, tuple(roles))

    @classmethod
    def from_shape(cls, shape, axes: Mapping[str, Any] | None = None) -> "MeshAxes":
        """Axes of an abstract mesh: ``(W,)``, ``(R, W)`` (HSDP), or ``{name: size}``."""
        if isinstance(shape, int):
            shape = (shape,)
        if isinstance(shape, Mapping):
            names, sizes = tuple(shape), tuple(shape.values())
        else:
            names, sizes = None, tuple(shape)
        if not sizes or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in sizes):
            raise ValueError(
                f"an abstract mesh is a tuple of positive ints like (W,) or (R, W), or a dict like {{'dp': 2, 'tp': 2}}, got {shape!r}"
            )
        return cls.from_names(sizes, names, axes)

    @classmethod
    def from_mesh(cls, mesh, axes: Mapping[str, Any] | None = None) -> "MeshAxes":
        """Axes of a live ``DeviceMesh``."""
        names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
        return cls.from_names(tuple(mesh.mesh.shape), names, axes)

    # ---- queries -----------------------------------------------------------------------------

    def dim(self, role: Role) -> int | None:
        """The mesh dim with ``role``, or ``None``."""
        return self.roles.index(role) if role in self.roles else None

    def size(self, role: Role) -> int:
        """Ranks along the axis with ``role`` (1 if the mesh has none)."""
        d = self.dim(role)
        return 1 if d is None else self.shape[d]

    @property
    def shard_size(self) -> int:
        return self.size(Role.SHARD)

    @property
    def replicate_size(self) -> int:
        return self.size(Role.REPLICATE)

    @property
    def tp_size(self) -> int:
        return self.size(Role.TP)

    @property
    def ep_size(self) -> int:
        return self.size(Role.EP)

    @property
    def cp_size(self) -> int:
        return self.size(Role.CP)

    @property
    def pp_size(self) -> int:
        """Pipeline ranks (1 without a pp axis): the model's stages are spread over them.

        Example:
          >>> MeshAxes.from_shape({"pp": 2, "dp": 2}).pp_size, MeshAxes.from_shape({"pp": 2, "dp": 2}).dp_size
          (2, 2)
        """
        return self.size(Role.PP)

    @property
    def dense_shard_size(self) -> int:
        """Ranks a dense (non-expert) parameter is sharded over: the shard axis, times the ``ep``
        and ``cp`` axes when there are (flattened into one group).

        Example:
          >>> MeshAxes.from_shape({"ep": 2, "edp": 1, "cp": 2}).dense_shard_size
          4
        """
        return self.shard_size * self.ep_size * self.cp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks, which read different examples (shard x replicate x ep): the
        global batch is cut into this many slices. ``cp`` ranks read the same examples (each a
        part of every sequence), so they are not counted here; see :attr:`grad_ranks`."""
        return self.shard_size * self.replicate_size * self.ep_size

    @property
    def grad_ranks(self) -> int:
        """Ranks a gradient is averaged over: :attr:`dp_size` x ``cp``. Each cp rank's loss is
        the mean over its own tokens, an equal share of its sequences' (the balancer gives every
        rank as many), so the mean over dp x cp is the mean over the global batch's tokens.

        Example:
          >>> MeshAxes.from_shape({"dp": 2, "cp": 2}).grad_ranks, MeshAxes.from_shape({"dp": 2, "cp": 2}).dp_size
          (4, 2)
        """
        return self.dp_size * self.cp_size

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def hsdp(self) -> bool:
        """A replicate axis beside the shard axis (HSDP: reduce-scatter, then all-reduce)."""
        return Role.REPLICATE in self.roles

    @property
    def legacy(self) -> bool:
        """The two forms plans had before named roles (1-D, or 2-D ``("replicate", "shard")``):
        their JSON keeps its old shape and their fingerprints do not change."""
        return self.roles in ((Role.SHARD,), (Role.REPLICATE, Role.SHARD)) and (
            len(self.shape) == 1 or self.names == ("replicate", "shard")
        )

    def describe(self) -> str:
        """``"dp=2 (shard) x tp=2 (tp)"``."""
        return " x ".join(
            f"{n}={s}" + ("" if n == r.value else f" ({r.value})")
            for n, s, r in zip(self.names, self.shape, self.roles)
        )

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dim_names": list(self.names), "roles": [r.value for r in self.roles]}
