"""Checks that every rank agrees before the first real collective.

Two mistakes produce no error of their own in data-parallel training and are easy to make: ranks
that built different plans (different models, strategies or meshes), whose first all-gather then
mixes unrelated buffers or hangs; and ranks whose full models differ (a forgotten
``torch.manual_seed``), which silently shards a model no rank ever held. One small all-gather
per mesh dim of a plan fingerprint and a per-parameter checksum turns both into a ValueError
naming the parameter and the ranks.
"""

from __future__ import annotations

import torch

from fsdpfn import comm
from fsdpfn._plan import Plan

__all__ = ["check_ranks_agree"]


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
