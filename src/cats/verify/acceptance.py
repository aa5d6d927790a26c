"""Acceptance rules: given a proposal and the target's logits for ``[x, its nodes]``, which drafted tokens to keep
and which token comes next (a `Verdict`). Split as in vLLM: the drafter proposes, the scorer runs the target,
a rule decides.

* `GreedyAcceptance` (temperature 0): keep drafted tokens equal to the target's argmax; output = plain greedy.
* `SpeculativeSampling` (temperature > 0): the output is distributed *exactly* as plain sampling from the target's
  warped distribution p (`cats.sampling.warp`), for chains, trees and deterministic drafts alike.
* `TypicalAcceptance` (opt-in, lossy): Medusa's posterior threshold; outputs drift from the target's distribution.

Speculative sampling, the rule. At the node the walk is at (x first), with p the target's warped distribution there:

1. candidates drawn from q (`cats.draft.Draw`, in the order drawn; q_1 = q, q_{j+1} = q_j without c_j,
   renormalised): accept c_j with probability min(1, p(c_j) / q_j(c_j)); on rejection p <- norm(max(p - q_j, 0));
   an accepted verified node: the walk moves there; an unverified one (`Draw.nodes` None) is the step's last token;
2. none accepted: the target samples y from p (`Sampler.token_at`, Gumbel-max with noise fixed by the seed and
   y's position). If a verified child carries y (a deterministic candidate: prompt lookup, the cascade's
   corrections; or a drawn node rejected above) the walk moves there, else y is the step's last token.

Step 2 is the one-hot rule for deterministic candidates (q = e_c accepts c with probability p(c) and otherwise
samples p without c: together, a sample of p), made with position-keyed noise: a method whose drafts are all
deterministic emits exactly plain sampling's tokens for the same seed, whatever it drafted.

For a chain this is standard speculative sampling (Leviathan et al.; Chen et al.); for sibling candidates it is
recursive rejection sampling (SpecInfer's multi-step speculative sampling, with draws without replacement as in
Jeon et al.'s Recursive Speculative Decoding, and EAGLE's one-hot treatment of deterministic candidates).

Why it is lossless. One test with candidate c ~ q_j and the residual update emit y with probability
min(p, q_j)(y) + (1 - sum min(p, q_j)) * max(p - q_j, 0)(y) / sum max(p - q_j, 0) = p(y), and step 2 samples the
final residual. By induction over a node's drawn candidates, the token emitted there is distributed as p given
everything before, provided that (a) each drawn candidate is drawn from q_j given the earlier ones, (b) how many
candidates are drawn never depends on their own values (it may depend on the committed tokens, the path and other
branches), (c) whether the walk may continue below the emitted token (a verified child carries it) does not depend
on the draws below that child, and (d) the noise of the target's sample at a position serves that position only and
no drafter sees it. Deterministic children need nothing more: they only decide where the walk continues. Drafters
and the cascade keep (a)-(d): the tree drafter verifies exactly the nodes it expands, chosen before their children
are drawn, and keeps every drawn candidate in its draw; the cascade turns a pruned drawn node into an unverified
candidate instead of removing it (removing it would break (b): the candidate's presence would depend on its own
value), and its corrections and redrafts are deterministic children.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cats.draft.base import Proposal
from cats.errors import InvalidArgumentError
from cats.sampling import Sampler, exclude, greedy_tokens
from cats.tree import greedy_path

ACCEPTANCE_MODES = ("exact", "typical")
TYPICAL_TAU, TYPICAL_ALPHA = 0.09, 0.3  # Medusa's defaults (posterior_threshold, posterior_alpha)
TYPICAL_NEEDS_DRAFTS = ("typical acceptance decides about drafted tokens, and plain decoding (method ar) drafts none: "
                        "choose a speculative method or drop --acceptance typical")


@dataclass
class Verdict:
    """What the target decided about one proposal."""

    accepted: list[int]  # indices of the drafted nodes kept, root to leaf (a chain: 0..n-1)
    next_token: int  # the token after them: the target's own (a correction, or the bonus token if all were kept),
    # or an unverified drafted candidate the target accepted (`next_drafted`)
    next_drafted: bool = False

    @property
    def num_accepted(self) -> int:
        """Drafted tokens accepted: the kept nodes, plus the next token when it was a drafted candidate."""
        return len(self.accepted) + self.next_drafted


class GreedyAcceptance:
    """Keep the longest drafted prefix equal to the target's argmax, then the target's argmax after it.

    Worked example: drafts [5, 7, 9], target argmax per row [5, 7, 2, 4] -> accept 2 (5, 7), next token 2.
    Trees: the longest root-to-node path whose tokens equal the target's argmax at their parents (`greedy_path`).
    The output is exactly what plain greedy decoding produces."""

    name = "greedy"
    label = "exact"  # what stats and reports say about the output: the target's own
    lossless = True
    draws_drafts = False  # drafters choose their tokens deterministically

    def accept(self, proposal: Proposal, target_logits: torch.Tensor, sampler: Sampler | None = None) -> Verdict:
        predicted = greedy_tokens(target_logits)  # [k+1]
        if proposal.is_tree:
            path = greedy_path(proposal.tokens, proposal.parents, predicted)
            return Verdict(accepted=path, next_token=int(predicted[path[-1] + 1 if path else 0]))
        k = proposal.num_tokens
        matches = (predicted[:k] == proposal.tokens).to(torch.long)
        num_accepted = int(matches.cumprod(0).sum()) if k else 0
        return Verdict(accepted=list(range(num_accepted)), next_token=int(predicted[num_accepted]))


def _parents(proposal: Proposal) -> list[int]:
    count = proposal.num_tokens
    return proposal.parents.tolist() if proposal.parents is not None else list(range(-1, count - 1))


class SpeculativeSampling:
    """Lossless acceptance for sampling: chains and trees, drawn and deterministic drafts (see the module
    docstring). Drafters draw their tokens from q (``draws_drafts``)."""

    name = "speculative-sampling"
    label = "exact"
    lossless = True
    draws_drafts = True

    def accept(self, proposal: Proposal, target_logits: torch.Tensor, sampler: Sampler) -> Verdict:
        parents, tokens = _parents(proposal), proposal.tokens.tolist()
        draws: dict[int, list] = {}
        for draw in proposal.draws or ():
            draws.setdefault(draw.parent, []).append(draw)
        children: dict[int, dict[int, int]] = {}  # verified children by token: where the walk may go on
        for node, (parent, token) in enumerate(zip(parents, tokens)):
            children.setdefault(parent, {}).setdefault(token, node)
        path, current = [], -1
        while True:
            p = sampler.probs(target_logits[current + 1])
            accepted = self._test_drawn(p, draws.get(current, ()), sampler)
            if isinstance(accepted, tuple):  # a drawn candidate passed its test
                token, node = accepted
                if node is None:
                    return Verdict(path, token, next_drafted=True)
            else:  # all rejected (or none drawn): the target's sample of the residual
                token = sampler.token_at(accepted, self.position(sampler, len(path)))
                node = children.get(current, {}).get(token)
                if node is None:
                    return Verdict(path, token)
            path.append(node)
            current = node

    def _test_drawn(self, p: torch.Tensor, draws, sampler: Sampler):
        """Test one node's drawn candidates in order; the accepted ``(token, node or None)``, else the residual."""
        for draw in draws:
            q = draw.probs
            for token, node in zip(draw.tokens, draw.nodes):
                if self.test(p, q, token, sampler):
                    return token, node
                p, q = self.residual(p, q), self.without(q, token)
        return p

    @staticmethod
    def position(sampler: Sampler, depth: int) -> int:
        """Sequence position of the token emitted after ``depth`` accepted nodes."""
        return sampler.position + depth

    @staticmethod
    def test(p: torch.Tensor, q: torch.Tensor, token: int, sampler: Sampler) -> bool:
        """Accept ``token`` (drawn from ``q``) with probability min(1, p(token) / q(token))."""
        return sampler.uniform() * float(q[token]) < float(p[token])

    @staticmethod
    def without(q: torch.Tensor, token: int) -> torch.Tensor:
        """The distribution the next sibling was drawn from: q without ``token``, renormalised."""
        return exclude(q, token)

    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The distribution to go on with after a rejection: norm(max(p - q, 0))."""
        rest = (p - q).clamp_min(0)
        total = rest.sum()
        return rest / total if total > 0 else p  # total 0: p == q, a rejection had probability 0


class TypicalAcceptance:
    """Medusa's typical acceptance (the paper's "soft acceptance"): **lossy**, opt-in only.

    A drafted token d after a node is accepted when the target gives it probability
    ``p(d) > min(tau, alpha * exp(-H(p)))``, H the entropy of p there: confident positions demand a likely token,
    uncertain ones accept less likely tokens too. p is the target's warped distribution (`cats.sampling.warp`) at
    the generation's temperature; at temperature 0 the plain softmax (temperature 1) and the next token is the
    argmax. Chains keep the longest accepted prefix; trees the longest accepted path (ties: the highest target
    log-likelihood, as Medusa). After it, the next token is the target's own (sampled, or argmax at temperature 0).

    The output no longer follows the target's distribution: every report of such a run says ``typical (lossy)``.
    """

    name = "typical"
    label = "typical (lossy)"
    lossless = False
    draws_drafts = False  # deterministic drafts: the likeliest tokens, as Medusa's candidates

    def __init__(self, tau: float = TYPICAL_TAU, alpha: float = TYPICAL_ALPHA):
        for name, value in (("typical_tau", tau), ("typical_alpha", alpha)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise InvalidArgumentError(f"{name} must lie in (0, 1], got {value!r}")
        self.tau, self.alpha = float(tau), float(alpha)

    def thresholds(self, probs: torch.Tensor) -> torch.Tensor:
        """``min(tau, alpha * exp(-H))`` per row of ``probs`` ``[n, V]``."""
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
        return torch.clamp(self.alpha * torch.exp(-entropy), max=self.tau)

    def accept(self, proposal: Proposal, target_logits: torch.Tensor, sampler: Sampler) -> Verdict:
        probs = sampler.probs(target_logits)  # [k+1, V]
        threshold = self.thresholds(probs)
        parents, tokens = _parents(proposal), proposal.tokens.tolist()
        depth, loglik, best = {-1: 0}, {-1: 0.0}, -1
        for node, (parent, token) in enumerate(zip(parents, tokens)):
            prob = float(probs[parent + 1, token])
            if parent in depth and prob > float(threshold[parent + 1]):
                depth[node], loglik[node] = depth[parent] + 1, loglik[parent] + math.log(prob)
                if (depth[node], loglik[node]) > (depth[best], loglik[best]):
                    best = node
        path = []
        while best >= 0:
            path.append(best)
            best = parents[best]
        path.reverse()
        return Verdict(path, sampler.next_token(target_logits[path[-1] + 1 if path else 0],
                                                sampler.position + len(path)))


def check_acceptance(acceptance: str, typical_tau: float | None, typical_alpha: float | None) -> None:
    """``acceptance`` must be ``exact`` or ``typical``; the typical parameters belong to ``typical`` only."""
    if acceptance not in ACCEPTANCE_MODES:
        raise InvalidArgumentError(f"acceptance must be one of {', '.join(ACCEPTANCE_MODES)}, got {acceptance!r}")
    if acceptance != "typical":
        given = [name for name, value in (("typical_tau", typical_tau), ("typical_alpha", typical_alpha))
                 if value is not None]
        if given:
            raise InvalidArgumentError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to typical "
                                       "acceptance only: add acceptance='typical' (--acceptance typical; lossy) or "
                                       "drop it")


def make_acceptance(acceptance: str = "exact", temperature: float = 0.0, typical_tau: float | None = None,
                    typical_alpha: float | None = None):
    """The rule for a generation: exact acceptance is greedy at temperature 0, speculative sampling above;
    ``typical`` is `TypicalAcceptance` (default tau 0.09, alpha 0.3)."""
    check_acceptance(acceptance, typical_tau, typical_alpha)
    if acceptance == "typical":
        return TypicalAcceptance(TYPICAL_TAU if typical_tau is None else typical_tau,
                                 TYPICAL_ALPHA if typical_alpha is None else typical_alpha)
    return GreedyAcceptance() if temperature == 0 else SpeculativeSampling()
