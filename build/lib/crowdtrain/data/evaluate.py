"""Prompt adherence: the share of generated pictures a data set's judge finds right.

For each of the judge's fixed prompts (:mod:`crowdtrain.data.judges`; the shapes data's are
:data:`crowdtrain.data.shapes.EVAL_PROMPTS`), draw samples (no re-ranking: we measure the model,
not the filter), decode them and let the judge read them back. Adherence is the share of samples
where everything matches (for the shapes: colours, shapes, sizes, position or relation); the
judge's other checks are reported next to it (the shapes' ``objects`` counts colour+shape only).
The gap between ``seen`` and ``heldout`` measures how well the model composes concepts it has
only seen apart, the paper's generalisation claim.

``crowdtrain eval`` (``crowdtrain.train.validate.evaluate_quality``) reports this only for data
with a judge, next to the held-out loss of each split.
"""

from __future__ import annotations

import logging

import numpy as np

from crowdtrain.model.config import DEFAULT_TOP_K, DEFAULT_TOP_P

logger = logging.getLogger(__name__)


def evaluate_generator(gen, *, judge=None, samples_per_prompt: int = 8, top_k: int | None = DEFAULT_TOP_K,
                       top_p: float | None = DEFAULT_TOP_P, temperature: float = 1.0,
                       seed: int = 0, prompts: dict[str, tuple[str, ...]] | None = None) -> dict:
    """Adherence per group and per prompt for a :class:`crowdtrain.data.generate.Generator`,
    read by ``judge`` (default: the shapes judge); ``prompts`` replaces the judge's own."""
    from crowdtrain.data.judges import ShapesJudge

    if samples_per_prompt <= 0:
        raise ValueError("--samples-per-prompt must be positive")
    judge = judge or ShapesJudge()
    prompts = prompts or judge.prompts()
    groups, per_prompt, checks = {}, [], ["all"]
    for g, (group, group_prompts) in enumerate(prompts.items()):
        totals: dict[str, int] = {}
        for j, prompt in enumerate(group_prompts):
            # Seeds by group position: the shapes' "seen" and "heldout" keep the seeds they always had.
            _, images = gen.sample(prompt, samples_per_prompt, top_k=top_k, top_p=top_p, temperature=temperature,
                                   seed=seed + 7919 * j + (0 if g == 0 else 104_729 * g))
            hits: dict[str, int] = {}
            for verdict in judge.judge(prompt, images.numpy()):
                for k, v in verdict.items():
                    if isinstance(v, (bool, np.bool_)):  # a check; other fields (a score, a label) are not summed
                        hits[k] = hits.get(k, 0) + bool(v)
            checks += [k for k in hits if k not in checks]
            for k, v in hits.items():
                totals[k] = totals.get(k, 0) + v
            per_prompt.append({"group": group, "prompt": prompt, "adherence": hits.get("all", 0) / samples_per_prompt,
                               **{k: v / samples_per_prompt for k, v in hits.items() if k != "all"}})
        n = samples_per_prompt * len(group_prompts)
        groups[group] = {"samples": n, **{("adherence" if k == "all" else k): totals.get(k, 0) / n
                                          for k in checks}}
    return {"judge": getattr(judge, "name", type(judge).__name__), "checks": checks[1:], "groups": groups,
            "prompts": per_prompt, "samples_per_prompt": samples_per_prompt,
            "sampling": {"top_k": top_k, "top_p": top_p, "temperature": temperature, "seed": seed}}


def format_adherence(result: dict) -> str:
    """:func:`evaluate_generator`'s result as a table, one row per group, then one line per prompt."""
    checks = result.get("checks", [])
    lines = [f"prompt adherence by the {result.get('judge', '?')} judge ({result['samples_per_prompt']} samples "
             "per prompt)",
             f"{'group':8s} {'samples':>7s} {'adherence':>9s}" + "".join(f" {c:>8s}" for c in checks)]
    for group, g in result["groups"].items():
        lines.append(f"{group:8s} {g['samples']:7d} {g['adherence']:9.3f}" + "".join(f" {g[c]:8.3f}" for c in checks))
    lines.append("per prompt:")
    for p in result["prompts"]:
        lines.append(f"  {p['group']:8s} {p['adherence']:.2f}  {p['prompt']}")
    return "\n".join(lines)
