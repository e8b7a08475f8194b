"""Key/value retrieval over a long prompt: data generator, tokenizer and chat format.

A prompt lists ``num_pairs`` random key/value pairs (``k123 4 0 7 1``) and ends with
a query key; the answer is that key's value (``value_len`` digits). Answering needs
the whole prompt: the queried pair sits anywhere in it. Everything is generated
locally from a seed; nothing is downloaded.

Shared memory (``shared_memory_block`` N > 0): consecutive blocks of N prompts share one
document (the same pairs in the same order; an agent's memory) and each asks a different
key of it. The document comes first and the question last, so the prompts of a block share
every token up to the queried key.

Word-level vocabulary: one token per key, digit and marker, so a prompt of N pairs is
about ``N * (1 + value_len)`` tokens.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass

DATA_SOURCE = "longstraw/kv_retrieval"

PAD, UNK = "<pad>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL = [PAD, UNK, IM_START, IM_END]
MARKERS = ["user", "assistant", "system", "query", "answer", ";"]
DIGITS = [str(d) for d in range(10)]

# A chat template over the word-level vocabulary: tokens are separated by spaces.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|> ' + message['role'] + ' ' + message['content'] + ' <|im_end|> ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|> assistant ' }}{% endif %}"
)


@dataclass(frozen=True)
class TaskConfig:
    num_keys: int = 1024  # size of the key vocabulary (k0000 ... )
    value_len: int = 3  # digits per value
    num_pairs: int = 400  # pairs per prompt (prompt ~ num_pairs * (1 + value_len) tokens)
    # Keys k0000..k{num_query_keys-1} are "query keys": each prompt holds exactly one of them,
    # at a random position among distractor pairs, and asks for its value (shared memory: a
    # document of N prompts holds N of them, one asked by each). 0 = the query is any key of
    # the prompt (classic associative recall: far slower for a tiny model to learn).
    num_query_keys: int = 16
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def key_token(i: int) -> str:
    return f"k{i:04d}"


def vocabulary(num_keys: int) -> list[str]:
    return SPECIAL + MARKERS + DIGITS + [key_token(i) for i in range(num_keys)]


def make_document(rng: random.Random, cfg: TaskConfig, num_queries: int = 1,
                  num_pairs: int | None = None) -> list[dict]:
    """One document of ``num_pairs`` pairs and ``num_queries`` examples on it, each asking another key.

    With query keys (``cfg.num_query_keys > 0``) the document holds exactly ``num_queries`` of
    them, at random positions among distractor pairs, and example j asks the j-th placed; without,
    the examples ask distinct random keys. Example: ``content`` (pairs, then ``query kXXXX``),
    ``answer``, ``query_index`` (pair index of the queried key), ``num_pairs``.
    """
    n = cfg.num_pairs if num_pairs is None else num_pairs
    nq = cfg.num_query_keys
    if not 1 <= num_queries <= n:
        raise ValueError(f"num_queries={num_queries} must be between 1 and the document's {n} pairs "
                         "(shared memory: give at least as many pairs as prompts per document)")
    if nq > 0:
        if num_queries > nq:
            raise ValueError(f"num_queries={num_queries} exceeds num_query_keys={nq}: a document holds each "
                             "query key once; raise --num-query-keys or lower the prompts per document")
        keys = rng.sample(range(nq, cfg.num_keys), n - num_queries)
        asked: list[int] = []
        for placed in range(num_queries):
            pos = rng.randrange(n - num_queries + placed + 1)
            asked.append(rng.choice([k for k in range(nq) if k not in asked]))
            keys.insert(pos, asked[-1])
        queries = [keys.index(k) for k in asked]
    else:
        keys = rng.sample(range(cfg.num_keys), n)
        queries = rng.sample(range(n), num_queries)
    values = [" ".join(rng.choice(DIGITS) for _ in range(cfg.value_len)) for _ in range(n)]
    body = " ".join(f"{key_token(k)} {v}" for k, v in zip(keys, values, strict=True))
    return [{"content": f"{body} query {key_token(keys[q])}", "answer": values[q], "query_index": q,
             "num_pairs": n} for q in queries]


def make_examples(rng: random.Random, cfg: TaskConfig, count: int, shared_memory_block: int = 0,
                  num_pairs: int | None = None) -> list[dict]:
    """``count`` examples (``make_document``); consecutive blocks of ``shared_memory_block`` share one
    document (0: a document each). A ``count`` that is not a multiple of the block cuts the last block."""
    examples: list[dict] = []
    while len(examples) < count:
        examples += make_document(rng, cfg, shared_memory_block or 1, num_pairs)
    return examples[:count]


def make_rows(cfg: TaskConfig, count: int, split: str, seed_offset: int = 0,
              shared_memory_block: int = 0) -> list[dict]:
    """Rows in veRL's RL dataset format (chat ``prompt``, ``reward_model.ground_truth``); rows
    ``[b * N, (b + 1) * N)`` share one document when ``shared_memory_block`` is N > 0."""
    rng = random.Random(f"{cfg.seed}-{split}-{seed_offset}")
    rows = []
    for i, ex in enumerate(make_examples(rng, cfg, count, shared_memory_block)):
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": ex["content"]}],
                "ability": "retrieval",
                "reward_model": {"style": "rule", "ground_truth": ex["answer"]},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "num_pairs": ex["num_pairs"],
                    "query_index": ex["query_index"],
                },
            }
        )
    return rows


def write_parquet(rows: list[dict], path: str) -> None:
    import pandas as pd

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)


def build_tokenizer(num_keys: int, max_length: int = 32768):
    """A word-level ``PreTrainedTokenizerFast`` with a chat template, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary(num_keys))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=IM_END,
        bos_token=None,
        additional_special_tokens=[IM_START],
        model_max_length=max_length,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
