"""Which rank of an expert-parallel group holds which experts.

Each rank of `colibri.torch.from_pretrained(path, expert_parallel=...)`
holds a share of every MoE layer's experts and computes the routed slots
that land on them; the slowest rank sets the pace of every all-reduce. By
default the shares are contiguous blocks of about E / N experts. When some
experts are routed to far more often than others (as real routers do), a
placement from a routing trace balances the routed slots instead:

    with colibri.routing.record_trace(model) as trace:
        model.generate(...)                      # representative prompts
    p = colibri.placement.balanced(trace, n_ranks=4)
    print(p.describe())                          # each rank's share of routed slots
    lm = colibri.torch.from_pretrained(path, expert_parallel=True, expert_placement=p)

`balanced` keeps every rank's expert count of the contiguous placement (the
same memory per rank) and, layer by layer, hands the experts out from the
most routed down, each to the least loaded rank with room left (longest
processing time first, ties to the lower expert id and then the lower
rank), so it is deterministic: every rank computes the same placement from
the same trace.
"""

import hashlib

import numpy as np

__all__ = ["ExpertPlacement", "contiguous", "balanced", "slot_counts"]


def slot_counts(trace):
    """Routed slots per (layer, expert) over a RoutingTrace: int64
    [n_layers, n_experts] (empty slots, -1, not counted)."""
    counts = np.zeros((trace.n_layers, trace.n_experts), dtype=np.int64)
    for layer, ids in trace.steps:
        flat = np.asarray(ids).reshape(-1)
        flat = flat[flat >= 0]
        if flat.size:
            counts[layer] += np.bincount(flat, minlength=trace.n_experts)
    return counts


class ExpertPlacement:
    """masks: bool [n_ranks, n_layers, n_experts], every expert of every
    layer on exactly one rank; counts: the routed slots per (layer, expert)
    it was measured against (int64 [n_layers, n_experts]), or None."""

    def __init__(self, masks, counts=None, kind="given"):
        masks = np.asarray(masks, dtype=bool)
        if masks.ndim != 3:
            raise ValueError("placement masks must be [n_ranks, n_layers, n_experts], got shape %s"
                             % (masks.shape,))
        held = masks.sum(axis=0)
        if (held != 1).any():
            layer, expert = np.argwhere(held != 1)[0]
            raise ValueError("placement: expert %d of layer %d is held by %d ranks (exactly one must hold it)"
                             % (expert, layer, held[layer, expert]))
        if counts is not None:
            counts = np.asarray(counts, dtype=np.int64)
            if counts.shape != masks.shape[1:]:
                raise ValueError("placement: counts of shape %s for masks of %s" % (counts.shape, masks.shape))
        self.masks, self.counts, self.kind = masks, counts, kind

    @property
    def n_ranks(self):
        return self.masks.shape[0]

    @property
    def n_layers(self):
        return self.masks.shape[1]

    @property
    def n_experts(self):
        return self.masks.shape[2]

    def mask(self, rank):
        """bool [n_layers, n_experts]: the local_experts of `rank`."""
        return self.masks[rank]

    def rank_slots(self, counts=None):
        """Routed slots each rank computes, int64 [n_ranks, n_layers], for
        `counts` (default: the placement's own)."""
        counts = self.counts if counts is None else np.asarray(counts, dtype=np.int64)
        if counts is None:
            raise ValueError("placement has no routing counts; pass counts=")
        return np.einsum("rle,le->rl", self.masks.astype(np.int64), counts)

    def shares(self, counts=None):
        """Each rank's fraction of all routed slots, float64 [n_ranks]."""
        per = self.rank_slots(counts).sum(axis=1).astype(np.float64)
        total = per.sum()
        return per / total if total > 0 else np.full(self.n_ranks, 1.0 / self.n_ranks)

    def imbalance(self, counts=None):
        """The busiest rank's slots over the mean, per layer then averaged
        (1.0 = perfectly even; what an all-reduce after every layer waits
        on)."""
        per = self.rank_slots(counts).astype(np.float64)
        mean = per.mean(axis=0)
        ok = mean > 0
        return float((per.max(axis=0)[ok] / mean[ok]).mean()) if ok.any() else 1.0

    def digest(self):
        """16 hex digits identifying the masks (ranks compare it at open)."""
        return hashlib.sha256(np.packbits(self.masks).tobytes() + str(self.masks.shape).encode()).hexdigest()[:16]

    def describe(self, counts=None):
        """'balanced over 2 ranks: routed slots 50.1% / 49.9%, busiest rank
        1.01x the mean a layer'."""
        shares = " / ".join("%.1f%%" % (100 * s) for s in self.shares(counts))
        return "%s over %d ranks: routed slots %s, busiest rank %.2fx the mean a layer" % (
            self.kind, self.n_ranks, shares, self.imbalance(counts))


def _check_ranks(n_ranks, n_experts):
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, (int, np.integer)) or n_ranks < 1:
        raise ValueError("n_ranks must be an int >= 1, got %r" % (n_ranks,))
    if n_ranks > n_experts:
        raise ValueError("%d ranks for %d experts (at most one rank per expert)" % (n_ranks, n_experts))


def _quota(n_experts, n_ranks):
    """Experts per rank in the contiguous placement: rank r holds
    [r E / N, (r + 1) E / N)."""
    return np.array([(r + 1) * n_experts // n_ranks - r * n_experts // n_ranks for r in range(n_ranks)])


def contiguous(n_layers, n_experts, n_ranks, counts=None):
    """Rank r holds experts [r E / N, (r + 1) E / N) of every layer (the
    default of expert_parallel)."""
    _check_ranks(n_ranks, n_experts)
    masks = np.zeros((n_ranks, n_layers, n_experts), dtype=bool)
    for r in range(n_ranks):
        masks[r, :, r * n_experts // n_ranks:(r + 1) * n_experts // n_ranks] = True
    return ExpertPlacement(masks, counts, "contiguous")


def balanced(trace, n_ranks):
    """A placement balancing a RoutingTrace's routed slots over `n_ranks`
    ranks, layer by layer, each rank holding as many experts as in the
    contiguous placement (see the module's docstring)."""
    _check_ranks(n_ranks, trace.n_experts)
    counts = slot_counts(trace)
    quota = _quota(trace.n_experts, n_ranks)
    masks = np.zeros((n_ranks, trace.n_layers, trace.n_experts), dtype=bool)
    for layer in range(trace.n_layers):
        load = np.zeros(n_ranks, dtype=np.int64)
        room = quota.copy()
        # Most routed first; equal counts by expert id (a stable sort of -count).
        for expert in np.argsort(-counts[layer], kind="stable"):
            open_ranks = np.flatnonzero(room > 0)
            r = open_ranks[np.argmin(load[open_ranks])]  # argmin: the lowest rank among equals
            masks[r, layer, expert] = True
            load[r] += counts[layer, expert]
            room[r] -= 1
    return ExpertPlacement(masks, counts, "balanced")
