"""The kv_retrieval recipe (recipes/kv_retrieval): task generator, reward, model builder,
checkpoint/resume detection and metric merging of the one-command run.

The real GRPO run lives behind `bash recipes/kv_retrieval/run.sh`. All tests but the last are fast
(well under 2 minutes on 2 cores). The last runs by default (opt out with LONGSTRAW_E2E=0): the recipe
for one step, then a resume for a second, through `python -m verl.trainer.main_ppo --config-name
longstraw_grpo` with vLLM-CPU rollout (a few minutes, needs .venv-cpu). The context-parallel job runs in
tests/integration/test_two_nodes.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from verl_longstraw.testing.scripts import load_script

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "kv_retrieval"
reward, summarize, task = (load_script(RECIPE / f"{name}.py") for name in ("reward", "summarize", "task"))


# ---------------------------------------------------------------- task generator
def test_example_holds_answer_after_queried_key():
    cfg = task.TaskConfig(num_pairs=50, num_query_keys=16)
    rng = random.Random(0)
    for _ in range(20):
        [ex] = task.make_document(rng, cfg)
        words = ex["content"].split()
        assert words[-2] == "query"
        qkey = words[-1]
        body = words[:-2]
        assert len(body) == 50 * (1 + cfg.value_len)
        keys = body[:: 1 + cfg.value_len]
        assert len(set(keys)) == len(keys), "keys are unique within a prompt"
        # exactly one key from the query set, and it is the queried one
        qset = {task.key_token(i) for i in range(cfg.num_query_keys)}
        assert [k for k in keys if k in qset] == [qkey]
        i = body.index(qkey)
        assert " ".join(body[i + 1 : i + 1 + cfg.value_len]) == ex["answer"]


def test_associative_recall_variant_queries_any_key():
    cfg = task.TaskConfig(num_pairs=30, num_query_keys=0)
    [ex] = task.make_document(random.Random(1), cfg)
    words = ex["content"].split()
    i = words.index(words[-1])
    assert i < len(words) - 1 and " ".join(words[i + 1 : i + 1 + cfg.value_len]) == ex["answer"]


def test_rows_follow_verl_rl_dataset_format_and_are_deterministic():
    cfg = task.TaskConfig(num_pairs=10)
    rows = task.make_rows(cfg, 4, "train")
    assert rows == task.make_rows(cfg, 4, "train")
    assert rows != task.make_rows(cfg, 4, "val")
    r = rows[0]
    assert r["data_source"] == task.DATA_SOURCE
    assert r["prompt"][0]["role"] == "user" and "query" in r["prompt"][0]["content"]
    assert r["reward_model"]["style"] == "rule"
    assert len(r["reward_model"]["ground_truth"].split()) == cfg.value_len
    assert {"index", "split", "num_pairs"} <= set(r["extra_info"])


def test_shared_memory_rows_share_one_document_and_ask_distinct_keys():
    """MEMORY=shared: each block of N rows is one document (same pairs, same order) holding N query keys, each
    row asking another; the chat-formatted prompts of a block share every token up to the queried key."""
    pytest.importorskip("transformers")
    cfg = task.TaskConfig(num_keys=64, num_pairs=12, num_query_keys=8)
    block = 4
    rows = task.make_rows(cfg, 3 * block, "train", shared_memory_block=block)
    assert rows == task.make_rows(cfg, 3 * block, "train", shared_memory_block=block)
    assert [r["extra_info"]["index"] for r in rows] == list(range(3 * block))
    qset = {task.key_token(i) for i in range(cfg.num_query_keys)}
    tok = task.build_tokenizer(cfg.num_keys)
    documents = []
    for b in range(3):
        words = [r["prompt"][0]["content"].split() for r in rows[b * block : (b + 1) * block]]
        body = words[0][:-2]
        assert all(w[:-2] == body and w[-2] == "query" for w in words), "one document per block"
        keys = body[:: 1 + cfg.value_len]
        asked = [w[-1] for w in words]
        assert sorted(k for k in keys if k in qset) == sorted(asked) and len(set(asked)) == block
        for r, key in zip(rows[b * block : (b + 1) * block], asked, strict=True):
            i = body.index(key)
            assert " ".join(body[i + 1 : i + 1 + cfg.value_len]) == r["reward_model"]["ground_truth"]
        ids = [tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for r in rows[b * block : (b + 1) * block]]
        query = len(ids[0]) - 4  # the queried key, then "<|im_end|> <|im_start|> assistant"
        assert all(x[:query] == ids[0][:query] for x in ids) and len({x[query] for x in ids}) == block
        documents.append(" ".join(body))
    assert len(set(documents)) == 3
    with pytest.raises(ValueError, match="num_query_keys"):
        task.make_rows(cfg, 9, "train", shared_memory_block=9)


def test_parquet_roundtrip(tmp_path):
    pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    import pandas as pd

    rows = task.make_rows(task.TaskConfig(num_pairs=5), 3, "train")
    task.write_parquet(rows, str(tmp_path / "d" / "train.parquet"))
    df = pd.read_parquet(tmp_path / "d" / "train.parquet")
    assert len(df) == 3 and list(df.iloc[0]["prompt"])[0]["role"] == "user"
    assert df.iloc[1]["reward_model"]["ground_truth"] == rows[1]["reward_model"]["ground_truth"]


# ---------------------------------------------------------------- reward
@pytest.mark.parametrize(
    "response, expected",
    [
        ("4 0 7", 1.0),
        ("4 0 7 <|im_end|>", 1.0),
        (" 4  0 7\n", 1.0),
        ("4 0 1", 2 / 3),
        ("1 2 3", 0.0),
        ("4 0", 2 / 3 - 0.1),
        ("4 0 7 7", 1.0 - 0.1),
        ("", 0.0),
        ("k0001 k0002 k0003 k0004 k0005 k0006 k0007 k0008", 0.0),
    ],
)
def test_reward_partial_credit(response, expected):
    assert reward.score(response, "4 0 7") == pytest.approx(expected)


def test_compute_score_matches_verl_custom_reward_signature():
    out = reward.compute_score(data_source=task.DATA_SOURCE, solution_str="4 0 7",
                               ground_truth="4 0 7", extra_info={"index": 0})
    assert out == {"score": 1.0, "acc": 1.0}
    assert reward.compute_score(task.DATA_SOURCE, "4 0 1", "4 0 7")["acc"] == 0.0


def test_reward_file_loads_standalone_like_verl():
    spec = importlib.util.spec_from_file_location("custom_module", RECIPE / "reward.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.compute_score("x", "1 2 3", "1 2 3")["score"] == 1.0


# ---------------------------------------------------------------- tokenizer + model
def test_tokenizer_chat_template_and_decode():
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    tok = task.build_tokenizer(64)
    [ex] = task.make_document(random.Random(0), task.TaskConfig(num_keys=64, num_pairs=8))
    text = tok.apply_chat_template([{"role": "user", "content": ex["content"]}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    assert len(ids) == 8 * 4 + 2 + 5  # pairs, "query kX", chat markers
    assert ids[-1] == tok.convert_tokens_to_ids("assistant")
    ans = tok(ex["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert reward.score(tok.decode(ans, skip_special_tokens=True), ex["answer"]) == 1.0


def test_prepare_builds_loadable_hybrid_model(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("pandas")
    prepare = load_script(RECIPE / "prepare.py")

    wd = tmp_path / "wd"
    rc = prepare.main(["--workdir", str(wd), "--num-pairs", "6", "--num-keys", "64", "--train-size", "4",
                       "--val-size", "2", "--hidden", "64", "--layers", "2", "--warmup-steps", "2",
                       "--warmup-batch", "2", "--warmup-min-pairs", "1", "--warmup-max-pairs", "3",
                       "--threads", "1"])
    assert rc == 0
    for f in ("data/train.parquet", "data/val.parquet", "model/config.json", "model/tokenizer.json",
              "model/warmup.json"):
        assert (wd / f).exists(), f
    cfg = json.loads((wd / "model" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_next" and cfg["head_dim"] == 64
    assert set(cfg["layer_types"]) == {"linear_attention", "full_attention"}
    # vLLM's Qwen3-Next needs at least one MoE layer
    assert cfg["num_experts"] > 0 and len(cfg["mlp_only_layers"]) < cfg["num_hidden_layers"]
    model = transformers.AutoModelForCausalLM.from_pretrained(wd / "model")
    tok = transformers.AutoTokenizer.from_pretrained(wd / "model")
    ids = torch.tensor([tok("k0001 1 2 3 query k0001", add_special_tokens=False)["input_ids"]])
    assert model(input_ids=ids).logits.shape[-1] == cfg["vocab_size"]
    # a second call reuses what exists
    mtime = (wd / "model" / "config.json").stat().st_mtime
    assert prepare.main(["--workdir", str(wd)]) == 0
    assert (wd / "model" / "config.json").stat().st_mtime == mtime


# ---------------------------------------------------------------- resume + metrics
def _fake_checkpoint(wd: Path, step: int) -> None:
    ck = wd / "checkpoints"
    (ck / f"global_step_{step}" / "actor").mkdir(parents=True, exist_ok=True)
    (ck / "latest_checkpointed_iteration.txt").write_text(str(step))


def test_checkpoint_state(tmp_path):
    assert summarize.checkpoint_state(str(tmp_path), 10) == ("fresh", 0)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("4")
    assert summarize.checkpoint_state(str(tmp_path), 10) == ("fresh", 0)  # folder missing
    _fake_checkpoint(tmp_path, 4)
    assert summarize.checkpoint_state(str(tmp_path), 10) == ("resume", 4)
    _fake_checkpoint(tmp_path, 10)
    assert summarize.checkpoint_state(str(tmp_path), 10) == ("done", 10)


def _write_attempt(wd: Path, name: str, steps: dict[int, float], mtime: float, cut_last_line=False):
    m = wd / "metrics"
    m.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": s, "data": {"critic/score/mean": r, "timing_s/step": 2.0,
                                             "reward_extra_info/acc/mean": r / 2}}) for s, r in steps.items()]
    text = "\n".join(lines) + "\n"
    if cut_last_line:
        text = text[:-10]
    (m / name).write_text(text)
    os.utime(m / name, (mtime, mtime))


def test_report_merges_attempts_later_wins(tmp_path):
    # attempt 1 ran steps 1-5 and died in step 6 (line cut); checkpoint at 4; attempt 2 redid 5-8
    _write_attempt(tmp_path, "attempt-a.jsonl", {1: 0.1, 2: 0.2, 3: 0.2, 4: 0.3, 5: 0.0, 6: 0.0}, 1000,
                   cut_last_line=True)
    _write_attempt(tmp_path, "attempt-b.jsonl", {5: 0.5, 6: 0.6, 7: 0.7, 8: 0.8}, 2000)
    _fake_checkpoint(tmp_path, 8)
    merged = summarize.load_metrics(str(tmp_path))
    assert list(merged) == list(range(1, 9))
    assert merged[5]["critic/score/mean"] == 0.5
    out = summarize.report(str(tmp_path), window=2, png=str(tmp_path / "curve.png"))
    assert out["reward_start"] == pytest.approx(0.15) and out["reward_end"] == pytest.approx(0.75)
    assert out["exact_end"] == pytest.approx(0.375)
    assert out["checkpoint"].endswith("global_step_8")
    assert "tokens_forwarded" not in out  # logged by the longstraw engine only
    assert json.loads((tmp_path / "summary.json").read_text())["last_step"] == 8
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "curve.png").stat().st_size > 1000


def test_report_names_the_machine_and_splits_the_step(tmp_path, monkeypatch, capsys):
    phases = {"gen": 2.0, "old_log_prob": 1.0, "update_actor": 6.0, "update_weights": 0.02}
    parts = {"capture_seconds": 1.0, "replay_seconds": 1.0, "prompt_backward_seconds": 3.0,
             "tokens_forwarded": 1000.0, "star_tokens_forwarded": 4000.0}
    (tmp_path / "metrics").mkdir()
    with open(tmp_path / "metrics" / "attempt-a.jsonl", "w") as f:
        for step, scale in ((1, 5.0), (2, 1.0), (3, 1.0)):  # step 1: warm-up, left out of the split
            data = {f"timing_s/{p}": s * scale for p, s in phases.items()}
            data |= {f"actor/longstraw/{p}": s * scale for p, s in parts.items()}
            data |= {"timing_s/step": 10.0 * scale, "critic/score/mean": 0.5}
            f.write(json.dumps({"step": step, "data": data}) + "\n")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")

    out = summarize.report(str(tmp_path), window=1, png=None)
    time = out["time"]
    assert time["steps"] == [2, 3] and time["step_seconds"] == pytest.approx(10.0)
    assert time["shares"]["update_actor"] == pytest.approx(0.6)
    assert time["shares"]["prompt backward"] == pytest.approx(0.3)
    assert "reward" not in time["shares"]  # a phase this run did not log
    printed = capsys.readouterr().out
    assert "gen 20%, old_log_prob 10%, update_actor 60% (capture 10%, replay 10%, prompt backward 30%)" in printed
    assert "update_weights" not in printed  # under half a percent of the step
    # steps 1-3 forwarded 5000, 1000, 1000 tokens against the star path's 20000, 4000, 4000
    assert out["tokens_forwarded"] == pytest.approx({"tokens": 7000 / 3, "star_tokens": 28000 / 3, "ratio": 0.25})
    assert "[summary] per step    tokens_forwarded 2333 (star 9333, 0.25x)" in printed
    machine = out["machine"]
    assert f"[summary] machine     {summarize.describe(machine)}" in printed and "ATEN_CPU_CAPABILITY=avx2" in printed
    assert json.loads((tmp_path / "summary.json").read_text())["machine"] == machine


def test_follow_prints_one_line_per_step(tmp_path):
    log = tmp_path / "train.log"
    step_line = ("(TaskRunnerV1 pid=1) step:3 - actor/entropy:1.0 - critic/score/mean:0.4375 - "
                 "reward_extra_info/acc/mean:np.float64(0.25) - response_length/mean:4.0 - "
                 "actor/longstraw/star_tokens_forwarded:12000.0 - actor/longstraw/tokens_forwarded:3000.0 - "
                 "timing_s/step:5.5\n")
    noise = "(WorkerDict pid=2) WARNING something\n"
    p = subprocess.run([sys.executable, str(RECIPE / "summarize.py"), "follow", "--log", str(log),
                        "--total-steps", "10"], input=noise + step_line, text=True, capture_output=True,
                       check=True)
    assert "step 3/10" in p.stdout and "reward 0.438" in p.stdout and "exact 0.25" in p.stdout
    assert "tokens_forwarded 3000 (star 12000, 0.25x)" in p.stdout
    assert "WARNING" not in p.stdout
    assert log.read_text() == noise + step_line


def _dry_run(tmp_path: Path, steps: int, **knobs: str) -> str:
    env = dict(os.environ, DRY_RUN="1", VENV=sys.prefix, WORKDIR=str(tmp_path / "wd"), STEPS=str(steps), **knobs)
    p = subprocess.run(["bash", str(RECIPE / "run.sh")], env=env, text=True, capture_output=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_run_script_resumes_from_last_checkpoint(tmp_path):
    wd = tmp_path / "wd"
    out = _dry_run(tmp_path, 6)
    assert "6 steps x" in out and "resuming" not in out
    cmd = next(line for line in out.splitlines() if "verl.trainer.main_ppo" in line)
    # the fixed settings (resume_mode=auto among them) come from +recipe=kv_retrieval:
    # tests/integration/test_cluster_recipes.py composes this command line
    for arg in ("+recipe=kv_retrieval", f"trainer.default_local_dir={wd}/checkpoints",
                "reward.custom_reward_function.path=", "trainer.total_training_steps=6"):
        assert arg in cmd, arg
    _fake_checkpoint(wd, 3)  # interrupted after the step-3 checkpoint
    out = _dry_run(tmp_path, 6)
    assert "resuming from checkpoint global_step_3 (of 6)" in out
    assert "verl.trainer.main_ppo" in out
    _fake_checkpoint(wd, 6)
    out = _dry_run(tmp_path, 6)
    assert "training already finished" in out and "verl.trainer.main_ppo" not in out
    assert "[summary]" in out


def _main_ppo_args(out: str) -> list[str]:
    return shlex.split(next(line for line in out.splitlines() if "verl.trainer.main_ppo" in line))


def test_run_script_shared_memory_variant(tmp_path):
    """MEMORY=shared: the default job's commands plus what keeps one document in one step: its own data (BATCH
    prompts per document, sizes that are multiples of BATCH), veRL's sequential sampler and the whole step in
    one micro-batch (BATCH x 8 responses), so LongStraw's prefix tree holds the document once."""
    default = _dry_run(tmp_path, 3, BATCH="2")
    assert "--shared-memory-block" not in default and "data.shuffle" not in default
    shared = _dry_run(tmp_path, 3, BATCH="2", MEMORY="shared")
    prepare = next(shlex.split(line) for line in shared.splitlines() if "prepare.py" in line)
    assert prepare[-6:] == ["--shared-memory-block", "2", "--train-size", "256", "--val-size", "16"]
    assert prepare[:-6] == next(shlex.split(line) for line in default.splitlines() if "prepare.py" in line)
    assert _main_ppo_args(shared) == [*_main_ppo_args(default), "data.shuffle=false",
                                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                                      "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16"]
    bad = subprocess.run(["bash", str(RECIPE / "run.sh")], env=dict(os.environ, MEMORY="both"), text=True,
                         capture_output=True, timeout=60)
    assert bad.returncode == 2 and "MEMORY=both" in bad.stderr


E2E = pytest.mark.skipif(os.environ.get("LONGSTRAW_E2E") == "0", reason="end-to-end run switched off (LONGSTRAW_E2E=0)")
# The small end-to-end job: 2 prompts x 8 responses, 100 pairs (~400-token prompts), a 40-step warm start.
E2E_ENV = {"BATCH": "2", "NUM_PAIRS": "100", "WARMUP_STEPS": "40"}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """Data, tokenizer and warm-started model of the end-to-end runs, built once (run.sh then skips its
    prepare step on a copy)."""
    wd = tmp_path_factory.mktemp("prepared")
    p = subprocess.run([sys.executable, str(RECIPE / "prepare.py"), "--workdir", str(wd), "--num-pairs",
                        E2E_ENV["NUM_PAIRS"], "--warmup-steps", E2E_ENV["WARMUP_STEPS"]],
                       text=True, capture_output=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return wd


def _run_recipe(env: dict, *overrides: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    """run.sh in its own session; on timeout the whole process group (main_ppo, Ray's driver) is killed.

    ``ONEDNN_MAX_CPU_ISA`` is left out of the job's environment: set by the AVX2 emulation on an AVX-512 machine,
    it caps oneDNN below the hardware, while vLLM-CPU's Gated DeltaNet prefill kernel chooses oneDNN's bfloat16
    brgemm from the hardware's flags, which the capped oneDNN then refuses ("BFloat16 Brgemm VNNI format is only
    supported on X64 when oneDNN ukernel is enabled and `amx` is supported"); a real AVX2 machine takes another
    kernel. The job keeps ``ATEN_CPU_CAPABILITY`` and ``MKL_ENABLE_INSTRUCTIONS``."""
    env = {key: value for key, value in env.items() if key != "ONEDNN_MAX_CPU_ISA"}
    proc = subprocess.Popen(["bash", str(RECIPE / "run.sh"), *overrides], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"run.sh ran past {timeout}s:\n{out[-4000:]}{err[-4000:]}")
    assert proc.returncode == 0, out[-4000:] + err[-4000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _workdir(prepared: Path, tmp_path: Path) -> str:
    wd = tmp_path / "wd"
    for name in ("data", "model"):
        shutil.copytree(prepared / name, wd / name)
    return str(wd)


@E2E
def test_e2e_one_step_then_resume(prepared, tmp_path):
    """One step and its checkpoint, then a second launch that resumes from it for step 2 (the fewest steps
    that run both a fresh start and a resume; the summary merges the two launches' metrics)."""
    env = dict(os.environ, WORKDIR=_workdir(prepared, tmp_path), STEPS="1", SAVE_FREQ="1", **E2E_ENV)
    p = _run_recipe(env)
    assert summarize.checkpoint_state(env["WORKDIR"], 1) == ("done", 1)
    assert any(line.startswith("[summary] machine") for line in p.stdout.splitlines())
    env["STEPS"] = "2"
    p = _run_recipe(env)
    assert "resuming from checkpoint global_step_1" in p.stdout
    assert summarize.checkpoint_state(env["WORKDIR"], 2) == ("done", 2)
    assert sorted(summarize.load_metrics(env["WORKDIR"])) == [1, 2]
    assert "update_actor" in next(line for line in p.stdout.splitlines() if line.startswith("[summary] step time"))
