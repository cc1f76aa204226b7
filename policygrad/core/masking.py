"""Masked statistics and loss aggregation over right-padded [B, T] tensors.

Every statistic here is taken over the positions where ``mask`` is nonzero only. Padding never
enters a sum, a mean or a variance, and masked positions may hold anything (NaN, inf, garbage
from a padded forward pass): the functions select with :func:`torch.where` rather than multiply
by the mask, so a NaN under the mask can reach neither the result nor its gradient.

Conventions shared by all functions:

- ``mask`` has exactly the shape of the tensor it masks and is bool, integer or floating; a
  nonzero entry marks a valid position. It is never differentiated.
- A mean over an empty set of valid positions is defined as 0 (not NaN), so that a micro-batch
  made only of padding rows contributes nothing instead of poisoning the step. A variance over
  too few valid positions raises ``ValueError`` because there is no sensible value to return.

Sources: GRPO (Shao et al. 2024, eq. 3) for the per-sequence mean ``seq-mean-token-mean``;
DAPO (Yu et al. 2025, section 3.3, token-level policy-gradient loss) for ``token-mean``;
Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", section 3.1: the length bias
of the per-sequence mean) for ``seq-mean-token-sum-norm``.
"""

from __future__ import annotations

import numbers

import torch

from policygrad.specs.aggregation import AGGREGATION_MODES

from .checks import as_bool_mask, check_2d, check_tensor

__all__ = [
    "AGGREGATION_MODES",
    "aggregate",
    "aggregation_counts",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Sum of ``x`` over the positions where ``mask`` is nonzero.

    Args:
        x: tensor of any shape, any numeric dtype.
        mask: same shape as ``x``; bool, integer or floating, nonzero = valid.
        dim: dimension(s) to reduce; ``None`` reduces everything to a 0-d tensor.

    Returns:
        ``x``'s dtype; shape of ``x`` with ``dim`` removed (0-d when ``dim`` is None). Masked
        positions contribute exactly 0 even when they hold NaN or inf.

    Raises:
        TypeError: ``x`` or ``mask`` is not a tensor.
        ValueError: ``mask`` does not have ``x``'s shape.
    """
    x = check_tensor(x, "x")
    m = as_bool_mask(x, mask)
    selected = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return selected.sum()
    return selected.sum(dim=dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is nonzero.

    ``masked_sum(x, mask, dim) / count`` where ``count`` is the number of valid positions along
    ``dim``. A slice with no valid position has mean 0 (its sum is 0 and the count is clamped
    to 1), never NaN.

    Args:
        x: tensor of any shape, floating dtype (integer input is promoted by true division).
        mask: same shape as ``x``; nonzero = valid.
        dim: dimension(s) to reduce; ``None`` reduces everything to a 0-d tensor.

    Returns:
        floating tensor, shape of ``x`` with ``dim`` removed.

    Raises:
        TypeError: ``x`` or ``mask`` is not a tensor.
        ValueError: ``mask`` does not have ``x``'s shape.
    """
    x = check_tensor(x, "x")
    m = as_bool_mask(x, mask)
    total = masked_sum(x, m, dim=dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp_min(1).to(total.dtype if total.is_floating_point() else torch.float32)


def _masked_centered(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x - masked_mean(x)`` on valid entries, 0 elsewhere; exactly 0 when all valid entries are equal.

    The mean of n equal float values need not round back to that value (0.1 three times in
    float32), so an all-equal input is detected with max == min and centred to exact zeros.
    """
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    centered = torch.where(m, x - masked_mean(x, m), zero)
    if m.any():
        valid = x[m]
        centered = torch.where(valid.amax() == valid.amin(), zero, centered)
    return centered


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of all valid entries of ``x`` (one scalar over the whole tensor).

    Two-pass formula: ``mean = masked_mean(x, mask)``, then
    ``sum_valid (x - mean)^2 / (n - 1)`` (``unbiased=True``, Bessel's correction) or ``/ n``
    (``unbiased=False``, population variance), with ``n`` the number of valid entries.

    Args:
        x: floating tensor of any shape.
        mask: same shape as ``x``; nonzero = valid.
        unbiased: divide by ``n - 1`` (default) instead of ``n``.

    Returns:
        0-d tensor of ``x``'s dtype; exactly 0 when all valid entries are equal (no rounding
        residue from the mean).

    Raises:
        TypeError: ``x`` or ``mask`` is not a tensor.
        ValueError: ``mask`` does not have ``x``'s shape; fewer than 2 valid entries with
            ``unbiased=True``, or none with ``unbiased=False``.
    """
    x = check_tensor(x, "x")
    m = as_bool_mask(x, mask)
    n = int(m.sum().item())
    needed = 2 if unbiased else 1
    if n < needed:
        raise ValueError(
            f"masked_var needs at least {needed} valid entries in mask with unbiased={unbiased}, got {n}"
        )
    centered = _masked_centered(x, m)
    return (centered * centered).sum() / (n - 1 if unbiased else n)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    *,
    unbiased: bool = True,
    reduce=None,
) -> torch.Tensor:
    """Whiten ``x`` with the mean and variance of its valid entries.

    ``(x - mean) / sqrt(var + eps)`` with ``mean`` and ``var`` from :func:`masked_mean` and
    :func:`masked_var` over all valid entries of the tensor (e.g. all valid tokens of a batch).
    With ``shift_mean=False`` the mean is added back, so only the scale changes. This is the
    advantage normalisation of the reference PPO implementations (Huang et al. 2022, "The 37
    Implementation Details of PPO"; Huang et al. 2024, "The N+ Implementation Details of RLHF
    with PPO"), applied over the valid tokens of the batch; it is a separate,
    optional step that no advantage estimator applies on its own (except ``reinforce_pp``, whose
    definition includes it).

    Args:
        x: floating tensor of any shape, e.g. advantages [B, T].
        mask: same shape as ``x``; nonzero = valid.
        shift_mean: if False, keep the original mean (scale only).
        eps: added to the variance before the square root.
        unbiased: use Bessel-corrected variance (default, as the usual PPO implementations do);
            ``False`` gives the population variance, so that the whitened valid entries have
            population variance exactly ``var / (var + eps)``.
        reduce: None (the statistics of this tensor), or ``reduce(tensor, op) -> tensor`` that
            combines a local statistic over data-parallel ranks (``op`` ``sum``, ``max`` or
            ``min``, element-wise); the mean and variance are then those of the valid entries of
            every rank's tensor (the same two-pass formula on global sums), so a batch split over
            ranks is whitened as the whole batch would be, up to summation order.

    Returns:
        tensor of ``x``'s shape and dtype; masked positions are exactly 0. When all valid entries
        are equal the valid outputs are exactly 0 (or exactly the mean with ``shift_mean=False``).

    Raises:
        TypeError, ValueError: as :func:`masked_var` (too few valid entries, shape mismatch).
    """
    x = check_tensor(x, "x")
    m = as_bool_mask(x, mask)
    if reduce is None:
        mean = masked_mean(x, m)
        var = masked_var(x, m, unbiased=unbiased)
        centered = _masked_centered(x, m)
    else:
        mean, var, centered = _global_moments(x, m, reduce, unbiased=unbiased)
    whitened = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, torch.zeros((), dtype=whitened.dtype, device=whitened.device))


def _global_moments(x: torch.Tensor, m: torch.Tensor, reduce, *, unbiased: bool):
    """Mean, variance (two-pass, over every rank's valid entries) and the centred ``x`` (0 off the
    mask; exactly 0 when every valid entry of every rank is equal), with ``reduce`` combining
    the per-rank sums, counts and extremes."""
    n = float(reduce(m.sum().to(torch.float64)))
    needed = 2 if unbiased else 1
    if n < needed:
        raise ValueError(
            f"masked_whiten needs at least {needed} valid entries over all ranks with unbiased={unbiased}, "
            f"got {int(n)}"
        )
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    mean = reduce(masked_sum(x, m)) / n
    centered = torch.where(m, x - mean, zero)
    valid = x[m]
    hi = valid.amax() if valid.numel() else torch.tensor(-float("inf"), dtype=x.dtype, device=x.device)
    lo = valid.amin() if valid.numel() else torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    if reduce(hi, "max") == reduce(lo, "min"):
        centered = torch.zeros_like(centered)
    var = reduce((centered * centered).sum()) / (n - 1 if unbiased else n)
    return mean, var, centered


def aggregation_counts(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and sequence counts of a batch, as :func:`aggregate` counts them by default.

    Compute these once on the full batch (and sum them over ranks) and pass them to every
    micro-batch's :func:`aggregate` call as ``num_tokens`` / ``num_seqs``.

    Args:
        response_mask: [B, T], nonzero = valid token.

    Returns:
        ``(num_tokens, num_seqs)``, 0-d int64 tensors: the number of valid tokens, and the number
        of rows with at least one valid token (rows with no valid token are not sequences: they
        are padding rows and are not counted).

    Raises:
        TypeError: ``response_mask`` is not a tensor.
        ValueError: ``response_mask`` is not 2-D.
    """
    response_mask = check_tensor(response_mask, "response_mask")
    check_2d(response_mask, "response_mask")
    m = response_mask != 0
    return m.sum(), m.any(dim=-1).sum()


def _check_count(value: object, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{name} must be a scalar (number or 1-element tensor), got shape {tuple(value.shape)}"
            )
        count = value.reshape(()).to(device=device, dtype=dtype)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        count = torch.tensor(float(value), dtype=dtype, device=device)
    else:
        raise TypeError(f"{name} must be a number or a 1-element tensor, got {type(value).__name__}")
    if not bool(count > 0):
        raise ValueError(f"{name} must be > 0 (the global count over all micro-batches), got {count.item()}")
    return count


def aggregate(
    loss_matrix: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    max_len: int | None = None,
    seq_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix to the scalar loss, with a named normalisation.

    With ``L = loss_matrix``, ``m = response_mask``, ``S_i = sum_t m_it L_it`` (the token-loss sum
    of sequence i) and ``n_i = sum_t m_it`` (its number of valid tokens):

    - ``token-mean``:  ``sum_i S_i / num_tokens`` (every token weighs the same; DAPO).
    - ``token-sum``:   ``sum_i S_i`` (no normalisation; ``num_tokens``/``num_seqs`` unused).
    - ``seq-mean-token-mean``: ``sum_i (S_i / n_i) / num_seqs`` (every sequence weighs the same;
      the original GRPO normalisation).
    - ``seq-mean-token-sum``: ``sum_i S_i / num_seqs``.
    - ``seq-mean-token-sum-norm``: ``sum_i S_i / (num_seqs * max_len)`` with ``max_len`` the
      generation budget (Dr.GRPO, Liu et al. 2025: a constant normaliser, free of length bias).

    Micro-batches: ``num_tokens`` and ``num_seqs`` are the GLOBAL counts over all micro-batches
    (and ranks) of one optimizer step, e.g. from :func:`aggregation_counts` on the full batch.
    Passing them makes the sum of the micro-batch losses equal the full-batch loss exactly, in
    every mode. Left as None they are counted on this call's ``response_mask``, which is right
    only for a single micro-batch (with gradient accumulation over k micro-batches it gives each
    micro-batch its own normaliser: the bias this argument exists to remove). For
    ``seq-mean-token-sum-norm`` also pass ``max_len`` when micro-batches are padded to different T.

    Rows with zero valid tokens (padding rows): they contribute 0 to every mode, and the default
    ``num_seqs`` does not count them (it counts rows with at least one valid token). A batch with
    no valid token at all gives a loss of exactly 0 with the default counts.

    A sequence held in several rows (an episode whose history restarted: its segments): pass
    ``seq_lengths``, each row's sequence's valid tokens over all its rows, as ``n_i``, and count
    each row as ``n_row / n_i`` of a sequence in ``num_seqs``; the loss is then the one of the
    sequence in one row, in every mode.

    Masked positions of ``loss_matrix`` may hold NaN/inf; they never reach the result.

    Args:
        loss_matrix: [B, T] floating per-token losses.
        response_mask: [B, T], nonzero = valid token.
        mode: one of :data:`AGGREGATION_MODES`.
        num_tokens: global number of valid tokens (``token-mean``); number or 1-element tensor, > 0.
        num_seqs: global number of sequences (``seq-mean-*`` modes); number or 1-element tensor, > 0.
        max_len: generation budget in tokens (``seq-mean-token-sum-norm``); defaults to T.
        seq_lengths: [B] floating or integer, ``n_i`` of ``seq-mean-token-mean`` per row (> 0
            where the row has a valid token); None: each row's own valid tokens.

    Returns:
        0-d tensor of ``loss_matrix``'s dtype, differentiable with respect to ``loss_matrix``.

    Raises:
        TypeError: a tensor argument is not a tensor, or a count is not a number/tensor.
        ValueError: ``loss_matrix`` not 2-D; ``response_mask`` shape differs; unknown ``mode``
            (the message lists the valid modes); a count or ``max_len`` that is not > 0.
    """
    loss_matrix = check_tensor(loss_matrix, "loss_matrix")
    check_2d(loss_matrix, "loss_matrix")
    m = as_bool_mask(loss_matrix, response_mask, "loss_matrix", "response_mask")
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid modes: {', '.join(AGGREGATION_MODES)}")
    dtype, device = loss_matrix.dtype, loss_matrix.device

    seq_sums = masked_sum(loss_matrix, m, dim=-1)  # [B]
    if mode == "token-sum":
        return seq_sums.sum()
    if mode == "token-mean":
        if num_tokens is None:
            denom = m.sum().clamp_min(1).to(dtype)
        else:
            denom = _check_count(num_tokens, "num_tokens", dtype, device)
        return seq_sums.sum() / denom

    if num_seqs is None:
        seq_denom = m.any(dim=-1).sum().clamp_min(1).to(dtype)
    else:
        seq_denom = _check_count(num_seqs, "num_seqs", dtype, device)

    if mode == "seq-mean-token-mean":
        lengths = m.sum(dim=-1) if seq_lengths is None else seq_lengths.to(device)
        seq_means = seq_sums / lengths.clamp_min(1).to(dtype)
        return seq_means.sum() / seq_denom
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / seq_denom
    # seq-mean-token-sum-norm
    if max_len is None:
        max_len = max(loss_matrix.shape[-1], 1)
    elif isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral) or max_len <= 0:
        raise ValueError(f"max_len must be a positive int (the generation budget in tokens), got {max_len!r}")
    return seq_sums.sum() / (seq_denom * max_len)
