"""Statistics for the sampling tests: Pearson's chi-squared goodness of fit, and the exact distribution of the first
tokens of plain sampling (enumerated with transformers' forward, no sampling)."""

from __future__ import annotations

import torch

from cats.sampling import warp


def chi2_pvalue(counts, probs) -> float:
    """p-value of Pearson's chi-squared test that ``counts`` (``[n]``) were drawn from ``probs`` (``[n]``, summing to
    1 over the cells; counts outside the cells must be folded in by the caller). 0 when a count falls in a cell of
    probability 0."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    probs = torch.as_tensor(probs, dtype=torch.float64)
    probs = probs / probs.sum()
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0
    keep = probs > 0
    expected = counts.sum() * probs[keep]
    statistic = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def sequence_pvalue(samples: list[tuple], exact: dict[tuple, float]) -> float:
    """Chi-squared p-value of observed sequences against their exact probabilities (an unexpected sequence: 0)."""
    if any(sample not in exact for sample in samples):
        return 0.0
    cells = list(exact)
    counts = [sum(1 for s in samples if s == cell) for cell in cells]
    return chi2_pvalue(counts, [exact[cell] for cell in cells])


@torch.no_grad()
def first_tokens_distribution(model, prompt: list[int], count: int, temperature: float, top_p: float = 1.0,
                              top_k: int = 0) -> dict[tuple, float]:
    """Exact probability of every sequence of the first ``count`` tokens under plain sampling from the warped
    distribution, by enumerating the support (transformers' own forward, float64)."""
    result: dict[tuple, float] = {}

    def expand(prefix: list[int], probability: float) -> None:
        if len(prefix) == count:
            result[tuple(prefix)] = probability
            return
        logits = model.hf_model(torch.tensor([prompt + prefix])).logits[0, -1]
        probs = warp(logits, temperature, top_p, top_k)
        for token in torch.nonzero(probs > 0).flatten().tolist():
            expand(prefix + [token], probability * float(probs[token]))

    expand([], 1.0)
    return result
