"""Newton–Schulz orthogonalisation: pure, single device, batched over leading dimensions."""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_NS_COEFFS", "newton_schulz", "newton_schulz_flops"]

DEFAULT_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coeffs: tuple[float, float, float] = DEFAULT_NS_COEFFS,
    *,
    eps: float = 1e-7,
    dtype: torch.dtype | None = torch.bfloat16,
) -> torch.Tensor:
    """Approximately orthogonalises each matrix of ``x`` (the last two dimensions).

    The quintic iteration ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, started from
    ``x / ||x||_F`` on the wide orientation (``m <= n``), maps every singular value into roughly
    [0.7, 1.2]: the result is about ``U V^T`` for ``x = U S V^T``. Leading dimensions are a
    batch; each matrix is normalised by its own norm.

    On a 2-D input this is ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` operation for
    operation (``addmm`` in the same order), so in bf16 the result is bitwise the same. Batched
    inputs use ``baddbmm``, which on CPU gives the same bits as ``addmm`` per matrix in bf16 and
    agrees to rounding in fp32.

    Args:
      x: a tensor with at least 2 dimensions.
      steps: iterations (5 in the Muon reference).
      coeffs: ``(a, b, c)``.
      eps: lower bound of the normalising norm.
      dtype: compute dtype (``torch.bfloat16`` as torch does, or ``torch.float32``); ``None``
        keeps ``x``'s dtype. The result has this dtype.

    Returns:
      A tensor shaped like ``x``. ``x`` is not modified.

    Example:
      >>> o = fsdpfn.optim.newton_schulz(torch.randn(3, 16, 32), dtype=torch.float32)
      >>> s = torch.linalg.svdvals(o)
      >>> bool(((s > 0.5) & (s < 1.5)).all())
      True

    References:
      Keller Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024,
      https://kellerjordan.github.io/posts/muon/
    """
    if x.dim() < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    if steps < 0:
        raise ValueError(f"newton_schulz: steps must be >= 0, got {steps}")
    a, b, c = coeffs
    X = x.to(dtype) if dtype is not None else x
    if X is x:
        X = x.clone()
    tall = x.size(-2) > x.size(-1)
    if tall:
        X = X.mT
    if X.dim() == 2:
        X = X / X.norm().clamp(min=eps)
        for _ in range(steps):
            A = X @ X.T
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    else:
        batch = X.shape[:-2]
        X = X.reshape(-1, *X.shape[-2:])
        norms = torch.stack([m.norm() for m in X]) if X.size(0) else X.new_zeros(0)
        X = X / norms.clamp(min=eps).view(-1, 1, 1)
        for _ in range(steps):
            A = X @ X.mT
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)
        X = X.reshape(*batch, *X.shape[-2:])
    return X.mT if tall else X


def newton_schulz_flops(shape: tuple[int, ...], steps: int = 5) -> int:
    """Matmul FLOPs of :func:`newton_schulz` on ``shape``: per matrix and step
    ``2 m^2 n`` (A) + ``2 m^3`` (A A) + ``2 m^2 n`` (B X), with ``m <= n``."""
    *batch, r, c = shape
    m, n = min(r, c), max(r, c)
    count = 1
    for d in batch:
        count *= d
    return count * steps * (4 * m * m * n + 2 * m**3)
