"""A partial packing: bins of at most seq_len tokens plus a pool of unassigned items, and its moves.

This is the state the local search (search.py) works on, following Buljubasic and Vasquez's
consistent neighborhood search (2016): to go from B bins to B - 1, delete r bins (r = 3 when it
can) and put their items into the *pool*; the attempt succeeds once the pool fits into r - 1 bins.
Bins never overflow; only the pool shrinks or changes shape. Two moves:

* ``tabu_step``: the best swap of at most 2 items of one bin with 1 or 2 pool items that still fits,
  even when it makes the pool worse. The weights that just went into a bin may not leave any bin
  for the next ``TENURE`` to ``2 TENURE`` steps (tabu by weight, not by item, because real
  lengths repeat: without it the search swaps 844 for 845 forever). Scoring is vectorized: every
  "bin subset" (nothing, one item or two items of a bin) is a row of numpy arrays, sorted by
  objective; a running maximum of ``subset sum + bin free space`` gives, by binary search, the
  best subset that can make room for each pool subset.
* ``descent``: for each bin, the subset of (bin items + pool) that fills it best, solved exactly
  (subset_sum.py); a bin is re-solved only when the pool gained items since its last check.

The objective is the pool's ``sum(value(w))`` over its items, minimized: ``LINEAR`` (``value = M w -
1``: total tokens, ties broken towards more, smaller items) or ``SQUARED`` (``value = w**2``: strongly
prefers to hold many small items, which fit into the last gaps). Alternating the two per attempt
measured best on OpenChat V1 (squared alone stalls at 4,667 bins, linear alone gets stuck in some
seeds at 4,670).

Items larger than half a bin ("anchors") never move: at most one fits per bin, so fixing them loses
nothing and keeps the search away from pools that could never fit.

Cost per tabu step: a few numpy passes over E bin subsets (E ~ 5 per bin) plus a sort, about
0.2 ms for the 700 searched bins of OpenChat V1; a descent costs ~20 µs per bin it re-solves. All
in all about 3,300 steps per second there (2-core CPU).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from megapack.packing.bfd import best_fit_decreasing
from megapack.packing.subset_sum import best_subset, split_in_two

TENURE = 20
"""Steps a weight stays tabu after entering a bin: ``TENURE + randrange(TENURE)``."""
PAIR_LIMIT = 8
"""Bins with more movable items than this offer single items only (pairs would be quadratic)."""
POOL_PAIR_LIMIT = 40
"""Pools larger than this offer single items only."""
LINEAR, SQUARED = "linear", "squared"


class PartialPacking:
    """Bins within seq_len plus a pool of unassigned items (see the module docstring).

    Example: sizes ``[6, 3, 3, 4, 4]`` at seq_len 10, bins ``[[0, 1], [3]]`` (loads 9 and 4) and
    pool ``[2, 4]`` (a 3 and a 4), so ``fits(1)`` but not ``fits(0)``. The 6 is an anchor.
    ``descent(target=0)`` re-solves the bins in random order over their items plus the pool; when
    bin 0 comes first its movable room of 4 takes the 4 instead of its 3 (6 + 4 = 10), then bin 1
    takes 4 + 3 + 3 = 10 and the pool is empty: a perfect packing.
    """

    def __init__(
        self,
        weights: Sequence[int],
        weight_class: Sequence[int],
        seq_len: int,
        bins: list[list[int]],
        pool: list[int],
        *,
        objective: str,
        rng: random.Random,
    ) -> None:
        self.w = weights
        self.cls = weight_class
        self.c = seq_len
        self.rng = rng
        self.np_rng = np.random.default_rng(rng.getrandbits(64))
        self.steps = 0
        big = [[i for i in b if 2 * weights[i] > seq_len] for b in bins]
        self.anchors = big
        self.items = [[i for i in b if 2 * weights[i] <= seq_len] for b in bins]
        self.fixed = [sum(weights[i] for i in a) for a in big]
        self.load = np.array(
            [f + sum(weights[i] for i in it) for f, it in zip(self.fixed, self.items, strict=True)],
            dtype=np.int64,
        )
        self.pool = list(pool)
        n_items = len(weights)
        m = n_items + 1
        self.value = (
            [m * w - 1 for w in weights] if objective == LINEAR else [w * w for w in weights]
        )
        # Descent bookkeeping: stamp[i] increases whenever item i enters the pool; a bin checked at
        # stamp s needs no new check while every pool item has stamp <= s.
        self.clock = 0
        self.stamp = dict.fromkeys(pool, 0)
        self.checked = [-1] * len(bins)
        no_class = max(weight_class, default=0) + 1
        self.no_class = no_class
        self.tabu_until = np.full(no_class + 1, -1, dtype=np.int64)
        self._init_entries()

    # -- bin subsets -------------------------------------------------------------------------------
    _ARRAYS = ("e_bin", "e_sum", "e_val", "e_c1", "e_c2", "e_alive")

    def _init_entries(self) -> None:
        # One row per bin subset: owning bin, token sum, objective value, weight classes of its
        # (up to two) items, and whether the row is current; e_items holds the item ids.
        self.e_bin, self.e_sum, self.e_val, self.e_c1, self.e_c2 = (
            np.zeros(0, np.int64) for _ in range(5)
        )
        self.e_alive = np.zeros(0, bool)
        self.e_items: list[tuple[int, ...]] = []
        self.n_e = 0
        self.n_dead = 0
        self.bin_entries: list[list[int]] = [[] for _ in self.items]
        self._add_entries(range(len(self.items)))

    def _add_entries(self, ks: range | list[int]) -> None:
        """Append the subset rows (nothing, each item, each pair) of bins ``ks``."""
        w, value, cls, none = self.w, self.value, self.cls, self.no_class
        subsets: list[tuple[int, ...]] = []
        owner: list[int] = []
        for k in ks:
            its = self.items[k]
            first = len(subsets)
            subsets.append(())
            subsets.extend((i,) for i in its)
            if len(its) <= PAIR_LIMIT:
                subsets.extend((a, b) for x, a in enumerate(its) for b in its[x + 1 :])
            owner.extend([k] * (len(subsets) - first))
            self.bin_entries[k].extend(range(self.n_e + first, self.n_e + len(subsets)))
        j, count = self.n_e, len(subsets)
        if j + count > len(self.e_bin):
            grow = max(j + count, 2 * len(self.e_bin)) - len(self.e_bin)
            for name in self._ARRAYS:
                arr = getattr(self, name)
                setattr(self, name, np.concatenate((arr, np.zeros(grow, arr.dtype))))
            self.e_items.extend([()] * grow)
        end = j + count
        self.e_bin[j:end] = owner
        self.e_sum[j:end] = [sum(w[i] for i in sub) for sub in subsets]
        self.e_val[j:end] = [sum(value[i] for i in sub) for sub in subsets]
        self.e_c1[j:end] = [cls[sub[0]] if sub else none for sub in subsets]
        self.e_c2[j:end] = [cls[sub[1]] if len(sub) > 1 else none for sub in subsets]
        self.e_alive[j:end] = True
        self.e_items[j:end] = subsets
        self.n_e = end

    def _refresh(self, k: int) -> None:
        """Bin k changed: recompute its load and its subset rows."""
        self.e_alive[self.bin_entries[k]] = False
        self.n_dead += len(self.bin_entries[k])
        self.bin_entries[k] = []
        self.load[k] = self.fixed[k] + sum(self.w[i] for i in self.items[k])
        self.checked[k] = -1
        self._add_entries([k])
        if self.n_dead > max(4096, self.n_e // 2):
            self._compact()

    def _compact(self) -> None:
        """Drop dead rows (every few thousand changes), keeping the table O(live rows)."""
        keep = np.flatnonzero(self.e_alive[: self.n_e])
        for name in self._ARRAYS:
            arr = getattr(self, name)
            arr[: len(keep)] = arr[keep]
        self.e_items[: len(keep)] = [self.e_items[j] for j in keep.tolist()]
        self.e_alive[len(keep) :] = False
        self.n_e = len(keep)
        self.n_dead = 0
        self.bin_entries = [[] for _ in self.items]
        for j, k in enumerate(self.e_bin[: self.n_e].tolist()):
            self.bin_entries[k].append(j)

    # -- moves ---------------------------------------------------------------------------------------
    def _to_pool(self, i: int) -> None:
        self.pool.append(i)
        self.clock += 1
        self.stamp[i] = self.clock

    def tabu_step(self) -> bool:
        """Make the best non-tabu swap between one bin and the pool; False when none exists."""
        self.steps += 1
        it, n, pool, w = self.steps, self.n_e, self.pool, self.w
        tabu = self.tabu_until
        ok = self.e_alive[:n] & (tabu[self.e_c1[:n]] < it) & (tabu[self.e_c2[:n]] < it)
        idx = np.flatnonzero(ok)
        if len(idx) == 0 or not pool:
            return False
        val = self.e_val[idx]
        room = self.e_sum[idx] + (self.c - self.load[self.e_bin[idx]])  # largest sum that fits in
        order = np.lexsort((self.np_rng.random(len(idx)), val))
        idx, val, room = idx[order], val[order], room[order]
        best_room = np.maximum.accumulate(room)
        subs: list[tuple[int, ...]] = [(i,) for i in pool]
        if len(pool) <= POOL_PAIR_LIMIT:
            subs += [(a, b) for x, a in enumerate(pool) for b in pool[x + 1 :]]
        ys = np.array([sum(w[i] for i in s) for s in subs], dtype=np.int64)
        vs = np.array([sum(self.value[i] for i in s) for s in subs], dtype=np.int64)
        pos = np.searchsorted(best_room, ys, side="left")
        found = pos < len(idx)
        pos = np.minimum(pos, len(idx) - 1)
        score = val[pos] - vs
        for t in np.flatnonzero(found & (score == 0)).tolist():
            # Equal objective is (almost always) a swap of equal weights: take the next-best move.
            start = int(np.searchsorted(val, vs[t], side="right"))
            later = np.flatnonzero(room[start:] >= ys[t])
            if len(later):
                pos[t] = start + int(later[0])
                score[t] = val[pos[t]] - vs[t]
            else:
                found[t] = False
        cand = np.flatnonzero(found)
        if len(cand) == 0:
            return False
        pick = cand[np.lexsort((self.np_rng.random(len(cand)), score[cand]))[0]]
        entry = int(idx[pos[pick]])
        k = int(self.e_bin[entry])
        for i in self.e_items[entry]:
            self.items[k].remove(i)
            self._to_pool(i)
        for i in subs[pick]:
            self.pool.remove(i)
            self.items[k].append(i)
            tabu[self.cls[i]] = it + TENURE + self.rng.randrange(TENURE)
        self._refresh(k)
        return True

    def descent(self, target: int) -> bool:
        """Refill bins from the pool while some bin gets fuller; True once the pool fits target."""
        w, c = self.w, self.c
        improved = True
        while improved:
            improved = False
            order = list(range(len(self.items)))
            self.rng.shuffle(order)
            newest = max((self.stamp[i] for i in self.pool), default=-1)
            for k in order:
                if self.load[k] == c or self.checked[k] >= newest:
                    continue
                self.checked[k] = newest
                cand = sorted(self.items[k] + self.pool, key=lambda i: (-w[i], i))
                best, chosen = best_subset([w[i] for i in cand], c - self.fixed[k])
                if best + self.fixed[k] <= self.load[k]:
                    continue
                inside = set(chosen)
                was_in_bin = set(self.items[k])
                self.items[k] = [cand[j] for j in sorted(inside)]
                self.pool = []
                for j, i in enumerate(cand):
                    if j not in inside:
                        if i in was_in_bin:
                            self._to_pool(i)
                        else:
                            self.pool.append(i)
                self._refresh(k)
                newest = max((self.stamp[i] for i in self.pool), default=-1)
                improved = True
                if self.fits(target):
                    return True
        return False

    # -- ends ----------------------------------------------------------------------------------------
    def fits(self, target: int) -> bool:
        """Whether the pool fits into ``target`` (0, 1 or 2) new bins."""
        total = sum(self.w[i] for i in self.pool)
        if total > target * self.c:
            return False
        if target <= 1:
            return True
        return split_in_two([self.w[i] for i in self.pool], self.c) is not None

    def bins(self) -> list[list[int]]:
        """The packed bins (anchors first), empty ones left out, without the pool."""
        out = [a + it for a, it in zip(self.anchors, self.items, strict=True)]
        return [b for b in out if b]

    def solution(self, target: int) -> list[list[int]]:
        """All bins with the pool packed into ``target`` new bins (requires ``fits(target)``)."""
        pool = self.pool
        if not pool:
            return self.bins()
        first = split_in_two([self.w[i] for i in pool], self.c)
        if first is None:  # pragma: no cover - fits() was checked by the caller
            raise RuntimeError("pool does not fit into two bins")
        one = [pool[j] for j in sorted(first)]
        two = [i for j, i in enumerate(pool) if j not in set(first)]
        return self.bins() + [b for b in (one, two) if b]

    def repacked(self, limit: int) -> list[list[int]] | None:
        """All bins with the pool packed by BFD, or None when the pool needs more than limit bins."""
        sizes = np.array([self.w[i] for i in self.pool], dtype=np.int64)
        where = best_fit_decreasing(sizes, self.c)
        if len(where) and int(where.max()) + 1 > limit:
            return None
        extra: list[list[int]] = [[] for _ in range(int(where.max()) + 1 if len(where) else 0)]
        for i, b in zip(self.pool, where.tolist(), strict=True):
            extra[b].append(i)
        return self.bins() + extra
