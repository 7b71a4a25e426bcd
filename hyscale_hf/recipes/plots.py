"""Loss-curve figure from a Trainer's ``log_history`` (the values HyScaleCallback adds included)."""

from __future__ import annotations

from pathlib import Path

EVALUATION_LABELS = {"dense": "dense original", "sparse_fresh_indexer": "sparse, fresh indexer",
                     "sparse_after_warmup": "sparse, after warm-up", "sparse_after_training": "sparse, after training"}


def plot_training_curves(
    log_history: list[dict], dense_warmup_steps: int, path: str | Path, title: str = "", dense_pretrain_steps: int = 0
) -> Path:
    """Write a PNG: LM loss (left), indexer KL loss and top-k recall (right), dense stages shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [e for e in log_history if "loss" in e and "step" in e]
    if not train:
        raise ValueError("log_history has no training loss entries to plot")
    steps = [e["step"] for e in train]
    fig, (ax_lm, ax_idx) = plt.subplots(1, 2, figsize=(11, 4))
    ax_lm.plot(steps, [e["loss"] for e in train], color="tab:blue")
    ax_lm.set(xlabel="optimizer step", ylabel="LM loss (nats/token)", title="language-model loss")
    with_idx = [e for e in train if "indexer_loss" in e]
    if with_idx:
        ax_idx.plot([e["step"] for e in with_idx], [e["indexer_loss"] for e in with_idx], color="tab:red", label="indexer KL")
        ax_idx.set_yscale("log")
    ax_idx.set(xlabel="optimizer step", ylabel="indexer KL loss", title="indexer: KL loss and top-k recall")
    with_recall = [e for e in train if "topk_recall" in e]
    if with_recall:
        ax_recall = ax_idx.twinx()
        ax_recall.plot(
            [e["step"] for e in with_recall], [e["topk_recall"] for e in with_recall], "o-", color="tab:green", label="top-k recall"
        )
        best = [e for e in with_recall if "topk_recall_best" in e]
        if best:
            ax_recall.plot([e["step"] for e in best], [e["topk_recall_best"] for e in best], "--", color="tab:green",
                           alpha=0.6, label="attention's own top-k (ceiling)")
        ax_recall.set(ylabel="top-k recall of dense attention mass", ylim=(0, 1.02))
    for ax in (ax_lm, ax_idx):
        if dense_pretrain_steps > 0:
            ax.axvspan(0, dense_pretrain_steps, color="#dbe9f6", label="dense pre-training")
        if dense_warmup_steps > 0:
            end = dense_pretrain_steps + dense_warmup_steps
            ax.axvspan(dense_pretrain_steps, end, color="0.88", label="dense warm-up (indexer only)")
        ax.grid(alpha=0.3)
    handles = [h for ax in fig.axes for h in ax.get_legend_handles_labels()[0]]
    labels = [lab for ax in fig.axes for lab in ax.get_legend_handles_labels()[1]]
    unique = dict(zip(labels, handles))
    fig.legend(unique.values(), unique.keys(), loc="lower center", ncol=len(unique), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_evaluations(evaluations: dict, path: str | Path, title: str = "") -> Path:
    """Write a PNG of the held-out evaluations side by side: perplexity (left), top-k recall of the dense
    attention mass against its ceiling, the attention's own top-k (middle), passkey accuracy (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(evaluations)
    labels = [EVALUATION_LABELS.get(n, n).replace(", ", ",\n") for n in names]
    x = range(len(names))
    fig, (ax_ppl, ax_rec, ax_key) = plt.subplots(1, 3, figsize=(14, 4.2))
    ppl = [evaluations[n]["perplexity"] for n in names]
    ax_ppl.bar(x, ppl, color=["0.5"] + ["tab:blue"] * (len(names) - 1))
    ax_ppl.axhline(ppl[0], color="0.3", ls="--", lw=1, label="dense original")
    for i, v in enumerate(ppl):
        ax_ppl.annotate(f"{v:.2f}", (i, v), ha="center", va="bottom", fontsize=8)
    ax_ppl.set(ylabel="perplexity (held-out)", title="perplexity")
    recall = [evaluations[n].get("topk_recall") for n in names]
    best = [evaluations[n].get("topk_recall_best") for n in names]
    shown = [i for i, r in enumerate(recall) if r is not None]
    ax_rec.bar([i - 0.2 for i in shown], [recall[i] for i in shown], 0.4, color="tab:green", label="indexer's top-k")
    ax_rec.bar([i + 0.2 for i in shown], [best[i] for i in shown], 0.4, color="tab:green", alpha=0.35,
               label="attention's own top-k (ceiling)")
    for i in shown:
        ax_rec.annotate(f"{recall[i]:.3f}", (i - 0.2, recall[i]), ha="center", va="bottom", fontsize=8)
    ax_rec.set(ylabel="fraction of dense attention mass kept", ylim=(0, 1.05), title="top-k recall (dense: all keys)")
    keys = [evaluations[n].get("passkey_accuracy") for n in names]
    ax_key.bar(x, [k or 0.0 for k in keys], color="tab:purple")
    ax_key.set(ylabel="passkey accuracy", ylim=(0, 1.05), title="passkey retrieval")
    for ax in (ax_ppl, ax_rec, ax_key):
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    ax_ppl.legend(fontsize=8)
    ax_rec.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
