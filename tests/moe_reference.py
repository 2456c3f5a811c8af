"""A router's decisions written token by token, the reference the MoE tests
hold jaxtp.model.routing and the per-layer loads to: scores, each token's
experts and weights, the capacity queue."""

import numpy as np


def scores(logits, routing, xp=np):
    """Each token's scores [.., E]: softmax over the experts, or each one's sigmoid."""
    if routing.score == "sigmoid":
        return 1 / (1 + xp.exp(-logits))
    p = xp.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def choose(s, routing):
    """One token's k experts, in descending score (ties: the lower id), from
    its best routing.group_top_k groups (a group's score: the sum of its best
    k // group_top_k), and their weights."""
    E, n = s.size, routing.groups
    allowed = np.ones(E, bool)
    if routing.group_top_k and routing.group_top_k < n:
        per = s.reshape(n, E // n)
        m = max(1, routing.k // routing.group_top_k)
        gscore = np.sort(per, -1)[:, ::-1][:, :m].sum(-1)
        best = np.argsort(-gscore, kind="stable")[:routing.group_top_k]
        allowed = np.isin(np.arange(E) // (E // n), best)
    ex = [e for e in np.argsort(-s, kind="stable") if allowed[e]][:routing.k]
    w = s[ex] / s[ex].sum() if routing.norm_topk else s[ex]
    return np.array(ex), w * routing.scale


def queue(logits, routing, C):
    """Per group: (experts [T, k], weights [T, k], kept [T, k]) by a plain
    loop: first choices of every token in token order, then second ...; or
    under drop "probs" each expert's C assignments of the largest weight
    (ties in that order)."""
    out = []
    for g in range(logits.shape[0]):
        s = scores(logits[g], routing)
        picks = [choose(row, routing) for row in s]
        ex, w = np.stack([p[0] for p in picks]), np.stack([p[1] for p in picks])
        k, T = routing.k, logits.shape[1]
        order = [(t, j) for j in range(k) for t in range(T)]
        if routing.drop == "probs":
            order = sorted(order, key=lambda tj: -w[tj])  # (stable: router order on ties)
        taken, kept = np.zeros(logits.shape[-1], int), np.zeros((T, k), bool)
        for t, j in order:
            if taken[ex[t, j]] < C:
                kept[t, j] = True
                taken[ex[t, j]] += 1
        out.append((ex, w, kept))
    return out
