"""``crowdtrain eval``: prompt adherence on seen and held-out shapes compositions.

For each fixed prompt in :data:`crowdtrain.data.shapes.EVAL_PROMPTS`, draw samples (no
re-ranking: we measure the model, not the filter), decode them, read them back with the shapes
analyser and compare with the prompt. Adherence is the share of samples where everything
matches (colours, shapes, sizes, position or relation); ``objects`` counts colour+shape only.
The gap between ``seen`` and ``heldout`` measures how well the model composes concepts it has
only seen apart, the paper's generalisation claim.
"""

from __future__ import annotations

import logging

from crowdtrain.model.config import DEFAULT_TOP_K, DEFAULT_TOP_P

logger = logging.getLogger(__name__)

CHECKS = ("all", "objects", "size", "layout")


def evaluate_generator(gen, *, samples_per_prompt: int = 8, top_k: int | None = DEFAULT_TOP_K,
                       top_p: float | None = DEFAULT_TOP_P, temperature: float = 1.0,
                       seed: int = 0, prompts: dict[str, tuple[str, ...]] | None = None) -> dict:
    """Adherence per group and per prompt for a :class:`crowdtrain.data.generate.Generator`."""
    from crowdtrain.data import shapes

    if samples_per_prompt <= 0:
        raise ValueError("--samples-per-prompt must be positive")
    prompts = prompts or shapes.EVAL_PROMPTS
    groups, per_prompt = {}, []
    for group, group_prompts in prompts.items():
        totals = dict.fromkeys(CHECKS, 0)
        for j, prompt in enumerate(group_prompts):
            _, images = gen.sample(prompt, samples_per_prompt, top_k=top_k, top_p=top_p, temperature=temperature,
                                   seed=seed + 7919 * j + (0 if group == "seen" else 104_729))
            hits = dict.fromkeys(CHECKS, 0)
            for im in images.numpy():
                verdict = shapes.judge(prompt, shapes.analyse_image(im))
                for k in CHECKS:
                    hits[k] += verdict[k]
            for k in CHECKS:
                totals[k] += hits[k]
            per_prompt.append({"group": group, "prompt": prompt, "adherence": hits["all"] / samples_per_prompt,
                               "objects": hits["objects"] / samples_per_prompt})
        n = samples_per_prompt * len(group_prompts)
        groups[group] = {"samples": n, **{("adherence" if k == "all" else k): totals[k] / n for k in CHECKS}}
    return {"groups": groups, "prompts": per_prompt, "samples_per_prompt": samples_per_prompt,
            "sampling": {"top_k": top_k, "top_p": top_p, "temperature": temperature, "seed": seed}}


def evaluate_checkpoint(checkpoint, *, device: str = "cpu", **kwargs) -> dict:
    from crowdtrain.data.generate import Generator

    gen = Generator.from_checkpoint(checkpoint, device=device)
    result = evaluate_generator(gen, **kwargs)
    result["checkpoint"] = str(checkpoint)
    result["step"] = gen.meta.get("step")
    return result


def format_eval(result: dict) -> str:
    lines = [f"prompt adherence ({result['samples_per_prompt']} samples per prompt, step {result.get('step')})",
             f"{'group':8s} {'samples':>7s} {'adherence':>9s} {'objects':>7s} {'size':>6s} {'layout':>6s}"]
    for group, g in result["groups"].items():
        lines.append(f"{group:8s} {g['samples']:7d} {g['adherence']:9.3f} {g['objects']:7.3f} {g['size']:6.3f} "
                     f"{g['layout']:6.3f}")
    lines.append("per prompt:")
    for p in result["prompts"]:
        lines.append(f"  {p['group']:8s} {p['adherence']:.2f}  {p['prompt']}")
    return "\n".join(lines)
