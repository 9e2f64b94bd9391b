"""Newton–Schulz orthogonalisation: pure, single device, batched over leading dimensions."""

from __future__ import annotations

import functools

import numbers

import torch

from fsdpfn.optim._checks import check_choice, check_int, check_real

__all__ = [
    "DEFAULT_GRAM_RESTARTS",
    "DEFAULT_NS_COEFFS",
    "NS_METHODS",
    "check_settings",
    "newton_schulz",
    "newton_schulz_flops",
]

DEFAULT_NS_COEFFS = (3.4445, -4.7750, 2.0315)
DEFAULT_GRAM_RESTARTS = (2,)
NS_METHODS = ("standard", "gram")


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coeffs: tuple[float, float, float] = DEFAULT_NS_COEFFS,
    *,
    eps: float = 1e-7,
    dtype: torch.dtype | None = torch.bfloat16,
    method: str = "standard",
    gram_restarts: tuple[int, ...] = DEFAULT_GRAM_RESTARTS,
) -> torch.Tensor:
    """Approximately orthogonalises each matrix of ``x`` (the last two dimensions).

    The quintic iteration ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, started from
    ``x / ||x||_F`` on the wide orientation (``m <= n``), maps every singular value into roughly
    [0.7, 1.2]: the result is about ``U V^T`` for ``x = U S V^T``. Leading dimensions are a
    batch; each matrix is normalised by its own norm.

    ``method="standard"`` iterates on the ``m x n`` matrix itself. On a 2-D input this is
    ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` operation for operation (``addmm`` in
    the same order), so in bf16 the result is bitwise the same. In a batch, each matrix gets
    exactly the bits it gets alone (on CPU, see [Note: batches on CPU]; other devices run one
    ``baddbmm`` per product, equal to rounding).

    ``method="gram"`` computes the same polynomial of ``x`` on the small ``m x m`` Gram matrix
    (see [Note: Gram Newton–Schulz]): about ``8 m^2 n + 28 m^3`` FLOPs for 5 steps instead of
    ``20 m^2 n + 10 m^3``, a third fewer on a 1:4 MLP matrix. It is used only on shapes where it
    costs fewer FLOPs (``n > 1.5 m``); other shapes run the standard iteration. Equal to the
    standard result in exact arithmetic; in floating point the two differ by rounding: against a
    float64 reference the Gram form's error is 1.1-1.4x the standard iteration's in fp32 and
    0.9-2.3x in bf16 (tests/test_optim.py, Gaussian and nearly low-rank matrices).

    Args:
      x: a tensor with at least 2 dimensions.
      steps: iterations (5 in the Muon reference).
      coeffs: ``(a, b, c)``.
      eps: lower bound of the normalising norm.
      dtype: compute dtype (``torch.bfloat16`` as torch does, or ``torch.float32``); ``None``
        keeps ``x``'s dtype. The result has this dtype.
      method: ``"standard"`` or ``"gram"``.
      gram_restarts: ``"gram"`` only: iterations (in ``1 .. steps-1``) before which the Gram
        matrix is rebuilt from the current ``X``, which bounds the rounding error that the Gram
        form accumulates (``(2,)`` as in Dao AI Lab's reference; ``()`` for none).

    Returns:
      A tensor shaped like ``x``. ``x`` is not modified.

    Raises:
      ValueError: ``x`` is not a matrix, or a setting is invalid (see :func:`check_settings`).

    Example:
      >>> o = fsdpfn.optim.newton_schulz(torch.randn(3, 16, 32), dtype=torch.float32)
      >>> s = torch.linalg.svdvals(o)
      >>> bool(((s > 0.5) & (s < 1.5)).all())
      True
      >>> g = fsdpfn.optim.newton_schulz(torch.randn(16, 64), dtype=torch.float32, method="gram")

    References:
      Keller Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024,
      https://kellerjordan.github.io/posts/muon/;
      Jack Zhang, Noah Amsel, Berlin Chen, Tri Dao, "Gram Newton-Schulz: A Fast, Hardware-Aware
      Newton-Schulz Algorithm for Muon", 2026, https://tridao.me/blog/2026/gram-newton-schulz/
    """
    if x.dim() < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    restarts = check_settings("newton_schulz", steps, coeffs, eps, dtype, method, gram_restarts)
    a, b, c = coeffs
    # A fresh row-major copy: the GEMMs below then see the same memory layout whatever the
    # caller's strides (a column block is a strided view), so equal values give equal bits.
    X = x.to(dtype=dtype or x.dtype, memory_format=torch.contiguous_format, copy=True)
    tall = x.size(-2) > x.size(-1)
    if tall:
        X = X.mT
    gram = method == "gram" and _gram_is_cheaper(X.size(-2), X.size(-1), steps, restarts)
    if X.dim() > 2 and X.device.type == "cpu":  # [Note: batches on CPU]
        flat = X.reshape(-1, *X.shape[-2:])
        done = [_iterate(m, steps, a, b, c, eps, gram, restarts) for m in flat]
        X = (torch.stack(done) if done else flat.clone()).reshape(X.shape)
    else:
        X = _iterate(X, steps, a, b, c, eps, gram, restarts)
    return X.mT if tall else X


# [Note: batches on CPU]
# The distributed layouts stack same-shape matrices (or blocks) into one call and must give each
# matrix the bits a call on it alone gives: the one-process run orthogonalises every matrix by
# itself (2-D, torch.optim.Muon's addmm sequence), the owner layout puts it in a batch whose
# other members depend on the world size and the bucket. baddbmm does not give addmm's bits:
# in bf16, addmm rounds an fp32 multiply-add once while baddbmm rounds after a separate scale,
# about one element in a few hundred 5 x 7 iterations differing by one ulp; in fp32 small
# shapes differ too. So on CPU a batch runs matrix by matrix through the same code as a single
# matrix: every matrix gets the same bits whatever else is in its batch, in every dtype, and
# batching costs nothing there (a CPU bmm is itself a loop of GEMMs; per-matrix dispatch adds
# ~10 microseconds an operation, measured at 2x on 16 x (64 x 64) fp32 and nothing at 512 x 512).
# Other devices run the batch through baddbmm, one kernel for all of it.
def _iterate(
    X: torch.Tensor, steps: int, a: float, b: float, c: float, eps: float, gram: bool, restarts: frozenset[int]
) -> torch.Tensor:
    """The iteration on a wide matrix or batch ``X`` (``m <= n``), normalised first."""
    if X.dim() == 2 and not gram:
        X = X / X.norm().clamp(min=eps)
        for _ in range(steps):
            A = X @ X.T
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
        return X
    batch = X.shape[:-2]
    X = _normalise(X.reshape(-1, *X.shape[-2:]), eps)
    if gram:
        X = _gram_iterations(X, steps, a, b, c, restarts)
    else:
        for _ in range(steps):
            A = X @ X.mT
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)
    return X.reshape(*batch, *X.shape[-2:])


def _normalise(X: torch.Tensor, eps: float) -> torch.Tensor:
    """``X[i] / max(||X[i]||_F, eps)`` for a ``[B, m, n]`` stack (each norm as ``Tensor.norm``
    computes it for the matrix alone, so batched and per-matrix calls agree bit for bit)."""
    norms = torch.stack([m.norm() for m in X]) if X.size(0) else X.new_zeros(0)
    return X / norms.clamp(min=eps).view(-1, 1, 1)


# [Note: Gram Newton–Schulz]
# Every iterate is a polynomial of the start applied on the left: X_k = Q_k X_0, and Q_k, the
# Gram matrix R_0 = X_0 X_0^T and every R_k = X_k X_k^T are polynomials of R_0, so they commute.
# One step X_{k+1} = P_k X_k with P_k = a I + b R_k + c R_k^2 therefore becomes, on m x m
# matrices only,
#     Q_{k+1} = Q_k P_k,     R_{k+1} = P_k R_k P_k,
# and the m x n matrix is touched twice: R_0 = X_0 X_0^T at the start and Q_s X_0 at the end.
# Per step that is Z = b R + c R R (one product), Q <- a Q + Q Z (one; free on the first step,
# where Q = a I + Z) and R <- P (R P) (two; not needed after the last step). In floating point
# the commutation holds only up to rounding and the error compounds over the steps, so at each
# restart iteration X is materialised (X <- Q X) and R rebuilt from it (X X^T), Q reset.
def _gram_iterations(
    X: torch.Tensor, steps: int, a: float, b: float, c: float, restarts: frozenset[int]
) -> torch.Tensor:
    if steps == 0:
        return X
    R = X @ X.mT
    eye = torch.eye(X.size(-2), dtype=X.dtype, device=X.device).expand_as(R)
    Q: torch.Tensor | None = None
    for i in range(steps):
        if i in restarts:
            assert Q is not None  # check_method keeps restarts in 1 .. steps - 1
            X = Q @ X
            R = X @ X.mT
            Q = None
        Z = torch.baddbmm(R, R, R, beta=b, alpha=c)
        Q = Z + a * eye if Q is None else torch.baddbmm(Q, Q, Z, beta=a)
        if i + 1 < steps and i + 1 not in restarts:
            RP = torch.baddbmm(R, R, Z, beta=a)
            R = torch.baddbmm(RP, Z, RP, beta=a)
    assert Q is not None  # steps > 0
    return Q @ X


def check_method(
    method: str, steps: int, gram_restarts: tuple[int, ...], *, who: str = "newton_schulz", prefix: str = ""
) -> frozenset[int]:
    """``gram_restarts`` as a set, once ``method`` and the restarts are known to fit ``steps``."""
    check_choice(who, f"{prefix}method", method, NS_METHODS)
    try:
        restarts = frozenset(gram_restarts)
    except TypeError:
        raise ValueError(
            f"{who}: gram_restarts={gram_restarts!r} is invalid: pass a tuple of iteration numbers, e.g. (2,), or () for none."
        ) from None
    if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in restarts):
        raise ValueError(
            f"{who}: gram_restarts={gram_restarts!r} is invalid: every restart must be an int iteration number."
        )
    bad = sorted(i for i in restarts if not 1 <= i < steps)
    if method == "gram" and bad:
        raise ValueError(
            f"{who}: gram_restarts {bad} are not iterations 1 .. {steps - 1} of {prefix}steps={steps}; "
            "pass restart iterations inside that range, or () for none"
        )
    return frozenset(int(i) for i in restarts)


def check_settings(
    who: str,
    steps: int,
    coeffs: tuple[float, float, float],
    eps: float,
    dtype: torch.dtype | None,
    method: str,
    gram_restarts: tuple[int, ...],
    *,
    prefix: str = "",
    min_steps: int = 0,
) -> frozenset[int]:
    """Checks every Newton–Schulz setting (host-side only: see ``fsdpfn/optim/_checks.py``,
    [Note: validate when built]) and returns the restarts as a set.

    ``prefix`` is how the caller names them (``"ns_"`` in :func:`scale_by_muon`: ``ns_steps``,
    ``ns_coeffs``, ``ns_dtype``, ``ns_method``). ``steps >= min_steps`` and an int; ``coeffs``
    three finite numbers; ``eps > 0`` (it floors the normalising norm: at 0 a zero matrix, e.g.
    the gradient of an unused layer, would divide 0 by 0); ``dtype`` a floating dtype or
    ``None``; ``method`` and ``gram_restarts`` as :func:`newton_schulz` says.

    Example:
      >>> check_settings("muon", 5, DEFAULT_NS_COEFFS, 1e-7, torch.bfloat16, "gram", (2,))
      frozenset({2})
    """
    fix = "5 is the Muon reference." if min_steps >= 1 else ""
    steps = check_int(who, f"{prefix}steps", steps, lo=min_steps, fix=fix)
    name = f"{prefix}coeffs"
    try:
        parts = tuple(coeffs)
    except TypeError:
        parts = ()
    if len(parts) != 3:
        raise ValueError(
            f"{who}: {name}={coeffs!r} is invalid: {name} must be three numbers (a, b, c), e.g. {DEFAULT_NS_COEFFS}."
        )
    for i, c in enumerate(parts):
        check_real(who, f"{name}[{i}]", c, fix=f"The default is {DEFAULT_NS_COEFFS}.")
    check_real(
        who, "eps", eps, lo=0.0, lo_open=True, fix="It floors the norm Newton–Schulz divides by; 1e-7 is torch's."
    )
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(
            f"{who}: {prefix}dtype={dtype!r} is invalid: pass a floating torch.dtype (torch.bfloat16, torch.float32) "
            "or None for the input's dtype."
        )
    return check_method(method, steps, gram_restarts, who=who, prefix=prefix)


def _standard_flops(m: int, n: int, steps: int) -> int:
    return steps * (4 * m * m * n + 2 * m**3)


def _gram_flops(m: int, n: int, steps: int, restarts: frozenset[int]) -> int:
    k = len(restarts)
    return 4 * m * m * n * (1 + k) + 2 * m**3 * (steps + 3 * (steps - 1 - k))


def _gram_is_cheaper(m: int, n: int, steps: int, restarts: frozenset[int]) -> bool:
    return steps > 0 and _gram_flops(m, n, steps, restarts) < _standard_flops(m, n, steps)


def newton_schulz_flops(
    shape: tuple[int, ...],
    steps: int = 5,
    method: str = "standard",
    gram_restarts: tuple[int, ...] = DEFAULT_GRAM_RESTARTS,
) -> int:
    """Matmul FLOPs of :func:`newton_schulz` on ``shape`` (``m <= n`` the matrix's short and
    long sides), what ``FlopCounterMode`` counts.

    Standard: per step ``2 m^2 n`` (A) + ``2 m^3`` (A A) + ``2 m^2 n`` (B X). Gram (on shapes
    where it is used): ``4 m^2 n`` per restart plus two (R = X X^T and the final Q X), and
    ``2 m^3`` per product on the Gram matrices, ``steps + 3 (steps - 1 - restarts)`` of them.

    Example:
      >>> newton_schulz_flops((512, 2048)) / newton_schulz_flops((512, 2048), method="gram")
      1.5
    """
    # A plan search prices the same few shapes hundreds of thousands of times: cached by value.
    if type(steps) is int and type(method) is str:  # not a bool that hashes like 1 and must be refused
        try:
            return _flops_cached(tuple(shape), steps, method, tuple(gram_restarts))
        except TypeError:  # arguments that do not hash: checked (and refused by name) uncached
            pass
    return _flops(shape, steps, method, gram_restarts)


@functools.lru_cache(maxsize=4096)
def _flops_cached(shape: tuple[int, ...], steps: int, method: str, gram_restarts: tuple[int, ...]) -> int:
    return _flops(shape, steps, method, gram_restarts)


def _flops(shape, steps, method, gram_restarts) -> int:
    *batch, r, cols = shape
    m, n = min(r, cols), max(r, cols)
    count = 1
    for d in batch:
        count *= d
    steps = check_int("newton_schulz_flops", "steps", steps, lo=0)
    restarts = check_method(method, steps, gram_restarts, who="newton_schulz_flops")
    if method == "gram" and _gram_is_cheaper(m, n, steps, restarts):
        return count * _gram_flops(m, n, steps, restarts)
    return count * _standard_flops(m, n, steps)
