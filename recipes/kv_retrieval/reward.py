"""Rule-based reward for the key/value retrieval task.

veRL loads this file through ``reward.custom_reward_function.path`` /
``custom_reward_function.name=compute_score``; it must stay importable on its own.

Score = fraction of value digits in the right place (partial credit gives GRPO a
signal before answers are fully right); an answer of the wrong length loses 0.1 per
missing/extra token, floored at 0.
"""

from __future__ import annotations


def _tokens(text: str) -> list[str]:
    text = text.replace("<|im_end|>", " ").replace("<|im_start|>", " ")
    return [t for t in text.split() if t not in ("assistant", "answer", "<pad>")]


def score(solution_str: str, ground_truth: str) -> float:
    pred = _tokens(solution_str)
    gold = ground_truth.split()
    if not gold:
        return 0.0
    hits = sum(p == g for p, g in zip(pred, gold, strict=False))  # lengths may differ: penalised below
    penalty = 0.1 * abs(len(pred) - len(gold))
    return max(0.0, hits / len(gold) - penalty)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    s = score(solution_str, str(ground_truth))
    return {"score": s, "acc": float(s == 1.0)}
