"""``RunningStats``: streaming, exactly mergeable statistics of vectors ``[N, D]`` (used by ``vla data stats``).

* mean/std: per-batch moments merged with Chan et al.'s parallel update (exact up to float64 rounding);
* min/max and non-finite counts (NaN/inf are excluded from everything else);
* q01/q99: a per-dim histogram of ``num_bins`` bins on a power-of-two grid. Bin ``i`` at exponent ``e`` holds
  ``[i 2^e, (i+1) 2^e)``; ``e`` is the smallest that fits ``[min, max]`` in ``num_bins`` bins, so growing the range
  (openpi re-bins by interpolation) here merges bins ``2^k`` at a time, which is *exact*: the final histogram
  depends only on the data, not on the order, batching or sharding. Each bin also keeps its own min and max, so
  point masses (a binary gripper) give exact quantiles and others are interpolated between a bin's extremes;
  the error is below one bin width ``< 2 (max - min) / (num_bins - 1)``.
"""

from __future__ import annotations

import numpy as np

from vla.data.norm_stats import NormStats

DEFAULT_BINS = 8192
_FLUSH_ROWS = 1 << 16  # small updates (one short episode) are buffered and processed together


class RunningStats:
    """Streaming, mergeable statistics of vectors ``[N, D]`` (see the module docstring)."""

    def __init__(self, dim: int, num_bins: int = DEFAULT_BINS) -> None:
        if num_bins < 16:
            raise ValueError(f"num_bins must be >= 16, got {num_bins}")
        self.dim, self.num_bins = dim, num_bins
        self.frames = 0
        self.n = np.zeros(dim, dtype=np.int64)  # finite values per dim
        self.mean = np.zeros(dim)
        self.m2 = np.zeros(dim)  # sum of squared deviations from the mean
        self.min = np.full(dim, np.inf)
        self.max = np.full(dim, -np.inf)
        self.nonfinite = np.zeros(dim, dtype=np.int64)
        self.exp = np.zeros(dim, dtype=np.int64)  # histogram bin width is 2**exp
        self.start = np.zeros(dim, dtype=np.int64)  # index of the first bin
        self.counts = np.zeros((dim, num_bins), dtype=np.int64)
        self.bmin = np.full((dim, num_bins), np.inf)
        self.bmax = np.full((dim, num_bins), -np.inf)
        self._buf: list[np.ndarray] = []
        self._buf_rows = 0

    # ---- accumulation ---------------------------------------------------------------------------------------
    def update(self, x: np.ndarray) -> None:
        """Add a batch ``[N, D]`` (any float dtype; computed in float64)."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(
                f"RunningStats(dim={self.dim}).update expects [N, {self.dim}], got {list(x.shape)}"
            )
        self._buf.append(x)
        self._buf_rows += len(x)
        if self._buf_rows >= _FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        """Process the buffered rows now (``update`` buffers ~65k rows; results and ``merge`` flush first)."""
        if not self._buf:
            return
        x = np.concatenate(self._buf)
        self._buf, self._buf_rows = [], 0
        self.frames += len(x)
        ok = np.isfinite(x)
        self.nonfinite += (~ok).sum(0)
        n_b = ok.sum(0)
        xz = np.where(ok, x, 0.0)
        mean_b = np.divide(xz.sum(0), n_b, out=np.zeros(self.dim), where=n_b > 0)
        m2_b = (np.where(ok, x - mean_b, 0.0) ** 2).sum(0)
        self._merge_moments(n_b, mean_b, m2_b)
        self.min = np.minimum(self.min, np.where(ok, x, np.inf).min(0, initial=np.inf))
        self.max = np.maximum(self.max, np.where(ok, x, -np.inf).max(0, initial=-np.inf))
        for d in range(self.dim):
            if n_b[d]:
                self._fit(d)
                v = x[ok[:, d], d]
                idx = np.floor(np.ldexp(v, -int(self.exp[d]))).astype(np.int64) - self.start[d]
                self._add_bins(d, idx, np.bincount(idx, minlength=self.num_bins), v, v)

    def _merge_moments(self, n_b: np.ndarray, mean_b: np.ndarray, m2_b: np.ndarray) -> None:
        n = self.n + n_b
        safe = np.maximum(n, 1)
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / safe)
        self.m2 = self.m2 + m2_b + delta**2 * (self.n * n_b / safe)
        self.n = n

    def _target(self, d: int) -> tuple[int, int]:
        """(exp, start) for dim ``d``: the smallest exponent whose grid fits [min, max] in ``num_bins`` bins.

        A pure function of (min, max), hence identical for any order or sharding of the same data. The exponent
        is also kept >= log2(max |x|) - 50 so that bin indices stay exactly representable.
        """
        lo, hi = float(self.min[d]), float(self.max[d])
        mag = max(abs(lo), abs(hi), 2.0**-1000)
        e = max(
            int(np.floor(np.log2(hi - lo) - np.log2(self.num_bins))) if hi > lo else -1074,
            int(np.ceil(np.log2(mag))) - 50,
        )
        while int(np.floor(np.ldexp(hi, -e))) - int(np.floor(np.ldexp(lo, -e))) >= self.num_bins:
            e += 1
        return e, int(np.floor(np.ldexp(lo, -e)))

    def _fit(self, d: int) -> None:
        """Move dim ``d``'s histogram onto the grid that fits the current [min, max] (exact bin merges)."""
        e, start = self._target(d)
        if e == self.exp[d] and start == self.start[d]:
            return
        counts, bmin, bmax = self.counts[d].copy(), self.bmin[d].copy(), self.bmax[d].copy()
        used = np.nonzero(counts)[0]
        self.counts[d], self.bmin[d], self.bmax[d] = 0, np.inf, -np.inf
        if len(used):
            # e only grows, so old bin i lands in bin i >> (e - old) of the new grid (floor division, exact)
            idx = ((used + self.start[d]) >> min(e - int(self.exp[d]), 63)) - start
            self.exp[d], self.start[d] = e, start
            self._add_bins(
                d,
                idx,
                np.bincount(idx, weights=counts[used], minlength=self.num_bins).astype(np.int64),
                bmin[used],
                bmax[used],
            )
        self.exp[d], self.start[d] = e, start

    def _add_bins(self, d: int, idx: np.ndarray, counts: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        if len(idx) and (idx.min() < 0 or idx.max() >= self.num_bins):  # a bug, never data: fail loudly
            raise AssertionError(f"histogram index out of range for dim {d}: [{idx.min()}, {idx.max()}]")
        self.counts[d] += counts[: self.num_bins]
        np.minimum.at(self.bmin[d], idx, lo)
        np.maximum.at(self.bmax[d], idx, hi)

    def merge(self, other: RunningStats) -> RunningStats:
        """Fold ``other`` (e.g. another shard or worker) into ``self``; equals one pass over both (returns self)."""
        if (other.dim, other.num_bins) != (self.dim, self.num_bins):
            raise ValueError(
                f"cannot merge RunningStats(dim={other.dim}, bins={other.num_bins}) into "
                f"RunningStats(dim={self.dim}, bins={self.num_bins})"
            )
        self.flush()
        other.flush()
        self.frames += other.frames
        self.nonfinite += other.nonfinite
        self._merge_moments(other.n, other.mean, other.m2)
        self.min, self.max = np.minimum(self.min, other.min), np.maximum(self.max, other.max)
        for d in range(self.dim):
            used = np.nonzero(other.counts[d])[0]
            if not len(used):
                continue
            self._fit(d)  # self's grid now fits the union, and is at least as coarse as other's
            idx = ((used + other.start[d]) >> min(int(self.exp[d]) - int(other.exp[d]), 63)) - self.start[d]
            cnt = np.bincount(idx, weights=other.counts[d, used], minlength=self.num_bins).astype(np.int64)
            self._add_bins(d, idx, cnt, other.bmin[d, used], other.bmax[d, used])
        return self

    # ---- results --------------------------------------------------------------------------------------------
    def quantile(self, q: float) -> np.ndarray:
        """Per-dim ``q``-quantile ``[D]`` (numpy's default 'linear' definition, approximated from the histogram)."""
        self.flush()
        out = np.full(self.dim, np.nan)
        for d in range(self.dim):
            n = int(self.n[d])
            if n == 0:
                continue
            cum = np.cumsum(self.counts[d])
            h = q * (n - 1)
            r0 = int(np.floor(h))
            v0, v1 = self._value_at_rank(d, cum, r0), self._value_at_rank(d, cum, min(r0 + 1, n - 1))
            out[d] = np.clip(v0 + (h - r0) * (v1 - v0), self.min[d], self.max[d])
        return out

    def _value_at_rank(self, d: int, cum: np.ndarray, r: int) -> float:
        """The ``r``-th smallest value (0-based), values assumed evenly spread between their bin's min and max."""
        j = int(np.searchsorted(cum, r, side="right"))
        c = int(self.counts[d, j])
        lo, hi = float(self.bmin[d, j]), float(self.bmax[d, j])
        return lo if c == 1 else lo + (r - (int(cum[j]) - c)) / (c - 1) * (hi - lo)

    def finalize(self) -> NormStats:
        """The ``NormStats`` summary (dims without any finite value get NaN stats, which validation reports)."""
        self.flush()
        has = self.n > 0
        nan = np.full(self.dim, np.nan)
        std = np.sqrt(np.divide(self.m2, self.n, out=nan.copy(), where=has))
        return NormStats(
            mean=np.where(has, self.mean, np.nan),
            std=std,
            min=np.where(has, self.min, np.nan),
            max=np.where(has, self.max, np.nan),
            q01=self.quantile(0.01),
            q99=self.quantile(0.99),
            count=self.frames,
            num_nonfinite=self.nonfinite,
        )
