"""pass@k by the unbiased estimator of Chen et al. 2021 (eq. 1), and the ks ``policygrad lab passk``
reports it at (the protocol: :mod:`policygrad.lab.passk`)."""

from __future__ import annotations

from collections.abc import Sequence


def k_ladder(n: int) -> list[int]:
    """The k of the curve for n samples: the powers of two up to n, and n itself when it is not
    one (``k_ladder(32) == [1, 2, 4, 8, 16, 32]``, ``k_ladder(6) == [1, 2, 4, 6]``).

    Raises:
        ValueError: n < 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"--samples must be an integer >= 1, got {n!r}")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks


def parse_ks(text: str | None, n: int) -> list[int]:
    """``--k``: comma-separated k (sorted, duplicates dropped), each in 1 .. n; None or empty:
    :func:`k_ladder`.

    Raises:
        ValueError: an item that is not an integer, or a k outside 1 .. n (names ``--k`` and
            ``--samples``).
    """
    if not text or not text.strip():
        return k_ladder(n)
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise ValueError(f"--k {text!r} must be comma-separated integers, e.g. --k 1,4,16") from None
    if not ks:
        raise ValueError(f"--k {text!r} names no k; give comma-separated integers, e.g. --k 1,4,16")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(
            f"--k {text}: each k must be in 1 .. --samples {n} (pass@k needs at least k samples per "
            f"problem); drop {', '.join(map(str, bad))} or raise --samples"
        )
    return ks


def pass_at_k_curve(correct: Sequence[int], n: int, ks: Sequence[int]) -> dict[int, float]:
    """Mean over problems of the unbiased pass@k (Chen et al. 2021, eq. 1), for each k.

    Args:
        correct: per problem, how many of its n samples are correct (ints in 0 .. n).
        n: samples per problem.
        ks: the k, each in 1 .. n.

    Returns:
        ``{k: pass@k}``, floats in [0, 1] (0.0 for every k when there is no problem).

    Raises:
        ValueError: a count outside 0 .. n or a k outside 1 .. n (from
            :func:`~policygrad.evaluate.scoring.pass_at_k`; k < 1 named here).
    """
    from policygrad.evaluate.scoring import pass_at_k  # imported here: it loads torch

    out = {}
    for k in ks:
        if k < 1:
            raise ValueError(f"k={k} must be >= 1")
        out[k] = sum(pass_at_k(n, c, k) for c in correct) / len(correct) if correct else 0.0
    return out
