"""Which drafts the target accepts, and the token that follows them.

Greedy: a draft is accepted while it equals the target's argmax at its position; the first
disagreement (or the position after the last draft) gives the target's own token, so the output
is exactly the non-speculative greedy output.

Sampled (temperature > 0): the standard speculative-sampling rule (Leviathan et al., Chen et al.):
accept draft d drawn from q with probability min(1, p(d) / q(d)); on the first rejection draw from
norm(max(0, p - q)); with every draft accepted draw a bonus token from the last position's p. Each
emitted token is then distributed exactly as the target's p, whatever q is.
"""

from __future__ import annotations

import torch


def accept_greedy(best: list[int], drafts: list[int]) -> list[int]:
    """best: the target's argmax at the last token and at each draft (k + 1 of them); returns
    accepted drafts + 1 token."""
    out = []
    for j, d in enumerate(drafts):
        if best[j] != d:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def accept_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: list[int]) -> list[int]:
    """target_probs [k+1, V], draft_probs [k, V] (what each draft was drawn from); returns
    accepted drafts + 1 token, drawn with the global torch generator."""
    out = []
    for j, d in enumerate(drafts):
        p, q = target_probs[j], draft_probs[j]
        if torch.rand(()).item() * q[d].item() <= p[d].item():
            out.append(d)
            continue
        residual = (p - q).clamp_(min=0.0)
        total = residual.sum()
        dist = residual / total if total.item() > 0 else p  # p == q: never a rejection, kept for safety
        out.append(int(torch.multinomial(dist, 1).item()))
        return out
    out.append(int(torch.multinomial(target_probs[len(drafts)], 1).item()))
    return out
