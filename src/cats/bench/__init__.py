"""``cats bench``: Spec-Bench-compatible speed runs of CATS methods and baselines in one process.

One idea per module: ``questions`` (question files), ``prompts`` (turns -> token ids), ``methods`` (the method
registry, CATS methods and baselines), ``memory`` (peak RSS per method), ``answers`` (answer files), ``runner``
(warm-up, interleaved runs), ``summary`` (Spec-Bench speedup, mean accepted, exact match), ``report``
(report.md), ``plots`` (PNGs), ``equal`` (token-for-token comparison of answer files), ``cli``.
"""
