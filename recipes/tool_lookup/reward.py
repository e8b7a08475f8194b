"""Reward of the tool_lookup task: the two lookups the model asked for and its final answer.

veRL loads this file through ``reward.custom_reward_function.path`` (``name=compute_score``). ``solution_str`` is the
whole decoded response of a trajectory: the model's tool calls, the tool's answers (response_mask 0: no loss, but
decoded with the rest) and the final answer. The ground truth is printed in the second tool answer, so the answer is
read from the text after the last assistant turn marker only: an answer the model copies from the tool scores, the
tool's own text does not. A final turn that is a tool call (the turn limit was reached) answers nothing.

Score (in [0, 1]): 0.25 x the first call's key + 0.25 x the second call's key (each: the fraction of the right key's
digits in place, the keys from ``extra_info``) + 0.5 x the answer scored as kv_retrieval scores its answers (fraction
of the value's digits in place, minus 0.1 per missing or extra token, floored at 0). The calls' part is partial credit
for copying the keys right (the question's key, then the next key of the tool's answer): a policy fresh from the warm
start gets many of the nine digits of a trajectory right and few trajectories wholly right, so GRPO gets a signal from
the first step. Without ``extra_info`` keys the answer alone counts. ``acc``: 1 for an exact answer; ``lookups``: the
tool calls made.
"""

from __future__ import annotations

import json
import os
import re
import runpy

_kv_score = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kv_retrieval",
                                        "reward.py"))["score"]
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def final_answer(solution_str: str) -> str:
    """The words of the last assistant turn ("" when it is a tool call)."""
    words = solution_str.replace("<|im_start|>", " ").replace("<|im_end|>", " ").split()
    turns = [i for i, w in enumerate(words) if w == "assistant"]
    last = words[turns[-1] + 1:] if turns else words
    if any(w in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>") for w in last):
        return ""
    return " ".join(last)


def called_keys(solution_str: str) -> list[str]:
    """The ``key`` argument of each tool call in the text, digits joined ("" for a call that does not parse)."""
    keys = []
    for call in _CALL.findall(solution_str):
        try:
            keys.append("".join(str(json.loads(call)["arguments"]["key"]).split()))
        except (ValueError, KeyError, TypeError):
            keys.append("")
    return keys


def _digits(pred: str, gold: str) -> float:
    return sum(p == g for p, g in zip(pred, gold, strict=False)) / len(gold) if gold else 0.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    answer = _kv_score(final_answer(solution_str), str(ground_truth))
    calls = called_keys(solution_str)
    info = extra_info or {}
    if info.get("key") and info.get("hop"):
        made = (calls + ["", ""])[:2]
        score = 0.25 * _digits(made[0], str(info["key"])) + 0.25 * _digits(made[1], str(info["hop"])) + 0.5 * answer
    else:
        score = answer
    return {"score": score, "acc": float(answer == 1.0), "lookups": float(len(calls))}
