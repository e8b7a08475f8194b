"""Two-hop lookups through a tool: the task, the records table, the tokenizer and its chat template.

A table of records (``kA -> value d d d, next kB``) is held by the ``lookup`` tool (``lookup_tool.py``).
A question names a key; the answer is the value of the record that key points to, so the model calls
``lookup`` on the key, reads the next key in the tool's answer, calls ``lookup`` on that, and answers its
value: three assistant turns, two tool turns. Every prompt begins with the same long system prompt
(instructions, the tool schema and the table's catalog of keys, ~900 tokens), which LongStraw's prefix tree
shares across the GRPO groups of a micro-batch. Everything is generated locally from a seed.

Word-level vocabulary (the kv_retrieval recipe's tokenizer: one token per digit and word), with the hermes
tool-call markers and JSON pieces as words (the call's JSON head ``{"name":"lookup","arguments":{"key":"`` is one
word, so the key the model copies into a call sits a few tokens after its source, as the answer's digits do). Keys and
values are spelled digit by digit, so every copy the model makes (a key from the question or from a tool answer into
a call, a value into the answer) is a copy of digits. The model writes
``<tool_call> {"name":"lookup","arguments":{"key":" 0 4 2 "}} </tool_call>`` and the tokenizer decodes it to exactly
that text, which veRL's hermes parser reads.
"""

from __future__ import annotations

import json
import os
import random
import runpy
import types
from dataclasses import asdict, dataclass

DATA_SOURCE = "longstraw/tool_lookup"
AGENT_NAME = "tool_agent"  # veRL's ToolAgentLoop
TOOL_NAME = "lookup"

PAD, UNK = "<pad>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL = [PAD, UNK, IM_START, IM_END]
TOOL_MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
DIGITS = [str(d) for d in range(10)]

INSTRUCTIONS = (
    "you are a lookup agent . the records below are held by a tool . a record has a key , a next key and a value "
    ". to answer a question about a key , call the tool on that key , then call it on the next key it returns , "
    "then answer the value of that second record : three digits and nothing else . one tool call per turn ."
)
TOOL_DESCRIPTION = "return the record of a key : its next key and its value"
KEY_DESCRIPTION = "the key of the record , three digits such as 0 4 2"
NO_RECORD = "no record"  # the tool's answer for a key outside the table
QUESTION = "question : what is the value of the record that this key points to : {key}"

# The tool's schema (OpenAI function format), as veRL hands it to the chat template in every prompt.
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": TOOL_DESCRIPTION,
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": KEY_DESCRIPTION}},
            "required": ["key"],
        },
    },
}

# Renders system + tool schemas, user, assistant (tool calls), tool (responses) over the word-level vocabulary
# (tokens separated by spaces). Tool calls of assistant messages are rendered by name only: veRL's agent loop
# appends the model's own tokens for its turns and renders only the context messages (tool responses) it adds,
# by suffix difference against a rendered prefix.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{ '<|im_start|> system ' + message['content'] }}"
    "{%- if tools -%}{{ ' tools :' }}{%- for t in tools -%}"
    "{{ ' function ' + t['function']['name'] + ' : ' + t['function']['description'] }}"
    "{%- for name, spec in t['function']['parameters']['properties'].items() -%}"
    "{{ ' parameter ' + name + ' : ' + spec['description'] }}{%- endfor -%}{%- endfor -%}"
    "{{ ' call : <tool_call> {\"name\":\"lookup\",\"arguments\":{\"key\":\" KEY \"}} </tool_call>' }}"
    "{%- endif -%}{{ ' <|im_end|> ' }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '<|im_start|> tool <tool_response> ' + message['content'] + ' </tool_response> <|im_end|> ' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<|im_start|> assistant ' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{ ' <tool_call> ' + call['function']['name'] + ' </tool_call>' }}{%- endfor -%}{{ ' <|im_end|> ' }}"
    "{%- else -%}{{ '<|im_start|> ' + message['role'] + ' ' + message['content'] + ' <|im_end|> ' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|> assistant ' }}{%- endif -%}"
)


@dataclass(frozen=True)
class TaskConfig:
    num_records: int = 128  # records in the table; the catalog in the system prompt lists their keys
    key_len: int = 3  # digits per key (keys are spelled digit by digit, like values)
    value_len: int = 3  # digits per value
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def spell(key: str) -> str:
    """A key as the model reads and writes it: its digits, one token each ("042" -> "0 4 2")."""
    return " ".join(key)


def call_text(key: str) -> str:
    """The hermes tool call the model writes for ``lookup(key)`` (words of the vocabulary)."""
    return '<tool_call> {"name":"lookup","arguments":{"key":" ' + spell(key) + ' "}} </tool_call>'


def record_text(key: str, record: dict) -> str:
    """The tool's answer for a key of the table: the value, then the next key last, so that the key the second call
    copies sits as close before it (and after as unambiguous a word) as the value the answer copies."""
    return f"{spell(key)} value {record['value']} next {spell(record['next'])}"


def make_table(cfg: TaskConfig, seed: int | None = None) -> dict[str, dict]:
    """``num_records`` records ``key -> {"next": another key, "value": "d d d"}``, keys of ``key_len`` digits, in the
    catalog's (random) order."""
    rng = random.Random(f"table-{cfg.seed if seed is None else seed}")
    keys = [f"{i:0{cfg.key_len}d}" for i in rng.sample(range(10 ** cfg.key_len), cfg.num_records)]
    table = {}
    for key in keys:
        nxt = rng.choice([k for k in keys if k != key])
        table[key] = {"next": nxt, "value": " ".join(rng.choice(DIGITS) for _ in range(cfg.value_len))}
    return table


def system_prompt(table: dict[str, dict], catalog: int | None = None) -> str:
    """The instructions and the catalog: the keys of the table (its first ``catalog`` keys; None: all)."""
    return INSTRUCTIONS + " records : " + " ".join(spell(k) for k in list(table)[:catalog])


def answer(table: dict[str, dict], key: str) -> str:
    return table[table[key]["next"]]["value"]


def make_rows(table: dict[str, dict], count: int, split: str, seed: int = 0, catalog: int | None = None) -> list[dict]:
    """Rows in veRL's RL dataset format for the ToolAgentLoop: the shared system prompt, a question, ``agent_name``
    and ``reward_model.ground_truth`` (the second record's value). ``catalog``: keys listed in the system prompt
    (the warm start's curriculum; None: all), the questions ask about those."""
    rng = random.Random(f"{seed}-{split}")
    system = system_prompt(table, catalog)
    keys = list(table)[:catalog]
    rows = []
    for i in range(count):
        key = rng.choice(keys)
        rows.append({
            "data_source": DATA_SOURCE,
            "agent_name": AGENT_NAME,
            "prompt": [{"role": "system", "content": system},
                       {"role": "user", "content": QUESTION.format(key=spell(key))}],
            "ability": "tool_use",
            "reward_model": {"style": "rule", "ground_truth": answer(table, key)},
            "extra_info": {"split": split, "index": i, "key": key, "hop": table[key]["next"]},
        })
    return rows


def write_parquet(rows: list[dict], path: str) -> None:
    import pandas as pd

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)


def _render(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
    import jinja2

    return jinja2.Environment().from_string(CHAT_TEMPLATE).render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)


def vocabulary() -> list[str]:
    """Special tokens, the words of the fixed texts (system prompt, schema, question, tool call and answer,
    rendered by the chat template) and the digits."""
    key = "042"
    conversation = [
        {"role": "system", "content": INSTRUCTIONS + " records"},
        {"role": "user", "content": QUESTION.format(key=spell(key))},
        {"role": "assistant", "content": call_text(key)},
        {"role": "tool", "content": record_text(key, {"next": key, "value": "0"})},
        {"role": "tool", "content": NO_RECORD},
    ]
    words = _render(conversation, [TOOL_SCHEMA], True).split()
    fixed = list(dict.fromkeys(w for w in words if w not in SPECIAL and w not in DIGITS))
    return SPECIAL + fixed + DIGITS


def build_tokenizer():
    """kv_retrieval's word-level ``PreTrainedTokenizerFast`` (built offline), over this task's vocabulary and with
    its tool chat template: kv_retrieval's ``build_tokenizer`` run with those two names rebound."""
    kv = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kv_retrieval", "task.py"))
    build = types.FunctionType(kv["build_tokenizer"].__code__, {**kv, "vocabulary": lambda _: vocabulary(),
                                                                  "CHAT_TEMPLATE": CHAT_TEMPLATE},
                               argdefs=kv["build_tokenizer"].__defaults__)
    return build(0)
