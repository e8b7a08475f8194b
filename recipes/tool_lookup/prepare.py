"""Build everything the tool_lookup recipe trains on, locally: the records table (the tool's), parquet data for
veRL's ToolAgentLoop, the word-level tokenizer with its tool chat template, a tiny random-init Qwen3-Next hybrid
(kv_retrieval's ``model_config``) and a supervised warm start on the tool-call format in plain torch.

    python recipes/tool_lookup/prepare.py --workdir runs/tool_lookup

The warm start trains on trajectories laid out token for token as veRL's agent loop lays them out: they are
built with veRL's own Continuous Token builder (the one ``ToolAgentLoop`` uses for this model type) from the
chat template, the model's turns (tool calls, answer) supervised and the tool's turns masked, as
``response_mask`` masks them in RL. Each artefact is skipped when it already exists (``--force`` rebuilds).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
task = SimpleNamespace(**runpy.run_path(os.path.join(HERE, "task.py")))
# kv_retrieval's model and warm-start pieces: model_config, torch_threads, add_model_args, pad_batch, set_lr,
# spent, supervised_step, keep_best, restore_best, save_model
kv = SimpleNamespace(**runpy.run_path(os.path.join(HERE, "..", "kv_retrieval", "prepare.py")))


def trajectory(builder, tok, prompt: list[dict], table: dict, keys: list[str], answer: str,
               more: tuple = ()) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, response mask) of a trajectory as veRL's ToolAgentLoop builds it: the rendered
    prompt (system prompt with the tool schema, question, generation prompt), then per key of ``keys`` the model's
    call (mask 1, ending with eos as vLLM returns it) and the tool's answer rendered by the chat template (mask 0),
    then ``answer`` (mask 1). ``more``: further ``(question, keys, answer)`` of the same conversation, each after a
    user turn (mask 0): the warm start's way to supervise several lookups per system prompt."""
    tools = [task.TOOL_SCHEMA]
    messages = [dict(m) for m in prompt]
    ids = builder.build_initial_tokens(messages, tools=tools)
    prompt_len, mask = len(ids), []

    def add(merged) -> None:
        nonlocal ids, mask
        mask, _ = builder.align_response_metadata(merged, mask)
        ids = merged.token_ids

    def context(message: dict) -> None:
        before = list(messages)
        messages.append(message)
        add(builder.merge_context_tokens(before, messages, ids, tools=tools))

    for n, (question, lookups, final) in enumerate([(None, keys, answer), *more]):
        if n:
            context({"role": "user", "content": question})
        for k in lookups:
            add(builder.merge_assistant_tokens(ids, tok(task.call_text(k), add_special_tokens=False)["input_ids"]
                                               + [tok.eos_token_id]))
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": task.TOOL_NAME, "arguments": {"key": f" {k} "}}}]})
            context({"role": "tool", "content": task.record_text(k, table[k]) if k in table else task.NO_RECORD})
        add(builder.merge_assistant_tokens(ids, tok(final, add_special_tokens=False)["input_ids"]
                                           + [tok.eos_token_id]))
        messages.append({"role": "assistant", "content": final})
    return ids[:prompt_len], ids[prompt_len:], mask


# What a demonstration does on a question: the right two lookups and the second record's value; a guess (no lookup,
# a random value); or one lookup and the first record's value (stopping a hop short).
RIGHT, GUESS, ONE_LOOKUP = "right", "guess", "one_lookup"


def demonstration(row: dict, table: dict, kind: str = RIGHT, rng=None) -> tuple[list[str], str]:
    """(keys looked up, final answer) of a ``kind`` demonstration for a data row (``rng``: the guess's digits)."""
    key = row["extra_info"]["key"]
    if kind == RIGHT:
        return [key, table[key]["next"]], row["reward_model"]["ground_truth"]
    if kind == ONE_LOOKUP:
        return [key], table[key]["value"]
    if kind == GUESS:
        return [], " ".join(rng.choice(task.DIGITS) for _ in range(len(table[key]["value"].split())))
    raise ValueError(f"demonstration kind {kind!r}: expected one of {RIGHT!r}, {GUESS!r}, {ONE_LOOKUP!r}")


def demonstrated_trajectory(builder, tok, row: dict, table: dict, follow_ups: list[dict] = (), kind: str = RIGHT,
                            rng=None) -> tuple[list[int], list[int], list[int]]:
    """``trajectory`` of a ``kind`` demonstration (``demonstration``) for a data row, then of the right lookups and
    answers for the rows ``follow_ups`` (their questions asked in turn)."""
    keys, answer = demonstration(row, table, kind, rng)
    more = tuple((r["prompt"][-1]["content"], *demonstration(r, table)) for r in follow_ups)
    return trajectory(builder, tok, row["prompt"], table, keys, answer, more)


def decision_positions(response: list[int], mask: list[int], tok) -> list[int]:
    """Response positions of the tokens a correct trajectory copies: the model's digits (the keys of its calls, its
    answer); the rest, the call format, is learnt first."""
    digits = set(tok.convert_tokens_to_ids(task.DIGITS))
    return [i for i, t in enumerate(response) if mask[i] and t in digits]


def warm_start(model, tok, builder, table: dict, cfg, steps: int, batch: int, lr: float, questions: int = 1,
               shortcuts: dict[str, float] | None = None, seed: int = 0, time_budget_s: float | None = None,
               target: float | None = None, eval_every: int = 10, eval_size: int = 16, log_every: int = 10
               ) -> list[dict]:
    """Supervised steps on demonstrations (model turns only; ``questions`` questions asked in turn per
    conversation, so one system prompt serves several lookups), stopped at the first held-out evaluation whose
    mean p(correct) over the copied tokens of right trajectories (``decision_positions``) reaches ``target``.

    ``shortcuts``: the fraction of conversations whose first question (the one RL asks) is demonstrated by a
    ``GUESS`` or a ``ONE_LOOKUP`` instead of the right two lookups; the follow-up questions are always right. GRPO
    starts from a policy that has the tool-call format, copies keys and values part of the time, and takes a
    shortcut on a fraction of its first questions: it has both to learn."""
    import random

    import torch

    torch.manual_seed(seed)
    rng = random.Random(f"demonstrations-{seed}")
    kinds, weights = zip(*({RIGHT: 1.0 - sum((shortcuts or {}).values()), **(shortcuts or {})}).items(), strict=True)
    if min(weights) < 0:
        raise ValueError(f"shortcuts {shortcuts}: fractions must be >= 0 and sum to at most 1")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))

    def encode(rows, questions: int = 1, demonstrate: bool = False):
        seqs = [demonstrated_trajectory(builder, tok, rows[i], table, rows[i + 1: i + questions],
                                        rng.choices(kinds, weights)[0] if demonstrate else RIGHT, rng)
                for i in range(0, len(rows), questions)]
        # labels: the model's turns only
        ids, labels = kv.pad_batch(
            [(p + r, [-100] * len(p) + [t if on else -100 for t, on in zip(r, m, strict=True)]) for p, r, m in seqs],
            tok.pad_token_id)
        return ids, labels, [[len(p) + j for j in decision_positions(r, m, tok)] for p, r, m in seqs]

    evals = encode(task.make_rows(table, eval_size, "warmup-eval", seed))
    best = {"score": -1.0, "state": None, "step": 0}

    def evaluate() -> float:
        ids, _, decisions = evals
        model.eval()
        with torch.no_grad():
            lp = model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)
            p = [lp[i, j - 1, ids[i, j]].exp().item() for i, pos in enumerate(decisions) for j in pos]
        model.train()
        return sum(p) / len(p)

    model.train()
    hist, t0 = [], time.time()
    for step in range(1, steps + 1):
        frac = kv.spent(step, steps, t0, time_budget_s)
        kv.set_lr(opt, lr, min(1.0, step / 10), frac)
        # curriculum: the catalog in the system prompt grows from 16 keys to the table's over the first 60%
        catalog = int(min(len(table), 16 * (len(table) / 16) ** min(1.0, frac / 0.6)))
        rows = task.make_rows(table, batch * questions, f"warmup-{step}", seed, catalog=catalog)
        ids, labels, _ = encode(rows, questions, demonstrate=True)
        out = kv.supervised_step(model, opt, ids, labels)
        done = kv.spent(step, steps, t0, time_budget_s) >= 1
        if step % log_every == 0 or done:
            rec = {"step": step, "catalog": catalog, "loss": round(out.loss.item(), 4),
                   "elapsed_s": round(time.time() - t0, 1)}
            hist.append(rec)
            print(f"[warm-up] step {step} catalog={catalog} keys, loss={rec['loss']:.3f} {rec['elapsed_s']:.0f}s",
                  flush=True)
        if done or step % eval_every == 0:
            score = evaluate()
            best, reached = kv.keep_best(best, score, step, model, target, "held-out p(correct copied token)")
            done = done or reached
        if done:
            break
    kv.restore_best(model, best, hist, "heldout_p_correct_copied_token", "held-out p(correct copied token)")
    model.eval()
    return hist


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="runs/tool_lookup")
    ap.add_argument("--num-records", type=int, default=128,
                    help="records in the table (system prompt ~3 x num + 140 tokens)")
    ap.add_argument("--train-size", type=int, default=1024)
    ap.add_argument("--val-size", type=int, default=32)
    kv.add_model_args(ap)
    ap.add_argument("--warmup-steps", type=int, default=300,
                    help="supervised steps (the target usually ends it sooner)")
    ap.add_argument("--warmup-target", type=float, default=0.6,
                    help="stop once held-out p(correct copied token) reaches this (0: never)")
    ap.add_argument("--warmup-batch", type=int, default=8, help="conversations per step")
    ap.add_argument("--warmup-questions", type=int, default=4,
                    help="questions per warm-up conversation (the first as in RL, then follow-ups)")
    ap.add_argument("--warmup-lr", type=float, default=3e-3)
    ap.add_argument("--guess-fraction", type=float, default=0.5,
                    help="warm-up conversations whose first question is answered by a guess, with no lookup")
    ap.add_argument("--one-lookup-fraction", type=float, default=0.3,
                    help="warm-up conversations whose first question is answered after one lookup (a hop short)")
    ap.add_argument("--warmup-time-budget", type=float, default=360.0, help="seconds (0: no limit)")
    args = ap.parse_args(argv)
    kv.torch_threads(args.threads)
    cfg = task.TaskConfig(num_records=args.num_records, seed=args.seed)
    wd = os.path.abspath(args.workdir)
    data_dir, model_dir = os.path.join(wd, "data"), os.path.join(wd, "model")
    table_path = os.path.join(data_dir, "table.json")
    tok = task.build_tokenizer()

    if args.force or not os.path.exists(os.path.join(data_dir, "task.json")):
        table = task.make_table(cfg)
        os.makedirs(data_dir, exist_ok=True)
        with open(table_path, "w") as f:
            json.dump(table, f)
        task.write_parquet(task.make_rows(table, args.train_size, "train", args.seed),
                           os.path.join(data_dir, "train.parquet"))
        task.write_parquet(task.make_rows(table, args.val_size, "val", args.seed),
                           os.path.join(data_dir, "val.parquet"))
        [row] = task.make_rows(table, 1, "train", args.seed)
        text = tok.apply_chat_template(row["prompt"], tools=[task.TOOL_SCHEMA], add_generation_prompt=True,
                                       tokenize=False)
        prompt_tokens = len(tok(text, add_special_tokens=False)["input_ids"])
        with open(os.path.join(data_dir, "task.json"), "w") as f:
            json.dump({**json.loads(cfg.to_json()), "prompt_tokens": prompt_tokens}, f)
        print(f"[prepare] data: table of {cfg.num_records} records, {args.train_size} train / {args.val_size} val "
              f"questions, {prompt_tokens}-token prompts -> {data_dir}", flush=True)
    else:
        print(f"[prepare] data present: {data_dir}", flush=True)

    done = os.path.join(model_dir, "warmup.json")
    if args.force or not os.path.exists(done):
        import torch
        from transformers import AutoModelForCausalLM
        from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

        with open(table_path) as f:
            table = json.load(f)
        torch.manual_seed(args.seed)
        mcfg = kv.model_config(len(tok), tok, hidden=args.hidden, layers=args.layers)
        model = AutoModelForCausalLM.from_config(mcfg, dtype=torch.float32)
        with torch.no_grad():  # unembedding = embedding at init (untied: vLLM's Qwen3-Next has no tied head): the
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)  # residual path copies a token from the start
        print(f"[prepare] model: qwen3_next {args.layers} layers, hidden {args.hidden}, "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, vocab {len(tok)}", flush=True)
        # the builder veRL's agent loop picks for this model type (the generic one: no Qwen turn separator)
        builder = create_continuous_token_builder(tok, hf_model_type=mcfg.model_type)
        hist = []
        if args.warmup_steps > 0:
            hist = warm_start(model, tok, builder, table, cfg, args.warmup_steps, args.warmup_batch, args.warmup_lr,
                              questions=args.warmup_questions,
                              shortcuts={GUESS: args.guess_fraction, ONE_LOOKUP: args.one_lookup_fraction},
                              seed=args.seed,
                              time_budget_s=args.warmup_time_budget or None, target=args.warmup_target or None)
        kv.save_model(model, tok, model_dir, cfg.to_json(), hist)
    else:
        print(f"[prepare] model present: {model_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
