"""The model card of a trained adapter: README.md (data, command, wall time, held-out figures, learning curve) and
learning_curve.png, written next to its config.json from the training record it holds."""

from __future__ import annotations

import json
from pathlib import Path

from cats.model.eagle3 import FORMAT as EAGLE3_FORMAT

CURVE_PLOT = "learning_curve.png"


def write_model_card(folder: str | Path) -> Path:
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    training = config.get("training", {})
    curve = training.get("learning_curve") or []
    vocabulary = (f"{len(config['vocab_subset'])} most frequent response tokens" if config.get("vocab_subset")
                  else "full")
    if config.get("format") == EAGLE3_FORMAT:
        title = "EAGLE-3 draft head"
        described = [[f"- input: the target's states after layers {', '.join(map(str, config['aux_layers']))} (fused by "
                     "`fc`) and the next token's embedding (`cats generate --method eagle3`; `cats export` for vLLM, "
                     "SGLang and llama.cpp)"],
                     [f"- layer: {config['num_attention_heads']} attention heads, {config['num_key_value_heads']} key/value "
                     f"heads of {config['head_dim']}, MLP {config['intermediate_size']}; vocabulary: {vocabulary}"]]
    else:
        kind = config.get("input", "hidden")
        features = kind != "hidden"
        title = {"features": "feature draft adapter (EAGLE-style)",
                 "features+hidden": f"early-exit feature draft adapter, layer {config['layer']}"}.get(
            kind, f"{config['role']} adapter, layer {config['layer']}")
        reads = {"features": f"the target's final features after all {config['layer']} layers and the next token's "
                             "embedding (`cats generate --method eagle`)",
                 "features+hidden": f"the target's final features and the next token's state after layer "
                                    f"{config['layer']} (`cats generate --method early-exit`)"}
        init = ("random" if config["init"] == "random" else "last layer") if features else config["init"]
        described = [[f"- input: {reads[kind]}"] if features else [],
                     [f"- block: {config['block']} (initialised: {init}), vocabulary: {vocabulary}"]]
    lines = [
        f"# CATS {title}",
        "",
        *described[0],
        f"- base model: `{config['base_model']['name']}` ({config['architecture']}, "
        f"{config['base_model']['num_layers']} layers, fingerprint `{config['base_model']['fingerprint']}`)",
        *described[1],
        f"- training data: `{training.get('data')}` ({training.get('data_samples')} samples, "
        f"{training.get('data_response_tokens')} response tokens); held-out: `{training.get('eval_data')}`",
        f"- steps: {training.get('steps')}, training tokens: {training.get('train_tokens')}, wall time: "
        f"{training.get('wall_s')} s, processes: {training.get('processes')}",
    ]
    if training.get("command"):
        lines += ["", "Command:", "", "```", training["command"], "```"]
    if curve:
        final = curve[-1]
        lines += ["", "## Held-out evaluation (final)", "",
                  "| agreement (top-1) | overlap sum min(p, q) | E[accepted], gamma 6 chain | positions |", "|---|---|---|---|",
                  f"| {final['agreement']:.3f} | {final['overlap']:.3f} | {final['expected_accepted_gamma6']:.2f} | {final['positions']} |",
                  "", "## Learning curve", "", f"![learning curve]({CURVE_PLOT})", "",
                  "| step | training tokens | wall s | agreement | overlap | E[accepted] |", "|---|---|---|---|---|---|"]
        lines += [f"| {p['step']} | {p['train_tokens']} | {p['wall_s']} | {p['agreement']:.3f} | {p['overlap']:.3f} | "
                  f"{p['expected_accepted_gamma6']:.2f} |" for p in curve]
        _plot(curve, folder / CURVE_PLOT, title)
    readme = folder / "README.md"
    readme.write_text("\n".join(lines) + "\n")
    return readme


def _plot(curve: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot([p["train_tokens"] for p in curve], [p["agreement"] for p in curve], marker="o")
    axes.set_xlabel("training tokens")
    axes.set_ylabel("held-out top-1 agreement")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
