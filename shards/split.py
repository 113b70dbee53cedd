"""Drawing the val split: which samples (or text documents) of `train` go to `val`, seeded and
stratified by class. Used by the packing of samples into shards (shards/packing.py) and by text sources, which draw
whole documents (shards/sources/text.py)."""

from __future__ import annotations

import numpy as np

from ringfeed.errors import UserError


def draw_val(n: int, labels: np.ndarray | None, fraction: float, seed: int,
             unit: str = "samples", why: str = "") -> np.ndarray:
    """A mask over `n` items: the ones drawn into val (choose_val with the seed's generator).
    A draw that leaves either split empty is one line naming the fraction and the count."""
    is_val = choose_val(n, labels, fraction, np.random.default_rng([seed, 0]))
    if is_val.all() or not is_val.any():
        side = "no train" if is_val.all() else "no val"
        raise UserError(f"--val-fraction {fraction} of {n} {unit} leaves {side} {unit}{why}")
    return is_val


def choose_val(n: int, labels: np.ndarray | None, fraction: float,
               rng: np.random.Generator) -> np.ndarray:
    """A mask of round(n * fraction) samples, stratified by class when labels are known."""
    k = max(1, round(n * fraction))
    if labels is None:
        picked = rng.permutation(n)[:k]
    else:
        classes, counts = np.unique(labels, return_counts=True)
        quota = counts * fraction
        take = np.floor(quota).astype(np.int64)
        # largest remainders first, so the per-class counts add up to k
        extra = np.argsort(-(quota - take), kind="stable")[: max(0, k - int(take.sum()))]
        take[extra] += 1
        take = np.minimum(take, counts)
        picked = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:t]
                                 for c, t in zip(classes, take, strict=True)])
    mask = np.zeros(n, dtype=bool)
    mask[picked] = True
    return mask
