"""Token choice: greedy at temperature 0, else sampling from the target's *warped* distribution.

Warping is transformers' (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, in that order):
divide the logits by the temperature, keep the ``top_k`` largest (ties at the cut kept), then keep the smallest set
of most likely tokens whose probability reaches ``top_p``. Plain sampling draws from `warp` of the target's logits;
every speculative method keeps exactly that distribution (see `cats.verify.acceptance`).

One `Sampler` per generation, seeded from ``seed``, makes every random choice of a generation, so the same seed gives
the same output for every method:

* the target's own samples (`token_at`: plain decoding's tokens, the token after a rejection) are Gumbel-max draws
  whose noise depends only on the seed and the token's position in the sequence. A method whose drafts are
  deterministic therefore emits exactly plain sampling's tokens for the same seed, whatever it drafted;
* draft draws and acceptance tests (`sample`, `draw`, `uniform`) come from one ``torch.Generator`` seeded from
  ``seed``; uniform numbers are drawn from it in blocks (the same sequence as one at a time).

Draws are computed in float64 on the row's device from noise made on the CPU, so no generator is needed there.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from cats.errors import InvalidArgumentError


def check_sampling(temperature: float, top_p: float, top_k: int, seed: int | None) -> None:
    """Raise `InvalidArgumentError` for values outside temperature >= 0, 0 < top_p <= 1, top_k >= 0, seed >= 0,
    and for top_p / top_k / seed at temperature 0 (greedy decoding has nothing to warp or draw)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not (temperature >= 0 and math.isfinite(temperature)):
        raise InvalidArgumentError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise InvalidArgumentError(f"top_p must lie in (0, 1] (1 = off), got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise InvalidArgumentError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise InvalidArgumentError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    if temperature == 0:
        given = [name for name, value, off in (("top_p", top_p, 1.0), ("top_k", top_k, 0), ("seed", seed, None))
                 if value != off]
        if given:
            raise InvalidArgumentError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to sampling, "
                                       "but temperature is 0 (greedy): set temperature > 0 or drop it")


def warp(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Probabilities ``[..., V]`` (float32 or wider) of the warped distribution of ``logits`` ``[..., V]``;
    ``temperature`` > 0. Tokens outside top-k / top-p (or at -inf) get probability 0."""
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1, stable=True)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= 1 - top_p
        remove[..., -1] = False  # the most likely token always stays
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return torch.softmax(scores, dim=-1)


def exclude(probs: torch.Tensor, token: int) -> torch.Tensor:
    """``probs`` with ``token`` removed and renormalised: the distribution of the next draw without replacement
    (all zeros when nothing is left)."""
    rest = probs.clone()
    rest[token] = 0
    total = rest.sum()
    return rest / total if total > 0 else rest


class Sampler:
    """The generation's token choice and its random stream.

    Args:
        temperature: 0 = greedy (argmax); > 0 = sample from `warp`.
        top_p, top_k: nucleus and top-k filtering (1.0 / 0 = off).
        seed: seed of the generation's ``torch.Generator``; None draws one from torch's global generator (so
            ``torch.manual_seed`` makes unseeded runs repeatable too). The seed used is ``self.seed``.
    """

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None):
        check_sampling(temperature, top_p, top_k, seed)
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)
        self.seed: int | None = None
        self.generator: torch.Generator | None = None
        self._uniforms: list[float] = []
        self.position = 0  # sequence position of the token after the pending one (the decode loop keeps it)
        if temperature > 0:
            self.seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
            self.generator = torch.Generator().manual_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The warped distribution of ``logits`` (``[..., V]``); at temperature 0 the plain softmax."""
        if self.greedy:
            return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        return warp(logits, self.temperature, self.top_p, self.top_k)

    def uniform(self) -> float:
        """The next number of the generation's stream, uniform in [0, 1)."""
        if not self._uniforms:
            self._uniforms = torch.rand(256, generator=self.generator, dtype=torch.float64).tolist()[::-1]
        return self._uniforms.pop()

    def sample(self, probs: torch.Tensor) -> int:
        """One token from the probability row ``probs`` ``[V]`` (need not be normalised; never a token of
        probability 0): the first token whose cumulative probability exceeds u * total."""
        cdf = probs.double().cumsum(-1)
        token = int((cdf <= self.uniform() * float(cdf[-1])).sum())
        if token >= probs.shape[-1]:  # u * total rounded up to the total: the last possible token
            token = int(torch.nonzero(probs > 0)[-1])
        return token

    def draw(self, probs: torch.Tensor, count: int) -> list[int]:
        """Up to ``count`` distinct tokens drawn one after another without replacement from ``probs`` ``[V]``
        (fewer when fewer tokens have probability > 0), in the order drawn.

        Gumbel-top-k: the ``count`` largest of log probs + Gumbel noise, in decreasing order, are distributed
        exactly as sequential draws without replacement (one pass over the vocabulary for all of them)."""
        count = min(count, int((probs > 0).sum()))
        uniform = torch.rand(probs.shape[-1], generator=self.generator, dtype=torch.float64).clamp_min(1e-300)
        keys = probs.double().log() - (-uniform.log()).log().to(probs.device)
        return torch.topk(keys, count).indices.tolist()

    def token_at(self, probs: torch.Tensor, position: int) -> int:
        """The target's sample from ``probs`` ``[V]`` for the token at sequence position ``position``: the argmax of
        log probs + Gumbel noise drawn from (seed, position) alone. Distributed as ``probs`` (Gumbel-max), and the
        same token for the same probabilities, seed and position, whatever happened before."""
        noise = torch.Generator().manual_seed(_mix(self.seed, position))
        uniform = torch.rand(probs.shape[-1], generator=noise, dtype=torch.float64).clamp_min(1e-300)
        return int((probs.double().log() - (-uniform.log()).log().to(probs.device)).argmax())

    def next_token(self, logits: torch.Tensor, position: int) -> int:
        """The token plain decoding chooses from ``logits`` ``[V]`` at ``position``: the argmax, or `token_at` of
        the warped distribution."""
        return int(greedy_tokens(logits)) if self.greedy else self.token_at(self.probs(logits), position)

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        if self.top_p < 1:
            parts.append(f"top-p {self.top_p:g}")
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        return ", ".join(parts + [f"seed {self.seed}"])


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension (the first maximum on ties, as ``torch.argmax``), as a CPU long tensor.

    On CPUs it goes through numpy, whose vectorised argmax is ~7x PyTorch's (float32 ``[9, 49152]``: 31 against
    214 µs; bf16 is converted first, as a bf16 argmax is slower still): a per-step cost of every decoding method."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1).cpu()
    values = logits.detach().float().numpy()
    return torch.from_numpy(np.asarray(values.argmax(axis=-1), dtype=np.int64))


def _mix(seed: int, position: int) -> int:
    """A seed for the noise of one sequence position (splitmix64 of seed and position), in [0, 2**63)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return (z ^ (z >> 31)) >> 1
