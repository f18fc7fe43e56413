"""Packing algorithms: best-fit-decreasing under two budgets, rank balancing, the online buffer packer.

An item is (key, tokens, image_tokens). A pack holds items whose token sum is <= seq_length and
whose visual-token sum is <= max_image_tokens (the second budget bounds ViT work per row, the
MindVL paper's control of visual tokens per pack).

- `pack_bfd`: best-fit decreasing. Items sorted by their dominant share of a pack,
  max(tokens / seq_length, image_tokens / max_image_tokens), descending (sorting by tokens alone
  leaves image-heavy samples stranded one per pack when the visual budget binds); each goes into
  the open pack with the least remaining token room that still fits both budgets, else a new pack.
  When the visual budget is below seq_length a second pass fits on visual room instead and the
  pass with fewer packs is kept. Remaining room is an integer, so open packs sit in buckets by it;
  buckets and blocks of 64 buckets carry their largest visual room, so the exact best-fit search
  costs O(seq_length / 64 + 64) per item instead of O(#packs).
- `pack_first_fit`: greedy first-fit in input order (the bench's baseline).
- `assign_ranks`: every rank gets the same number of packs (ranks must step together); if the
  count does not divide, the fullest multi-sample packs are split. Packs are ordered by visual
  tokens and cut into global steps of dp_size packs, so the packs running side by side in one
  step carry similar ViT work (openPangu-VL's Balanced Encoder DP); inside a step the largest
  pack goes to the rank with the fewest tokens so far, and a refinement pass swaps packs of one
  step between the most and least loaded ranks while that narrows the per-rank token range.
- `OnlinePacker`: for streams. Items collect in a buffer; when it holds `buffer_size` items they
  are packed with BFD, every pack but the emptiest is emitted, and the emptiest pack's items stay
  for the next round (they keep their order). `flush()` emits the rest at the end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np



@dataclass
class Item:
    key: Any            # identifies the sample (line number, or any payload handle)
    tokens: int
    image_tokens: int = 0


@dataclass
class Pack:
    items: List[Item] = field(default_factory=list)
    tokens: int = 0
    image_tokens: int = 0

    def add(self, it: Item) -> None:
        self.items.append(it)
        self.tokens += it.tokens
        self.image_tokens += it.image_tokens


def split_oversized(items: Iterable[Item], seq_length: int, max_image_tokens: int) -> Tuple[List[Item], List[Tuple[Item, str]]]:
    """Items that fit an empty pack, and (item, reason) for those that never can."""
    ok, bad = [], []
    for it in items:
        if it.tokens > seq_length:
            bad.append((it, f"longer than seq_length ({it.tokens} > {seq_length} tokens)"))
        elif it.image_tokens > max_image_tokens:
            bad.append((it, f"more visual tokens than max_image_tokens ({it.image_tokens} > {max_image_tokens})"))
        else:
            ok.append(it)
    return ok, bad


class _Buckets:
    """Open packs bucketed by remaining token room. Each bucket also knows the largest remaining visual
    room of its packs, and each block of 64 buckets the largest of those, so buckets (and whole
    blocks) where no pack has enough visual room are skipped in O(1)."""

    def __init__(self, size: int):
        self.pids: List[List[int]] = [[] for _ in range(size + 1)]
        self.vroom: List[List[int]] = [[] for _ in range(size + 1)]  # visual room, parallel to pids
        self.vmax = [-1] * (size + 1)
        self.bmax = [-1] * (size // 64 + 1)

    def add(self, room: int, pid: int, vroom: int) -> None:
        self.pids[room].append(pid)
        self.vroom[room].append(vroom)
        if vroom > self.vmax[room]:
            self.vmax[room] = vroom
            b = room >> 6
            self.bmax[b] = max(self.bmax[b], vroom)

    def pop(self, room: int, idx: int) -> int:
        pids, vr = self.pids[room], self.vroom[room]
        pid, gone = pids[idx], vr[idx]
        pids[idx], vr[idx] = pids[-1], vr[-1]
        pids.pop()
        vr.pop()
        if gone == self.vmax[room]:
            self.vmax[room] = max(vr) if vr else -1
            b = room >> 6
            self.bmax[b] = max(self.vmax[b << 6:(b + 1) << 6])
        return pid

    def find(self, tokens: int, vis: int) -> Optional[Tuple[int, int]]:
        """(room, index) of a pack with the least token room >= tokens and visual room >= vis."""
        vmax, bmax = self.vmax, self.bmax
        for b in range(tokens >> 6, len(bmax)):
            if bmax[b] < vis:
                continue
            for room in range(max(tokens, b << 6), min((b + 1) << 6, len(vmax))):
                if vmax[room] >= vis:
                    vr = self.vroom[room]
                    if vis == 0:
                        return room, len(vr) - 1
                    return room, next(i for i, x in enumerate(vr) if x >= vis)
        return None


def _bfd(items: Sequence[Item], seq_length: int, max_image_tokens: int, by_visual: bool) -> List[Pack]:
    """One BFD pass; buckets keyed by token room, or by visual room when `by_visual`."""
    cap_a, cap_b = (max_image_tokens, seq_length) if by_visual else (seq_length, max_image_tokens)
    size = (lambda it: (it.image_tokens, it.tokens)) if by_visual else (lambda it: (it.tokens, it.image_tokens))
    packs: List[Pack] = []
    buckets = _Buckets(cap_a)
    order = sorted(range(len(items)), key=lambda i: (-max(items[i].tokens / seq_length,
                                                          items[i].image_tokens / max(max_image_tokens, 1)),
                                                     -items[i].tokens, i))
    for i in order:
        it = items[i]
        if it.tokens > seq_length or it.image_tokens > max_image_tokens:
            raise ValueError(f"item {it.key!r} does not fit an empty pack; filter with split_oversized first")
        found = buckets.find(*size(it))
        if found is None:
            pid = len(packs)
            packs.append(Pack())
        else:
            pid = buckets.pop(*found)
        p = packs[pid]
        p.add(it)
        used_a, used_b = size(Item(None, p.tokens, p.image_tokens))
        buckets.add(cap_a - used_a, pid, cap_b - used_b)
    return packs


def pack_bfd(items: Sequence[Item], seq_length: int, max_image_tokens: int) -> List[Pack]:
    """Best-fit decreasing under a token and a visual-token budget (items must each fit alone).
    Best fit is measured on token room and, in a second pass, on visual room (the binding budget
    when images dominate); the pass with fewer packs wins (ties: token room)."""
    by_tokens = _bfd(items, seq_length, max_image_tokens, by_visual=False)
    if max_image_tokens >= seq_length or not any(it.image_tokens for it in items):
        return by_tokens  # the visual budget can never bind first
    by_visual = _bfd(items, seq_length, max_image_tokens, by_visual=True)
    return by_visual if len(by_visual) < len(by_tokens) else by_tokens


def pack_first_fit(items: Sequence[Item], seq_length: int, max_image_tokens: int) -> List[Pack]:
    """Greedy first-fit in arrival order: each item into the first open pack where it fits."""
    packs: List[Pack] = []
    for it in items:
        for p in packs:
            if p.tokens + it.tokens <= seq_length and p.image_tokens + it.image_tokens <= max_image_tokens:
                p.add(it)
                break
        else:
            packs.append(Pack())
            packs[-1].add(it)
    return packs


def _split_to_multiple(packs: List[Pack], multiple: int) -> List[Pack]:
    """Split the fullest multi-item packs until len(packs) is a multiple of `multiple`."""
    need = (-len(packs)) % multiple
    packs = list(packs)
    while need:
        cand = [i for i, p in enumerate(packs) if len(p.items) > 1]
        if not cand:
            raise ValueError(f"{len(packs)} packs cannot be shared evenly by {multiple} ranks and no pack has two "
                             f"samples to split: add data or lower dp_size")
        i = max(cand, key=lambda k: (packs[k].tokens, -k))
        p = packs.pop(i)
        a, b = Pack(), Pack()
        for it in sorted(p.items, key=lambda x: -x.tokens):
            (a if a.tokens <= b.tokens else b).add(it)
        packs += [a, b]
        need -= 1
    return packs


def assign_ranks(packs: List[Pack], dp_size: int) -> Tuple[List[List[Pack]], Dict[str, Any]]:
    """Equal pack counts per rank, step-wise ViT balance, greedy token balance. Returns per-rank pack
    lists (in step order) and balance statistics for the manifest."""
    if not packs:
        return [[] for _ in range(dp_size)], {"rank_tokens": [0] * dp_size}
    packs = _split_to_multiple(packs, dp_size)
    order = sorted(packs, key=lambda p: (-p.image_tokens, -p.tokens))
    ranks: List[List[Pack]] = [[] for _ in range(dp_size)]
    load = np.zeros(dp_size, dtype=np.int64)
    step_ratio = []
    for s in range(0, len(order), dp_size):
        step = sorted(order[s:s + dp_size], key=lambda p: -p.tokens)
        for p, r in zip(step, np.argsort(load, kind="stable")):
            ranks[r].append(p)
            load[r] += p.tokens
        img = np.array([p.image_tokens for p in step], dtype=np.float64)
        if img.max() > 0:
            step_ratio.append(img.max() / max(img.min(), 1.0))
    _refine(ranks, load)
    stats = {"rank_tokens": [int(x) for x in load],
             "rank_packs": [len(r) for r in ranks],
             "rank_image_tokens": [int(sum(p.image_tokens for p in r)) for r in ranks],
             "rank_token_ratio": float(load.max() / max(load.min(), 1)),
             "vit_step_max_min_ratio_mean": float(np.mean(step_ratio)) if step_ratio else 1.0}
    return ranks, stats


def _refine(ranks: List[List[Pack]], load: np.ndarray, rounds: int = 1000) -> None:
    """Swap the packs of the most and least loaded ranks within one step (step make-up, hence ViT
    balance, is unchanged) while that narrows the token range; picks the swap closest to half the gap."""
    tok = np.array([[p.tokens for p in r] for r in ranks], dtype=np.int64)  # [dp, steps]
    for _ in range(rounds):
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = load[hi] - load[lo]
        d = tok[hi] - tok[lo]  # moving hi's step-s pack to lo (and back) shifts d tokens
        ok = (d > 0) & (d < gap)
        if gap <= 0 or not ok.any():
            return
        s = int(np.argmin(np.where(ok, np.abs(gap - 2 * d), np.iinfo(np.int64).max)))
        ranks[hi][s], ranks[lo][s] = ranks[lo][s], ranks[hi][s]
        tok[hi, s], tok[lo, s] = tok[lo, s], tok[hi, s]
        load[hi] -= d[s]
        load[lo] += d[s]


class OnlinePacker:
    """Buffer-based packer for streams (see module doc). push() returns the packs ready to emit."""

    def __init__(self, seq_length: int, max_image_tokens: int, buffer_size: int = 256):
        self.seq_length, self.max_image_tokens, self.buffer_size = seq_length, max_image_tokens, buffer_size
        self.buffer: List[Item] = []
        self.dropped: List[Tuple[Item, str]] = []

    def push(self, item: Item) -> List[Pack]:
        ok, bad = split_oversized([item], self.seq_length, self.max_image_tokens)
        self.dropped += bad
        self.buffer += ok
        if len(self.buffer) < self.buffer_size:
            return []
        packs = pack_bfd(self.buffer, self.seq_length, self.max_image_tokens)
        keep = min(range(len(packs)), key=lambda i: (packs[i].tokens, i))
        keys = {id(it) for it in packs[keep].items}
        self.buffer = [it for it in self.buffer if id(it) in keys]
        return [p for i, p in enumerate(packs) if i != keep]

    def flush(self) -> List[Pack]:
        packs = pack_bfd(self.buffer, self.seq_length, self.max_image_tokens) if self.buffer else []
        self.buffer = []
        return packs

    def pack_stream(self, items: Iterable[Item]) -> Iterator[Pack]:
        for it in items:
            yield from self.push(it)
        yield from self.flush()


def efficiency(packs: Sequence[Pack], seq_length: int) -> float:
    """Real tokens / (packs x seq_length)."""
    return float(sum(p.tokens for p in packs)) / max(1, len(packs) * seq_length)
