"""The printed summaries: `format_report` of `mindvl demo` (per-stage losses, held-out accuracy against the
image-blind baselines, the resolution search, wall time, where the artefacts are) and `format_post_report`
of `mindvl demo --post-train`."""
from __future__ import annotations

from typing import Any, Dict


def format_report(r: Dict[str, Any]) -> str:
    """The summary `mindvl demo` prints, from its report (`run.run_demo`)."""
    tasks = list(r["baselines"])
    names = list(r["scores"])
    lines = ["", "== mindvl demo: per-stage training loss (first -> last, mean of the last 10 steps) =="]
    for name, s in r["stages"].items():
        lines.append(f"  {name:<12} {s['steps']:>5} steps   {s['first_loss']:.3f} -> {s['final_loss']:.3f}   "
                     f"(last-10 mean {s['last10_mean']:.3f})")
    lines.append("== held-out accuracy (%) ==")
    lines.append(f"  {'task':<11}{'metric':<14}{'baseline':>9}  " + "".join(f"{n:>11}" for n in names))
    for t in tasks:
        b = r["baselines"][t]
        metric = "Acc@IoU0.5" if t == "grounding" else "exact match"
        lines.append(f"  {t:<11}{metric:<14}{100 * b['score']:>8.1f}%  "
                     + "".join(f"{100 * r['scores'][n][t]:>10.1f}%" for n in names))
    if "question_prior" in r["baselines"].get("vqa", {}):
        lines.append(f"  vqa image-blind question prior (most frequent answer per question template): "
                     f"{100 * r['baselines']['vqa']['question_prior']:.1f}%")
    by_type = r.get("vqa_by_type") or {}
    for t, b in (r["baselines"].get("vqa", {}).get("by_type", {}) if by_type else {}).items():
        lines.append(f"  {'  ' + t:<11}{'prior, n=' + str(b['n']):<14}{100 * b['question_prior']:>8.1f}%  "
                     + "".join(f"{100 * by_type[n][t]:>10.1f}%" for n in names))
    lines.append("  baselines: " + "; ".join(
        f"{t}: {r['baselines'][t]['kind']} ({'chance level' if t != 'vqa' else 'majority-answer baseline'})"
        for t in tasks))
    s = r["resolution_search"]
    lines.append(f"== resolution search on the OCR split (merged, {s['settings']} settings): best min_pixels="
                 f"{s['best_min_pixels']} max_pixels={s['best_max_pixels']} -> {100 * s['best_score']:.1f}% ==")
    w = r["wall_time_s"]
    lines.append(f"== wall time {w['total'] / 60:.1f} min (data {w['data']:.0f}s, training and merge "
                 f"{w['train']:.0f}s, eval {w['eval']:.0f}s) ==")
    out = r["out_dir"]
    lines.append(f"artefacts in {out}: data/ (JSONL + images), {'/, '.join(r['stages'])}/ (checkpoints, "
                 f"loss_lr.png), metrics.jsonl, merged/ (averaged SFT variants), eval/ (predictions, scores), "
                 f"resolution_search/ (table, grid plot), report.json")
    return "\n".join(lines)


def format_post_report(r: Dict[str, Any]) -> str:
    """The summary `mindvl demo --post-train` prints, from its report (`post.run_post_train`)."""
    ro, st, h = r["rollout"], r["stages"], r["heldout"]
    lines = ["", f"== mindvl demo --post-train (seed {r['seed']}) ==",
             f"  rollout   {ro['prompts']} prompts x {ro['k']} samples: mean IoU {ro['mean_score']:.3f}, best-of-k "
             f"{ro['best_of_k']:.3f} -> {ro['pairs']} preference pairs"]
    if "dpo" in st:
        d = st["dpo"]
        lines.append(f"  dpo       {d['steps']} steps: loss {d['loss'][0]:.3f} -> {d['loss'][1]:.3f}, margin "
                     f"{d['margin'][0]:.3f} -> {d['margin'][1]:.3f} (first / last 5 steps)")
    if "grpo" in st:
        g = st["grpo"]
        lines.append(f"  grpo      {g['steps']} steps: reward {g['reward_mean'][0]:.3f} -> {g['reward_mean'][1]:.3f}, "
                     f"clip fraction {g['clip_frac'][1]:.3f}, entropy {g['entropy'][0]:.3f} -> {g['entropy'][1]:.3f}")
    n = next(iter(h.values()))["n"]
    lines.append(f"== held-out grounding ({n} images, greedy) ==")
    lines.append(f"  {'checkpoint':<12}{'Acc@IoU0.5':>12}{'Acc@IoU0.75':>13}{'mean IoU':>10}")
    for name, s in h.items():
        lines.append(f"  {name:<12}{100 * s['acc_iou50']:>11.1f}%{100 * s['acc_iou75']:>12.1f}%{s['mean_iou']:>10.3f}")
    w = r["wall_time_s"]
    lines.append(f"== wall time {w['total'] / 60:.1f} min (prompts + rollout {w['rollout']:.0f}s, DPO + GRPO "
                 f"{w['train']:.0f}s, eval {w['eval']:.0f}s); report: {r['out_dir']}/post_report.json ==")
    return "\n".join(lines)
