"""Results of the long-context fine-tuning recipe: what was trained, ``results.json``, the loss
curve and the printed summary."""

from __future__ import annotations

import json
import time
from pathlib import Path

BUILT_MODEL_NAME = "glm_moe_dsa (random init, built in code)"


def model_label(args) -> str:
    return BUILT_MODEL_NAME if args.model is None else args.model_source.label


def describe_training(args, trainer, checkpoint, train_seconds: float) -> dict:
    """What was trained, with the LM loss of the last logged step and its mean over the logged steps."""
    train = [e for e in trainer.state.log_history if "loss" in e and "step" in e]
    # Each entry is the mean over the steps since the one before: weight it by their number.
    spans = [e["step"] - (p["step"] if p else 0) for p, e in zip([None, *train[:-1]], train)]
    results = {
        "model": model_label(args), "dataset": args.dataset or "python standard library sources",
        "seq_len": args.seq_len, "max_steps": args.max_steps, "dense_pretrain_steps": args.dense_pretrain_steps,
        "dense_warmup_steps": args.dense_warmup_steps,
        "train_tokens": int(args.max_steps * args.batch_size * args.grad_accum * args.world_size * args.seq_len),
        "train_seconds": round(train_seconds, 1), "resumed_from": checkpoint,
        "train_loss_last_logged": train[-1]["loss"], "train_loss_last_logged_step": train[-1]["step"],
        "train_loss_mean_logged_steps": sum(e["loss"] * s for e, s in zip(train, spans)) / sum(spans),
        "logged_steps": sum(spans),
    }
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    if evals:
        results |= {"eval_loss_last": evals[-1]["eval_loss"], "eval_loss_last_step": evals[-1]["step"]}
    return results


def write_results(args, trainer, results: dict, started: float) -> None:
    from .plots import plot_training_curves

    out = Path(args.output_dir)
    curve = plot_training_curves(trainer.state.log_history, args.dense_warmup_steps, out / "loss_curve.png",
                                 title=f"{results['model']}, {args.seq_len} tokens, top-{results['topk']}",
                                 dense_pretrain_steps=args.dense_pretrain_steps)
    results["loss_curve"] = str(curve)
    if "evaluation" in results:
        from .plots import plot_evaluations

        results["evaluation_plot"] = str(plot_evaluations(results["evaluation"], out / "evaluation.png",
                                                          title=f"{results['model']}: held-out text, top-{results['topk']}"
                                                                f" of {args.seq_len} tokens"))
    results["total_seconds"] = round(time.time() - started, 1)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print_summary(results, out)


def evaluation_table(evaluations: dict) -> str:
    """The four model states side by side, one line each."""
    from .plots import EVALUATION_LABELS

    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    lines = [f"  {'model':<24}{'perplexity':>11}{'vs dense':>9}{'recall':>8}{'ceiling':>8}{'passkey':>8}"]
    dense = evaluations["dense"]["perplexity"]
    for name, ev in evaluations.items():
        lines.append(f"  {EVALUATION_LABELS.get(name, name):<24}{ev['perplexity']:>11.3f}{ev['perplexity'] / dense:>9.3f}"
                     f"{fmt(ev.get('topk_recall'), '.3f'):>8}{fmt(ev.get('topk_recall_best'), '.3f'):>8}"
                     f"{fmt(ev.get('passkey_accuracy'), '.2f'):>8}")
    return "\n".join(lines)


def print_summary(results: dict, out: Path) -> None:
    depth = "  ".join(f"{k}: {v:.2f}" for k, v in results["passkey_per_depth"].items())
    recall, best = results["topk_recall_held_out"], results["topk_recall_best_held_out"]
    evaluation = (f"eval loss        {results['eval_loss_last']:.4f} (step {results['eval_loss_last_step']})\n"
                  if "eval_loss_last" in results else "")
    print(
        "\n=== hyscale_hf long-context fine-tuning ===\n"
        f"model            {results['model']}\n"
        f"data             {results['dataset']}\n"
        f"training         {results['train_tokens']} tokens, {results['train_seconds']} s (model, data and training)"
        + (f", resumed from {results['resumed_from']}" if results["resumed_from"] else "") + "\n"
        f"LM loss          {results['train_loss_last_logged']:.4f} at the last logged step "
        f"({results['train_loss_last_logged_step']}); mean over the {results['logged_steps']} logged steps "
        f"{results['train_loss_mean_logged_steps']:.4f}\n" + evaluation +
        f"top-k recall     {'n/a' if recall is None else f'{recall:.3f}'} (share of the dense attention mass on the "
        f"indexer's top-{results['topk']} keys, {results['held_out_tokens']} held-out tokens; the attention's own "
        f"top-{results['topk']} holds {'n/a' if best is None else f'{best:.3f}'})\n"
        f"passkey          accuracy {results['passkey_accuracy']:.2f} (per depth {depth}), "
        f"token accuracy {results['passkey_token_accuracy']:.2f}\n"
        + (f"reload check     max |logit diff| {results['reload_max_abs_logit_diff']:.2e}\n"
           if "reload_max_abs_logit_diff" in results else "")
        + (f"held-out evaluation ({results['held_out_tokens']} tokens; recall: share of the dense attention mass "
           f"the indexer's top-{results['topk']} keeps, ceiling: the attention's own top-{results['topk']})\n"
           + evaluation_table(results["evaluation"]) + "\n" if "evaluation" in results else "")
        + f"outputs          {out}/ (model, hyscale_config.json, loss_curve.png, evaluation.png, log_history.json, "
        "results.json)\n"
    )
