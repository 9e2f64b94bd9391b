"""Checks that every rank agrees before the first real collective.

Two mistakes produce no error of their own in data-parallel training and are easy to make: ranks
that built different plans (different models, strategies or meshes), whose first all-gather then
mixes unrelated buffers or hangs; and ranks whose full models differ (a forgotten
``torch.manual_seed``), which silently shards a model no rank ever held. One small all-gather
per mesh dim of a plan fingerprint and a per-parameter checksum turns both into a ValueError
naming the parameter and the ranks.

Models that never exist whole on one rank (built on the meta device, then initialised or loaded
shard by shard) cannot be compared that way. :func:`check_plan_agree` compares the fingerprint
plus a token that determines the values (the init seed and function, or a digest of the
checkpoint's headers) before anything is generated; :func:`check_values_agree` compares
checksums of what every rank generated for a common slice afterwards.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch

from fsdpfn import comm
from fsdpfn._plan import Plan
from fsdpfn.comm import exchange_problems, group_info

__all__ = ["check_on_every_rank", "check_plan_agree", "check_ranks_agree", "check_values_agree", "checksums"]


def _groups(plan: Plan):
    mesh = plan.mesh
    return [mesh.get_group(d) for d in range(mesh.ndim)]


def _fingerprint_value(plan: Plan) -> float:
    # 52 bits of the fingerprint fit exactly in a float64 mantissa.
    return float(int(plan.fingerprint, 16) >> 12)


def check_ranks_agree(plan: Plan, full: dict[str, torch.Tensor]) -> None:
    """Raises ``ValueError`` unless every rank of the plan's mesh holds the same plan and the
    same full parameters (compared by float64 sum and sum of squares)."""
    names = plan.param_names
    on_meta = [n for n in names if full[n].is_meta]
    if on_meta:
        raise ValueError(
            f"parameters {on_meta[:3]}{' ...' if len(on_meta) > 3 else ''} are on the meta device: there are no values to "
            "shard. Initialise a meta model with fsdpfn.init_shards(model, plan, seed=...) or load its weights with "
            "fsdpfn.load_safetensors(model, plan, path)"
        )
    # The fingerprint goes first and alone: ranks with different plans may not even agree on
    # the length of the checksum row.
    device = full[names[0]].device if names else None  # the device the parameters' collectives use
    fingerprint = torch.tensor([_fingerprint_value(plan)], dtype=torch.float64, device=device)
    sums = [full[n].detach().double().sum() for n in names]
    squares = [full[n].detach().double().square().sum() for n in names]
    checksums = torch.stack([*sums, *squares]) if names else torch.zeros(0, dtype=torch.float64)
    for group in _groups(plan):
        ranks = comm.group_ranks(group)
        seen = comm.all_gather_rows(fingerprint, group, tag="check_ranks_agree")[:, 0]
        differ = [ranks[i] for i in range(len(ranks)) if seen[i] != seen[0]]
        if differ:
            raise ValueError(
                f"ranks {differ} built a different plan than rank {ranks[0]} (fingerprint {plan.fingerprint} on this rank); "
                "every rank must call fsdpfn.plan with the same model, units, strategy, mp and mesh"
            )
        table = comm.all_gather_rows(checksums, group, tag="check_ranks_agree")
        close = torch.isclose(table, table[:1].expand_as(table), rtol=1e-12, atol=0.0, equal_nan=True)
        if not bool(close.all()):
            column = int((~close.all(dim=0)).nonzero()[0])
            differ = [ranks[i] for i in range(len(ranks)) if not bool(close[i, column])]
            raise ValueError(
                f"parameter {names[column % len(names)]!r} differs between rank {ranks[0]} and ranks {differ} before sharding; "
                "every rank must start from the same full model: seed with torch.manual_seed(...) before building it, "
                "or load the same checkpoint everywhere (pass check=False to fsdpfn.shard to skip this check)"
            )


def _token_value(token: str) -> float:
    return float(int(hashlib.sha256(token.encode()).hexdigest()[:13], 16))


def check_plan_agree(plan: Plan, token: str, *, what: str, device=None) -> None:
    """Raises ``ValueError`` unless every rank of the plan's mesh holds the same plan and the same
    ``token`` (a string that determines the values about to be built, such as ``"seed=0, init=..."``).

    One all-gather of two float64 numbers per mesh dim; if the tokens differ, one more
    all-gather of the tokens themselves, so the error shows both. Every rank raises the same error.

    Example:
      >>> check_plan_agree(plan, "seed=0", what="init seed and function")  # every rank passes
    """
    row = torch.tensor([_fingerprint_value(plan), _token_value(token)], dtype=torch.float64, device=device)
    for d, group in enumerate(_groups(plan)):
        ranks = comm.group_ranks(group)
        seen = comm.all_gather_rows(row, group, tag="check_plan_agree")
        differ = [ranks[i] for i in range(len(ranks)) if seen[i, 0] != seen[0, 0]]
        if differ:
            raise ValueError(
                f"ranks {differ} built a different plan than rank {ranks[0]} (fingerprint {plan.fingerprint} on this rank); "
                "every rank must call fsdpfn.plan with the same model, units, strategy, mp and mesh"
            )
        differ = [ranks[i] for i in range(len(ranks)) if seen[i, 1] != seen[0, 1]]
        if differ:
            tokens = comm.all_gather_object(token, group, tag="check_plan_agree")
            raise ValueError(
                f"ranks {differ} have a different {what} than rank {ranks[0]}: {tokens[ranks.index(differ[0])]!r} "
                f"against {tokens[0]!r}; every rank must pass the same"
            )


def checksums(values) -> torch.Tensor:
    """Float64 sum and sum of squares of each tensor, ``[sum_0, ..., sum_n, square_0, ..., square_n]``.

    Computed over chunks of at most an eighth of the tensor (at least 256, at most 2**16
    elements), so the only temporary is one float64 chunk: at most a quarter of the tensor's
    fp32 bytes, or 512 KiB, never a float64 copy of the whole tensor.

    Example:
      >>> checksums([torch.ones(3), torch.arange(3.0)])
      tensor([3., 3., 3., 5.], dtype=torch.float64)
    """
    sums, squares = [], []
    for x in values:
        flat = x.detach().reshape(-1)
        s = torch.zeros((), dtype=torch.float64, device=x.device)
        q = torch.zeros((), dtype=torch.float64, device=x.device)
        for part in flat.split(min(1 << 16, max(1 << 8, flat.numel() // 8))):
            part = part.double()
            s += part.sum()
            q += torch.dot(part, part)
        sums.append(s)
        squares.append(q)
    return torch.stack([*sums, *squares]) if sums else torch.zeros(0, dtype=torch.float64)


def check_values_agree(plan: Plan, names, table: torch.Tensor, *, fix: str) -> None:
    """Raises ``ValueError`` unless every rank computed the same :func:`checksums` ``table`` for
    the parameters ``names`` (compared per mesh dim, to a relative 1e-12). ``fix`` says how to
    repair the mismatch.

    Example:
      >>> names = ["blocks.0.fc.weight", "head.weight"]
      >>> values = [model.get_parameter(n) for n in names]
      >>> check_values_agree(plan, names, checksums(values), fix="seed every rank alike")  # passes
    """
    names = list(names)
    for group in _groups(plan):
        ranks = comm.group_ranks(group)
        seen = comm.all_gather_rows(table, group, tag="check_values_agree")
        close = torch.isclose(seen, seen[:1].expand_as(seen), rtol=1e-12, atol=0.0, equal_nan=True)
        if not bool(close.all()):
            column = int((~close.all(dim=0)).nonzero()[0])
            differ = [ranks[i] for i in range(len(ranks)) if not bool(close[i, column])]
            raise ValueError(
                f"parameter {names[column % len(names)]!r} differs between rank {ranks[0]} and ranks {differ}; {fix}"
            )


# Process state: the (plan, site, group) whose first check this process agreed on with its
# peers. The pure path's step is a function call with no object of its own to carry it.
_AGREED: set[tuple[str, str, int]] = set()


def check_on_every_rank(plan: Plan, site: str, group, check: Callable[[], None]) -> None:
    """Runs ``check`` (a local input check that raises ``ValueError``) so that, the first time
    this process reaches ``site`` of this plan, a failure on any rank of ``group`` is a
    ``ValueError`` on every rank, naming the ranks and their reasons: a rank whose own input is
    right would otherwise wait in the next collective for the rank that raised.

    The agreement goes through the store (see [Note: agreeing through the store] in
    ``fsdpfn/comm/_agree.py``): no collective, and after the first time nothing at all but the
    local check. Input that goes wrong on one rank only later (the shards of a later step) still
    raises there, and its peers learn of it from the announcement while they wait.

    Example:
      >>> check_on_every_rank(plan, "blocks.0", None, lambda: None)   # every rank passes
    """
    try:
        check()
        problem = None
    except ValueError as e:
        problem, error = e, e
    ranks, gid = group_info(group)
    key = (plan.fingerprint, site, gid)
    if len(ranks) == 1 or key in _AGREED:
        if problem is not None:
            raise error
        return
    found = exchange_problems(f"{site!r} of plan {plan.fingerprint}", str(problem) if problem else None, group)
    if found:
        lines = "\n".join(f"  rank {r}: {text}" for r, text in sorted(found.items()))
        raise ValueError(
            f"rank(s) {sorted(found)} refused the input of {site!r} (every rank stops here, before the "
            f"collective):\n{lines}"
        ) from (problem if problem is not None else None)
    _AGREED.add(key)
