"""The `longstraw` engine with `context_parallel_size` 2 against veRL's stock `fsdp2` engine on the same
global batch (spawned gloo ranks under a hard timeout; tiny random-init models saved to a folder and
loaded by veRL's own model loading).

- 2 ranks, one CP group: compute_log_prob and one update_actor step (parameters after it) equal
  fsdp2's for a dense, a hybrid Gated DeltaNet and an MLA model, exact mode, token-mean and
  seq-mean-token-mean, KL loss and entropy on. Every rank of the CP group gets the same rows and
  reports data-parallel rank 0 of 1; at most two decoder layers are unsharded at any time; the
  per-rank prompt state is about 1/2 of the whole prompt's.
- 4 ranks as 2 CP groups x 2 data-parallel replicas (HSDP: shard inside a CP group), the batch's
  groups split over the two replicas: the same parity. The 2-rank run trains with one replay per
  response (single_forward), the 4-rank run with the two-pass path.
- The pre-flight check fails an oversized step on every rank before any capture.
- Prefix trees on the 2 ranks (``TREE_CASES``): a system prompt shared across GRPO groups and branched rollouts
  sharing scored response tokens, one replay per response and two passes, KL loss and entropy on: the same
  log-probs and parameters as fsdp2, fewer tokens forwarded than the star path (one GRPO group at a time).
"""

from __future__ import annotations

import os

import pytest
import torch

from verl_longstraw import Knobs
from verl_longstraw.parallel.launch import run_ranks

FAMILIES = ("qwen3", "qwen3_next", "deepseek_v3")  # dense, hybrid Gated DeltaNet, MLA
MODES = ("token-mean", "seq-mean-token-mean")
CP = 2
CHUNK = 16
PROMPTS = (24, 48)  # prompt lengths drawn from [24, 48): 2-3 chunks of 16, split over the CP ranks
SEED = 4  # a batch with a 34-token prompt: 33 captured = 16 + 16 + 1, the last token merged into the 2nd chunk
# prefix trees on R = 2: (TREE_BATCHES batch, policy loss mode, single_forward: False takes two passes). Not
# clip_cov/kl_cov: fsdp2's two ranks would pick the tokens they clip from their own halves of the rows
TREE_CASES = (("system_prompt", "vanilla", True), ("system_prompt", "gspo", False), ("branched", "geo_mean", False),
              ("branched", "cispo", True))


def _batch(rank: int, world: int):
    from verl_longstraw.testing import verl_harness as testing

    return testing.make_batch(n_groups=3, group_size=4, seed=SEED, rank=rank, world_size=world, prompt_len=PROMPTS)


def _run(strategy: str, family: str, mode: str, model_dir: str, rank: int, world: int, mbs: int, **knobs) -> dict:
    """log-probs (padded, response positions) and parameters after one step of one engine on this rank's rows."""
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_longstraw.testing import verl_harness as testing
    from verl_longstraw.testing.fsdp_probe import FsdpRecorder

    cp = knobs.get("context_parallel_size", 1)
    cfg = testing.actor_config(strategy, mode, True, 0.01, mbs, **knobs)
    engine = testing.make_engine(strategy, model_dir, cfg, mbs)
    dp_rank, dp_size = rank // cp, world // cp
    td = _batch(dp_rank, dp_size)
    recorder = FsdpRecorder(list(engine.module.model.layers))
    with recorder:
        out = testing.compute_log_prob(engine, td.clone(), mbs)
        grads, params, metrics = testing.train_step(engine, td.clone(), cfg, mbs)
    logp = no_padding_2_padding(out["log_probs"], td) * td["response_mask"]
    result = {
        "log_probs": logp,
        "grads": grads,
        "params": params,
        "max_layers_unsharded": recorder.max_layers_unsharded,
        "dispatch": (
            engine.get_data_parallel_rank(), engine.get_data_parallel_size(), engine.is_mp_src_rank_with_outputs()
        ),
    }
    if strategy == "longstraw":
        result["state_bytes"] = max(metrics["longstraw/prompt_state_bytes"].values)
        result["cp_bytes"] = sum(metrics["longstraw/cp_collective_bytes"].values)
        result["preflight"] = _preflight_error(engine, td, cfg, mbs) if mode == MODES[0] else None
    return result


def _preflight_error(engine, td, cfg, mbs: int) -> tuple[str, int]:
    """The error of a step under a 1 KiB budget, and how many captures ran before it."""
    import dataclasses

    import verl_longstraw.api as api
    from verl_longstraw.testing import verl_harness as testing

    captures = []
    original = api.capture
    api.capture = lambda *a, **k: captures.append(1) or original(*a, **k)
    engine.longstraw = dataclasses.replace(engine.longstraw, memory_budget_gb=2**-20)
    try:
        testing.train_step(engine, td.clone(), cfg, mbs)
        message = "no error"
    except MemoryError as exc:
        message = str(exc)
    finally:
        api.capture = original
    return message, len(captures)


def _whole_prompt_state(model_dir: str, td) -> dict:
    """The longest prompt's state captured by one process (the R = 1 figure): its bytes, and the
    estimate's per-rank state bytes for R = 1 and for each rank of R = CP."""
    from transformers import AutoModelForCausalLM

    from verl_longstraw import capture_prompt

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    prompts = td["prompts"]  # left-padded with 0, tokens are >= 1
    longest = prompts[int(prompts.ne(0).sum(-1).argmax())]
    prompt = longest[longest.ne(0)]
    from verl_longstraw.estimate import estimate_memory

    def estimate(cp_size: int, rank: int) -> int:
        return estimate_memory(model.config, len(prompt), 4, 8, CHUNK, "exact", torch.float32, cp_size=cp_size,
                               rank=rank).state_bytes

    return {
        "bytes": capture_prompt(model, prompt, for_backward=True, knobs=Knobs(chunk_size=CHUNK)).nbytes(),
        "estimate_whole": estimate(1, 0),
        "estimate_rank": [estimate(CP, r) for r in range(CP)],
    }


def _run_tree(strategy: str, batch: str, loss_mode: str, model_dir: str, rank: int, world: int, **knobs) -> dict:
    """log-probs (compute_log_prob, padded), parameters after one update_actor step and (longstraw) the tokens
    forwarded by this rank and by the star path, of one engine on a ``TREE_BATCHES`` batch: fsdp2 gets this
    rank's half of the rows, longstraw (one CP group) all of them in one micro-batch."""
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_longstraw.testing import verl_harness as testing

    shards = 1 if strategy == "longstraw" else world
    td = testing.TREE_BATCHES[batch](seed=3, rank=rank if shards > 1 else 0, world_size=shards)
    mbs = len(td)
    cfg = testing.actor_config(strategy, "token-mean", True, 0.01, mbs, policy_loss={"loss_mode": loss_mode}, **knobs)
    engine = testing.make_engine(strategy, model_dir, cfg, mbs)
    out = testing.infer(engine, td.clone(), mbs)
    _, params, metrics = testing.train_step(engine, td.clone(), cfg, mbs)
    result = {"log_probs": no_padding_2_padding(out["model_output"]["log_probs"], td) * td["response_mask"],
              "params": params}
    if strategy == "longstraw":
        result["tokens"] = {key: sum(metrics[f"longstraw/{key}"].values)
                            for key in ("tokens_forwarded", "star_tokens_forwarded")}
        result["single_forward"] = set(metrics["longstraw/single_forward"].values)
    return result


LORA = {"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"}


def _run_lora(strategy: str, model_dir: str, rank: int, world: int, mbs: int, **knobs) -> dict:
    """log-probs (padded) and parameters before and after one update_actor step of one engine under LoRA
    (``LORA``), on this rank's rows (fsdp2) or its CP group's (longstraw)."""
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_longstraw.testing import verl_harness as testing

    cfg = testing.actor_config(strategy, "token-mean", True, 0.01, mbs, **knobs)
    torch.manual_seed(0)  # peft draws the LoRA A matrices from the global generator: the same everywhere
    engine = testing.make_engine(strategy, model_dir, cfg, mbs, lora=LORA)
    before = {n: testing.full(p.detach()).clone() for n, p in engine.module.named_parameters()}
    td = _batch(rank, world) if strategy == "fsdp2" else _batch(0, 1)
    out = testing.compute_log_prob(engine, td.clone(), mbs)
    _, params, _ = testing.train_step(engine, td.clone(), cfg, mbs)
    return {"log_probs": no_padding_2_padding(out["log_probs"], td) * td["response_mask"], "before": before,
            "params": params}


def _worker(rank: int, world: int, model_dirs: dict[str, str], families: tuple[str, ...], modes: tuple[str, ...]):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    fsdp_mbs = 12 // world  # the stock engine: 12 rows split over every rank, one micro-batch each
    cp_mbs = 12 // (world // CP) // 2  # longstraw: 12 / (world / CP) rows per CP group, two micro-batches
    results = {}
    for family in families:
        for mode in modes:
            results[family, mode, "fsdp2"] = _run("fsdp2", family, mode, model_dirs[family], rank, world, fsdp_mbs)
            results[family, mode, "longstraw"] = _run(
                "longstraw", family, mode, model_dirs[family], rank, world, cp_mbs,
                fsdp_size=CP if world > CP else -1, context_parallel_size=CP, chunk_size=CHUNK,
                single_forward=world == CP,  # one replay per response at 2 ranks, the two-pass path at 4
            )
        if rank == 0:
            results[family, "whole_state"] = _whole_prompt_state(model_dirs[family], _batch(0, 1))
    if world == CP:
        for batch, loss_mode, single in TREE_CASES:
            results[batch, loss_mode, "fsdp2"] = _run_tree("fsdp2", batch, loss_mode, model_dirs["qwen3"], rank, world)
            results[batch, loss_mode, "longstraw"] = _run_tree(
                "longstraw", batch, loss_mode, model_dirs["qwen3"], rank, world, context_parallel_size=CP,
                min_shared_tokens=8, single_forward=single,
            )
        results["lora", "fsdp2"] = _run_lora("fsdp2", model_dirs["qwen3_next"], rank, world, 12 // world)
        results["lora", "longstraw"] = _run_lora("longstraw", model_dirs["qwen3_next"], rank, world, 6,
                                                 context_parallel_size=CP, chunk_size=CHUNK)
    return results


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    from verl_longstraw.testing import verl_harness as testing

    root = tmp_path_factory.mktemp("cp_models")
    return {f: testing.save_tiny_model(f, str(root / f)) for f in FAMILIES}


def _check_parity(results: list[dict], world: int, families, modes) -> None:
    from verl_longstraw.testing import verl_harness as testing

    for family in families:
        for mode in modes:
            stock = [r[family, mode, "fsdp2"] for r in results]
            cp = [r[family, mode, "longstraw"] for r in results]
            # the global batch's log-probs: fsdp2 rank k holds rows [k*12/world, ...), a CP group its replica's rows
            stock_lp = torch.cat([s["log_probs"] for s in stock])
            cp_lp = torch.cat([cp[k]["log_probs"] for k in range(0, world, CP)])
            assert stock_lp.shape == cp_lp.shape
            assert (stock_lp - cp_lp).abs().max().item() < 1e-5, (family, mode)
            for k in range(world):
                assert testing.rel_diff(cp[k]["grads"], stock[0]["grads"]) < 1e-5, (family, mode, k)
                assert testing.rel_diff(cp[k]["params"], stock[0]["params"]) < 1e-5, (family, mode, k)
                assert cp[k]["dispatch"] == (k // CP, world // CP, k % CP == 0)
                assert 1 <= cp[k]["max_layers_unsharded"] <= 2, (family, mode, cp[k]["max_layers_unsharded"])
                assert cp[k]["cp_bytes"] > 0
            for k in range(0, world, CP):  # the ranks of a CP group see the same rows
                assert torch.equal(cp[k]["log_probs"], cp[k + 1]["log_probs"])


def _check_preflight(results: list[dict], families) -> None:
    for family in families:
        for r in results:
            message, captures = r[family, MODES[0], "longstraw"]["preflight"]
            assert captures == 0, message
            assert "pre-flight" in message and "context_parallel_size" in message, message
            assert "chunk_size" in message and "state_grad_on_host" in message, message


@pytest.fixture(scope="module")
def two_rank_results(saved_models) -> list[dict]:
    """Every rank's results of one CP group of 2 ranks (stars and trees)."""
    return run_ranks(_worker, 2, saved_models, FAMILIES, MODES, timeout_s=1200)


def test_two_ranks_one_cp_group_match_fsdp2(two_rank_results):
    results = two_rank_results
    _check_parity(results, 2, FAMILIES, MODES)
    _check_preflight(results, FAMILIES)
    for family in FAMILIES:
        whole = results[0][family, "whole_state"]
        assert whole["bytes"] == whole["estimate_whole"], family
        for rank, r in enumerate(results):
            held = r[family, MODES[0], "longstraw"]["state_bytes"]
            assert held == whole["estimate_rank"][rank], (family, rank)  # the layout the estimate plans with
            if family != "qwen3_next":  # token rows only: divides by R (Gated DeltaNet adds a fixed-size state)
                assert 0.45 < held / whole["bytes"] < 0.56, (family, held / whole["bytes"])


def test_two_cp_groups_by_two_replicas_match_fsdp2(saved_models):
    results = run_ranks(_worker, 4, saved_models, FAMILIES, MODES[:1], timeout_s=1200)
    _check_parity(results, 4, FAMILIES, MODES[:1])
    # the replicas got different rows of the batch
    first, second = (results[k][FAMILIES[0], MODES[0], "longstraw"]["log_probs"] for k in (0, 2))
    assert not torch.equal(first, second)


@pytest.mark.parametrize("case", TREE_CASES, ids=["-".join(map(str, c)) for c in TREE_CASES])
def test_two_ranks_trees_match_fsdp2(two_rank_results, case):
    """Prefix trees split over the CP group: fsdp2's log-probs (its two ranks' halves of the rows) and parameters
    after the step, on every rank; the walk took the path asked for and forwarded fewer tokens than the star path
    would have (the system prompt once, not once per group)."""
    from verl_longstraw.integration.losses import PER_RESPONSE_POLICY_LOSSES
    from verl_longstraw.testing import verl_harness as testing

    batch, loss_mode, single = case
    stock = [r[batch, loss_mode, "fsdp2"] for r in two_rank_results]
    tree = [r[batch, loss_mode, "longstraw"] for r in two_rank_results]
    stock_lp = torch.cat([s["log_probs"] for s in stock])
    for rank, result in enumerate(tree):
        assert result["log_probs"].shape == stock_lp.shape
        assert (result["log_probs"] - stock_lp).abs().max().item() <= 1e-5, rank
        assert testing.rel_diff(result["params"], stock[0]["params"]) <= 1e-5, rank
        assert result["single_forward"] == {float(single and loss_mode in PER_RESPONSE_POLICY_LOSSES)}
        tokens = result["tokens"]
        if batch == "system_prompt":
            assert tokens["tokens_forwarded"] < tokens["star_tokens_forwarded"], tokens


def test_two_ranks_lora_matches_fsdp2(two_rank_results):
    """LoRA (veRL's peft model, qwen3_next) on one CP group of 2 ranks: fsdp2's log-probs and LoRA parameters after
    the step on every rank, the base parameters unchanged."""
    from verl_longstraw.testing import verl_harness as testing

    stock = [r["lora", "fsdp2"] for r in two_rank_results]
    stock_lp = torch.cat([s["log_probs"] for s in stock])
    for rank, result in enumerate(r["lora", "longstraw"] for r in two_rank_results):
        assert (result["log_probs"] - stock_lp).abs().max().item() <= 1e-5, rank
        lora = [n for n in result["params"] if ".lora_" in n]
        assert lora and testing.rel_diff({n: result["params"][n] for n in lora},
                                         {n: stock[0]["params"][n] for n in lora}) <= 1e-5, rank
        assert any((result["params"][n] - result["before"][n]).abs().max() > 0 for n in lora)
        assert all(torch.equal(result["params"][n], result["before"][n]) for n in result["params"] if n not in lora)
