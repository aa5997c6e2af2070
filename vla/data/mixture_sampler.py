"""``MixtureSampler``: a deterministic, resumable, rank-sharded stream of ``(dataset_index, sample_index)``.

* dataset choice: probabilities from ``mixture_weights`` (``weight`` or ``weight x size``), drawn in *name order*
  from a stream seeded by ``sha256(seed, rank, block)``, so reordering a mixture's YAML changes nothing;
* each dataset's own sample stream is a pseudo-random permutation per pass over it, keyed by
  ``sha256(seed, dataset name, pass)`` (never Python's ``hash()``): adding or reweighting *another* dataset
  never changes which samples this one yields, only how often it is picked;
* rank sharding: rank ``r`` of ``W`` takes positions ``r, r + W, r + 2W, ...`` of every dataset's stream, so
  ranks never share a sample within a pass;
* the permutation is a keyed Feistel network (O(1) memory, random access), so a 100M-frame dataset costs no
  index array, and ``state_dict()`` is just counters: a restored sampler yields exactly the continuation.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

SAMPLER_STATE_VERSION = 1
_CHOICE_BLOCK = 4096  # dataset choices are drawn in blocks seeded by block number (random access for resume)


class MixtureError(ValueError):
    """A mixture file is malformed or its datasets cannot be found; the message names the file/dataset and fix."""


def mixture_weights(
    weights: Sequence[float],
    sizes: Sequence[int] | None = None,
    *,
    balance_by_size: bool = False,
    names: Sequence[str] | None = None,
) -> np.ndarray:
    """Normalized probabilities ``[N]``: ``weight`` or, balanced, ``weight x size`` (Octo/OpenVLA), summing to 1."""
    w = np.asarray(weights, dtype=np.float64)
    names = list(names) if names is not None else [str(i) for i in range(len(w))]
    if balance_by_size:
        if sizes is None:
            raise MixtureError("balance_by_size needs the number of frames of every dataset (sizes)")
        w = w * np.asarray(sizes, dtype=np.float64)
    if len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise MixtureError(
            f"mixture weights must be finite, >= 0 and not all 0; got {dict(zip(names, w.tolist()))}"
        )
    return w / math.fsum(w)  # fsum: exactly rounded, so the result does not depend on the list order


def _stable_int(*parts: object) -> int:
    """A 64-bit integer from ``parts``, stable across processes and Python versions (sha256, not hash())."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little")


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN_INT = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive integers
_GOLDEN = np.uint64(_GOLDEN_INT)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fast bijective scrambler of uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def permute(i: np.ndarray, n: int, key: int | np.ndarray, rounds: int = 6) -> np.ndarray:
    """``perm_key(i)`` for pseudo-random permutations ``perm_key`` of ``[0, n)``; ``i`` int ``[M]``, ``key`` a
    64-bit int or a uint64 array ``[M]`` (one permutation per element, e.g. one per pass over a dataset).

    A balanced Feistel network on the smallest even-bit domain >= n, with cycle walking back into [0, n)
    (walking a permutation of the bigger domain until it lands inside keeps it a bijection).
    """
    if n <= 1:
        return np.zeros(np.shape(i), dtype=np.int64)
    half = (max(2, (n - 1).bit_length()) + 1) // 2
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    key = np.broadcast_to(np.asarray(key, dtype=np.uint64), np.shape(i))
    keys = [_mix64(key + np.uint64((r + 1) * _GOLDEN_INT % 2**64)) for r in range(rounds)]  # [rounds][M]

    def feistel(x: np.ndarray, sel: np.ndarray | slice) -> np.ndarray:
        left, right = x >> shift, x & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k[sel]) & mask)
        return (left << shift) | right

    x = feistel(np.asarray(i, dtype=np.uint64), slice(None))
    out = np.flatnonzero(x >= n)
    while len(out):
        x[out] = feistel(x[out], out)
        out = out[x[out] >= n]
    return x.astype(np.int64)


class MixtureSampler:
    """Infinite (or ``num_samples``-per-epoch) deterministic stream of ``(dataset_index, sample_index)``.

    ``names[i]``, ``probs[i]`` (normalized by ``mixture_weights``) and ``sizes[i]`` (samples in dataset ``i``)
    describe the datasets; ``sample_index`` is in ``[0, sizes[i])``. See the module docstring for the guarantees.
    """

    def __init__(
        self,
        names: Sequence[str],
        probs: Sequence[float],
        sizes: Sequence[int],
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        num_samples: int | None = None,
    ) -> None:
        if not (len(names) == len(probs) == len(sizes)) or not names:
            raise MixtureError(
                f"names, probs and sizes must be non-empty and of equal length, got "
                f"{len(names)}, {len(probs)}, {len(sizes)}"
            )
        if len(set(names)) != len(names):
            raise MixtureError(f"dataset names must be unique, got {list(names)}")
        if not 0 <= rank < world_size:
            raise MixtureError(f"rank must be in [0, world_size={world_size}), got {rank}")
        for n, s in zip(names, sizes):
            if int(s) <= 0:
                raise MixtureError(
                    f"dataset {n!r} has {s} samples; drop it from the mixture or fix its key map"
                )
        self.names, self.sizes = list(names), np.asarray(sizes, dtype=np.int64)
        self.probs = mixture_weights(probs, names=names)
        self.seed, self.rank, self.world_size, self.num_samples = (
            int(seed),
            int(rank),
            int(world_size),
            num_samples,
        )
        self._order = sorted(range(len(names)), key=lambda i: self.names[i])  # choice order = name order
        self._cdf = np.cumsum(self.probs[self._order])
        self._cdf[-1] = 1.0
        self.step = 0  # pairs yielded by this rank
        self.counters = np.zeros(len(names), dtype=np.int64)  # draws from each dataset by this rank
        self._buf: np.ndarray = np.zeros((0, 2), dtype=np.int64)

    def _choices(self, start: int, n: int) -> np.ndarray:
        """Dataset indices for steps ``[start, start + n)``: a pure function of (seed, rank, step)."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        out, b0 = [], start // _CHOICE_BLOCK
        for b in range(b0, (start + n - 1) // _CHOICE_BLOCK + 1):
            g = np.random.Generator(
                np.random.PCG64(_stable_int("vla-mixture-choice", self.seed, self.rank, b))
            )
            out.append(g.random(_CHOICE_BLOCK))
        u = np.concatenate(out)[start - b0 * _CHOICE_BLOCK :][:n]
        return np.asarray(self._order)[
            np.minimum(np.searchsorted(self._cdf, u, side="right"), len(self._cdf) - 1)
        ]

    def _samples(self, d: int, draws: np.ndarray) -> np.ndarray:
        """Sample indices of this rank's ``draws``-th picks of dataset ``d`` (its name-keyed permutation stream)."""
        pos = draws * self.world_size + self.rank
        n = int(self.sizes[d])
        passes, within = np.divmod(pos, n)
        base = np.uint64(_stable_int("vla-mixture-perm", self.seed, self.names[d]))
        return permute(within, n, _mix64(base ^ _mix64(passes.astype(np.uint64) * _GOLDEN)))

    def peek(self, n: int) -> np.ndarray:
        """The next ``n`` pairs int64 ``[n, 2]`` without advancing."""
        ds = self._choices(self.step, n)
        out = np.empty((n, 2), dtype=np.int64)
        out[:, 0] = ds
        for d in np.unique(ds):
            sel = ds == d
            out[sel, 1] = self._samples(int(d), self.counters[d] + np.arange(int(sel.sum())))
        return out

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` pairs int64 ``[n, 2]`` (advances the state)."""
        out = self.peek(n)
        self.step += n
        self.counters += np.bincount(out[:, 0], minlength=len(self.names))
        self._buf = self._buf[:0]
        return out

    def __next__(self) -> tuple[int, int]:
        if not len(self._buf):
            self._buf = self.peek(1024)
        d, s = (int(v) for v in self._buf[0])
        self._buf = self._buf[1:]
        self.step += 1
        self.counters[d] += 1
        return d, s

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """Infinite stream; with ``num_samples``, the rest of the current epoch (the next ``iter`` continues)."""
        if self.num_samples is None:
            while True:
                yield next(self)
        for _ in range(self.num_samples - self.step % self.num_samples):
            yield next(self)

    def __len__(self) -> int:
        if self.num_samples is None:
            raise TypeError(
                "an infinite MixtureSampler has no len(); pass num_samples for epoch-sized iteration"
            )
        return self.num_samples

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": SAMPLER_STATE_VERSION,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "step": self.step,
            "counters": {n: int(c) for n, c in zip(self.names, self.counters)},
            "probs": {n: float(p) for n, p in zip(self.names, self.probs)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; a different seed/rank/world size is an error, changed datasets or weights a warning."""
        for k in ("seed", "rank", "world_size"):
            if state[k] != getattr(self, k):
                raise MixtureError(
                    f"mixture sampler state has {k}={state[k]}, this sampler {getattr(self, k)}; "
                    "resume with the same setting (or start a new run)"
                )
        probs = {n: float(p) for n, p in zip(self.names, self.probs)}
        if state.get("probs") != probs:
            log.warning(
                "mixture changed since the checkpoint (datasets or weights); per-dataset positions are "
                "kept by name, new datasets start at 0"
            )
        self.step = int(state["step"])
        self.counters = np.array([int(state["counters"].get(n, 0)) for n in self.names], dtype=np.int64)
        self._buf = self._buf[:0]
