"""The multi-turn tool-use recipe (recipes/tool_lookup): tokenizer and chat template against veRL's hermes parser and
Continuous Token builder, the lookup tool through veRL's tool registry, the reward (tool output never credited), the
summary; the longstraw engine == stock fsdp2 on the recipe's own agent-loop batches, whose response_mask has holes
where the tool's answers are; and a 2-step run of `bash recipes/tool_lookup/run.sh` (LONGSTRAW_E2E=0 skips it).

What tests/integration already covered for response_mask holes, and what this file adds:
- covered: ``verl_harness.make_batch`` (one masked token in one response; tests/integration/test_engine.py) and
  ``verl_harness.multi_turn_batch`` / ``branched_batch`` (two masked tokens per per-turn sample, masked tokens in shared
  trunks; tests/integration/test_tree_engine.py): log-probs on every position, gradients and parameters vs fsdp2.
- added here: GRPO groups of ToolAgentLoop trajectories (several multi-token tool answers per response, mask 0, built
  by veRL's own Continuous Token builder from the recipe's chat template), one long system prompt shared across the
  groups of the micro-batch, trajectories of unequal length (wrong keys, "no record" answers), on the recipe's model
  family (qwen3_next: Gated DeltaNet state carried through the masked spans) and with response segments whose
  boundaries fall inside the tool answers (``response_chunk_size``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from verl.workers.utils.padding import no_padding_2_padding

from verl_longstraw.testing.scripts import load_script
from verl_longstraw.testing.verl_harness import (
    actor_config,
    infer,
    make_engine,
    rel_diff,
    samples_batch,
    save_tiny_model,
    train_step,
)

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tool_lookup"
task, prepare, reward, summarize = (load_script(RECIPE / f"{name}.py")
                                    for name in ("task", "prepare", "reward", "summarize"))
NUM_RECORDS = 32  # a short catalog: ~240-token system prompt
TOL = 1e-5  # fp32: log-probs (absolute), gradients and parameters after the step (relative)


@pytest.fixture(scope="module")
def recipe():
    """(config, table, tokenizer, veRL's Continuous Token builder for the recipe's model type)."""
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    cfg = task.TaskConfig(num_records=NUM_RECORDS)
    tok = task.build_tokenizer()
    return cfg, task.make_table(cfg), tok, create_continuous_token_builder(tok, hf_model_type="qwen3_next")


# ---------------------------------------------------------------- task, tokenizer, tool, reward
def test_prompts_share_the_system_prompt_and_hold_no_unknown_words(recipe):
    cfg, table, tok, _ = recipe
    rows = task.make_rows(table, 4, "train")
    ids = [tok(tok.apply_chat_template(r["prompt"], tools=[task.TOOL_SCHEMA], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"] for r in rows]
    assert all(tok.unk_token_id not in x for x in ids)
    question = len(tok(task.QUESTION.format(key="0 0 0"), add_special_tokens=False)["input_ids"]) + 4
    assert len({tuple(x[:-question]) for x in ids}) == 1 and len(ids[0]) - question > 3 * NUM_RECORDS
    assert all(r["agent_name"] == "tool_agent" for r in rows)
    for r in rows:
        key = r["extra_info"]["key"]
        assert r["reward_model"]["ground_truth"] == table[table[key]["next"]]["value"]


def test_model_tool_call_decodes_to_what_verls_hermes_parser_reads(recipe):
    from verl.experimental.agent_loop.tool_parser import ToolParser

    _, _, tok, _ = recipe
    ids = tok(task.call_text("042"), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert tok.unk_token_id not in ids
    parser = ToolParser.get_tool_parser("hermes", tok)
    _, calls = asyncio.run(parser.extract_tool_calls(ids))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("lookup", {"key": " 0 4 2 "})]


def test_tool_loads_through_verls_registry_and_answers(recipe, tmp_path, monkeypatch):
    from verl.tools.tool_registry import initialize_tools_from_config

    _, table, _, _ = recipe
    (tmp_path / "table.json").write_text(json.dumps(table))
    monkeypatch.setenv("TOOL_LOOKUP_TABLE", str(tmp_path / "table.json"))
    monkeypatch.syspath_prepend(str(RECIPE))
    [tool] = initialize_tools_from_config(str(RECIPE / "tool_config.yaml"))
    assert tool.name == "lookup" and tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) == \
        task.TOOL_SCHEMA
    key = next(iter(table))
    out, _, _ = asyncio.run(tool.execute("id", {"key": f" {task.spell(key)} "}))
    assert out.text == f"{task.spell(key)} value {table[key]['value']} next {task.spell(table[key]['next'])}"
    missing = next(f"{i:03d}" for i in range(1000) if f"{i:03d}" not in table)
    assert asyncio.run(tool.execute("id", {"key": missing}))[0].text == task.NO_RECORD


def test_trajectory_masks_tool_answers_and_reward_scores_the_model_only(recipe):
    """The agent loop's layout (veRL's builder): the model's calls and answer have mask 1, the tool's turns 0. The
    reward reads the model's calls and final answer: the decoded response also holds the ground truth in the second
    tool answer, which is not credited."""
    _, table, tok, builder = recipe
    [row] = task.make_rows(table, 1, "train")
    _, response, mask = prepare.demonstrated_trajectory(builder, tok, row, table)
    words = tok.convert_ids_to_tokens(response)
    model_words = [w for w, m in zip(words, mask, strict=True) if m]
    key, truth = row["extra_info"]["key"], row["reward_model"]["ground_truth"]
    expected = (task.call_text(key) + " <|im_end|> " + task.call_text(table[key]["next"]) + " <|im_end|> " + truth
                + " <|im_end|>").split()
    assert model_words == expected
    assert [w for w, m in zip(words, mask, strict=True) if not m].count("<tool_response>") == 2
    decoded = tok.decode(response, skip_special_tokens=True)  # as veRL's reward manager decodes
    assert reward.compute_score(task.DATA_SOURCE, decoded, truth) == {"score": 1.0, "acc": 1.0, "lookups": 2.0}
    wrong = " ".join(str((int(d) + 1) % 10) for d in truth.split())  # every digit wrong
    _, response, _ = prepare.trajectory(builder, tok, row["prompt"], table, [key, table[key]["next"]], wrong)
    decoded = tok.decode(response, skip_special_tokens=True)
    assert truth in decoded and reward.compute_score(task.DATA_SOURCE, decoded, truth)["score"] == 0
    # a trajectory cut by the turn limit ends on a tool answer: nothing answered
    assert reward.final_answer(decoded.rsplit(" assistant ", 1)[0] + " assistant " + task.call_text(key)) == ""
    # with the keys (extra_info, as veRL passes the row's): a quarter per right call, half for the answer; the
    # digits of a call's key in place count
    info = row["extra_info"]
    assert reward.compute_score(task.DATA_SOURCE, decoded, truth, info)["score"] == 0.5
    hop = table[key]["next"]
    bad = hop[:2] + str((int(hop[2]) + 1) % 10)  # the second call's last digit wrong
    _, response, _ = prepare.trajectory(builder, tok, row["prompt"], table, [key, bad], truth)
    decoded = tok.decode(response, skip_special_tokens=True)
    assert reward.called_keys(decoded) == [key, bad]
    assert reward.compute_score(task.DATA_SOURCE, decoded, truth, info)["score"] == pytest.approx(0.25 + 0.25 * 2 / 3
                                                                                                   + 0.5)


def test_shortcut_demonstrations_score_below_the_right_one(recipe):
    """The warm start's shortcuts on a first question: a guess calls no tool and answers digits, one lookup answers
    the first record's value; both are well-formed trajectories the reward scores below the right one, and the
    follow-up questions of a conversation are always demonstrated right."""
    _, table, tok, builder = recipe
    row, follow_up = task.make_rows(table, 2, "train")
    key, truth, info = row["extra_info"]["key"], row["reward_model"]["ground_truth"], row["extra_info"]
    scores = {}
    for kind in (prepare.RIGHT, prepare.GUESS, prepare.ONE_LOOKUP):
        _, response, mask = prepare.demonstrated_trajectory(builder, tok, row, table, [follow_up], kind,
                                                            random.Random(0))
        first = tok.decode(response, skip_special_tokens=True).split(" user ")[0]
        calls = reward.called_keys(first)
        assert calls == {prepare.RIGHT: [key, table[key]["next"]], prepare.GUESS: [],
                         prepare.ONE_LOOKUP: [key]}[kind]
        scores[kind] = reward.compute_score(task.DATA_SOURCE, first, truth, info)["score"]
        model_words = " ".join(w for w, m in zip(tok.convert_ids_to_tokens(response), mask, strict=True) if m)
        hop = follow_up["extra_info"]["key"]
        assert model_words.endswith(f"{task.call_text(hop)} <|im_end|> {task.call_text(table[hop]['next'])} "
                                    f"<|im_end|> {follow_up['reward_model']['ground_truth']} <|im_end|>")
    assert scores[prepare.RIGHT] == 1.0
    assert scores[prepare.ONE_LOOKUP] < 0.5 and scores[prepare.GUESS] <= 0.5
    with pytest.raises(ValueError, match="demonstration kind"):
        prepare.demonstration(row, table, "skip")


def test_summary_prints_tokens_against_star_and_unshared(tmp_path, capsys):
    (tmp_path / "metrics").mkdir()
    with open(tmp_path / "metrics" / "attempt-a.jsonl", "w") as f:
        for step in (1, 2, 3):
            data = {"critic/score/mean": 0.1 * step, "timing_s/step": 10.0, "timing_s/gen": 4.0,
                    "num_turns/mean": 4.0 + step,
                    "actor/longstraw/tokens_forwarded": 1000.0, "actor/longstraw/star_tokens_forwarded": 2500.0}
            if step > 1:  # an engine that logs the unshared count
                data["actor/longstraw/unshared_tokens_forwarded"] = 8000.0
            f.write(json.dumps({"step": step, "data": data}) + "\n")
    out = summarize.report(str(tmp_path), 1, None)
    printed = capsys.readouterr().out
    assert out["tokens_per_step"] == pytest.approx({"tokens": 1000, "star": 2500, "unshared": 8000,
                                                    "tokens/star": 0.4, "tokens/unshared": 0.125,
                                                    "star/unshared": 2500 / 8000})
    assert "[summary]    2   0.200   6.00     1000     2500      8000      0.40      0.12      0.31" in printed
    assert "[summary]    1   0.100   5.00     1000     2500         -      0.40         -         -" in printed
    assert "[summary] reward      first 1 steps 0.100  ->  last 1 steps 0.300" in printed
    assert "[summary] turns       first 1 steps 5.00  ->  last 1 steps 7.00 per trajectory" in printed
    assert (out["turns_start"], out["turns_end"]) == (5.0, 7.0)


def _dry_run(tmp_path: Path, command: str = "verl.trainer.main_ppo", **knobs: str) -> list[str]:
    env = dict(os.environ, DRY_RUN="1", VENV=sys.prefix, WORKDIR=str(tmp_path / "wd"), **knobs)
    p = subprocess.run(["bash", str(RECIPE / "run.sh")], env=env, text=True, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return shlex.split(next(line for line in p.stdout.splitlines() if command in line))


def test_run_script_uses_verls_tool_agent_loop(tmp_path):
    prepare_args = " ".join(_dry_run(tmp_path, "prepare.py", GUESS_FRACTION="0.25"))
    assert "--guess-fraction 0.25 --one-lookup-fraction 0.3" in prepare_args
    args = _dry_run(tmp_path, STEPS="4", BATCH="3")
    for arg in ("+recipe=kv_retrieval", "actor_rollout_ref.rollout.multi_turn.enable=True",
                f"actor_rollout_ref.rollout.multi_turn.tool_config_path={RECIPE}/tool_config.yaml",
                "actor_rollout_ref.rollout.multi_turn.format=hermes",
                "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=24", "trainer.total_training_steps=4",
                f"reward.custom_reward_function.path={RECIPE}/reward.py", "actor_rollout_ref.actor.strategy=longstraw"):
        assert arg in args, arg


# ---------------------------------------------------------------- engine: response_mask holes vs stock fsdp2
def agent_batch(recipe, groups: int = 2, group_size: int = 4, seed: int = 0):
    """GRPO groups of tool-lookup trajectories in veRL's batch layout: each group one question (the shared system
    prompt + the question), its responses the model's calls (mask 1) and the tool's answers (mask 0) as veRL's
    agent loop lays them out, with wrong keys ("no record", another record), skipped second lookups and wrong
    answers, so responses differ in length and in where their holes are."""
    _, table, tok, builder = recipe
    rng = random.Random(seed)
    prompts, responses, masks, uids = [], [], [], []
    for k, row in enumerate(task.make_rows(table, groups, "engine", seed)):
        key = row["extra_info"]["key"]
        for i in range(group_size):
            keys = [key, table[key]["next"]]
            if i % 4 == 1:
                keys[1] = next(f"{j:03d}" for j in range(1000) if f"{j:03d}" not in table)  # no record
            elif i % 4 == 2:
                keys = keys[:1]  # answers after one lookup
            elif i % 4 == 3:
                keys[1] = rng.choice(list(table))
            answer = " ".join(rng.choice(task.DIGITS) for _ in range(3))
            p, r, m = prepare.trajectory(builder, tok, row["prompt"], table, keys, answer)
            prompts.append(torch.tensor(p))
            responses.append(torch.tensor(r))
            masks.append(torch.tensor(m))
            uids.append(f"group-{k}")
    holes = [(m == 0).sum().item() for m in masks]
    assert min(holes) >= 11 and all(m[-1] == 1 for m in masks)
    return samples_batch(prompts, responses, uids, torch.Generator().manual_seed(seed), response_masks=masks)


@pytest.fixture(scope="module")
def engines(dist, recipe, tmp_path_factory):
    """(stock fsdp2, longstraw with the default min_shared_tokens) on a tiny qwen3_next over the recipe's vocabulary,
    one micro-batch of the whole batch (8 rows: 2 groups x 4)."""
    _, _, tok, _ = recipe
    path = save_tiny_model("qwen3_next", str(tmp_path_factory.mktemp("tool_lookup_model")), vocab_size=len(tok))
    stock = make_engine("fsdp2", path, actor_config("fsdp2", "token-mean", False, 0.0, 8), 8)
    longstraw = make_engine("longstraw", path, actor_config("longstraw", "token-mean", False, 0.0, 8), 8)
    return stock, longstraw


def test_agent_batch_log_probs_match_fsdp2_on_every_response_token(engines, recipe):
    """compute_log_prob on the agent-loop batch: every response position, the tool answers' and the tokens after
    them included, and the entropies; the system prompt is forwarded once for both groups."""
    stock, longstraw = engines
    td = agent_batch(recipe, seed=1)
    a = infer(stock, td.clone(), len(td))["model_output"]
    out = infer(longstraw, td.clone(), len(td))
    mask = td["response_mask"]
    # the final answer: mask-1 positions after as many holes as the last mask-1 position (right padding has mask 0)
    holes_before = (1 - mask).cumsum(-1)
    last = (mask * torch.arange(1, mask.shape[-1] + 1)).argmax(-1, keepdim=True)
    answer = mask.bool() & (holes_before == holes_before.gather(-1, last))
    assert (answer.sum(-1) == 4).all()  # 3 digits + eos after the tool answers
    for key in ("log_probs", "entropy"):
        x, y = no_padding_2_padding(a[key], td), no_padding_2_padding(out["model_output"][key], td)
        assert (x - y).abs().max().item() <= TOL, key
        assert (x - y)[answer].abs().max().item() <= TOL and (x - y)[holes_before > 0].abs().max().item() <= TOL
    metrics = out["metrics"]
    assert sum(metrics["longstraw/tokens_forwarded"].values) < sum(metrics["longstraw/star_tokens_forwarded"].values)


@pytest.mark.parametrize("response_chunk_size", [None, 5], ids=["whole", "segments_of_5"])
def test_agent_batch_update_actor_matches_fsdp2(engines, recipe, response_chunk_size):
    """One update_actor step with KL loss and entropy: the gradient and the parameters fsdp2 reaches; response
    segments of 5 tokens put segment boundaries inside the tool answers."""
    stock, longstraw = engines
    td = agent_batch(recipe, seed=2)
    cfg_s, cfg_l = (actor_config(s, "token-mean", True, 0.01, len(td)) for s in ("fsdp2", "longstraw"))
    knobs = longstraw.longstraw
    longstraw.longstraw = dataclasses.replace(knobs, response_chunk_size=response_chunk_size)
    try:
        gs, ps, _ = train_step(stock, td.clone(), cfg_s, len(td))
        gl, pl, metrics = train_step(longstraw, td.clone(), cfg_l, len(td))
    finally:
        longstraw.longstraw = knobs
    assert rel_diff(gl, gs) <= TOL
    assert rel_diff(pl, ps) <= TOL
    assert sum(metrics["longstraw/tokens_forwarded"].values) < sum(metrics["longstraw/star_tokens_forwarded"].values)


# ---------------------------------------------------------------- 2 GRPO steps through run.sh
E2E = pytest.mark.skipif(os.environ.get("LONGSTRAW_E2E") == "0", reason="end-to-end run switched off (LONGSTRAW_E2E=0)")
# 2 questions x 8 trajectories, a 64-record table (~200-token prompts), a 30-step warm start (the call format)
E2E_ENV = {"STEPS": "1", "BATCH": "2", "NUM_RECORDS": str(NUM_RECORDS), "WARMUP_STEPS": "30", "WARMUP_TARGET": "0",
           "SAVE_FREQ": "1"}


@E2E
def test_e2e_one_grpo_step(tmp_path, monkeypatch):
    """`run.sh` for one step (a second one, after an update, is tests/test_main_job.py's resumed step): veRL's
    ToolAgentLoop runs the lookup tool (tool calls made, more than one turn), the reward and LongStraw's token counts
    are logged, the shared system prompt forwarded once (fewer tokens than the star path), and a checkpoint is
    written."""
    env = dict(os.environ, **E2E_ENV, WORKDIR=str(tmp_path / "wd"))
    # the kv_retrieval recipe's runner (its own session, killed past the timeout, ONEDNN_MAX_CPU_ISA left out),
    # on this recipe's run.sh
    main_job = load_script(REPO / "tests" / "test_main_job.py")
    monkeypatch.setattr(main_job, "RECIPE", RECIPE)
    out = main_job._run_recipe(env).stdout  # its default timeout: a hang guard, far above a busy box's run
    kv = summarize.kv
    assert kv.checkpoint_state(env["WORKDIR"], 1) == ("done", 1)
    steps = kv.load_metrics(env["WORKDIR"])
    assert sorted(steps) == [1]
    for data in steps.values():
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm"):
            assert math.isfinite(data[key]), key
        assert data["num_turns/max"] > 2  # the agent loop ran the tool: assistant, tool, assistant, ...
        assert data[kv.TOKENS] < data[kv.STAR_TOKENS]
    assert "[summary] tokens per step (mean)" in out and "unshared" in out
