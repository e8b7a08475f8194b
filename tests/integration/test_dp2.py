"""Two data-parallel ranks (two spawned processes, gloo, under a hard timeout): groups split across ranks
and micro-batches."""

import os

from verl_longstraw.parallel.launch import run_ranks
from verl_longstraw.testing import verl_harness as testing

MBS = 3  # 12 shuffled samples of 3 groups -> 6 per rank -> 2 micro-batches per rank
CASES = (("token-mean", True), ("seq-mean-token-mean", False))  # (loss_agg_mode, KL loss + entropy)


def _worker(rank: int, world: int, model_path: str) -> dict:
    from verl.workers.utils.padding import no_padding_2_padding

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    results = {}
    for strategy in ("fsdp2", "longstraw"):
        for mode, kl in CASES:
            cfg = testing.actor_config(strategy, mode, kl, 0.01 if kl else 0.0, MBS)
            engine = testing.make_engine(strategy, model_path, cfg, MBS)
            td = testing.make_batch(n_groups=3, group_size=4, seed=5, rank=rank, world_size=world)
            logp = no_padding_2_padding(testing.compute_log_prob(engine, td.clone(), MBS)["log_probs"], td)
            grads, params, _ = testing.train_step(engine, td.clone(), cfg, MBS)
            results[strategy, mode] = (logp * td["response_mask"], grads, params)
    return results


def test_two_ranks_match_fsdp2(model_dirs):
    for results in run_ranks(_worker, 2, model_dirs["qwen3"], timeout_s=900):
        for mode, _ in CASES:
            lp_s, g_s, p_s = results["fsdp2", mode]
            lp_l, g_l, p_l = results["longstraw", mode]
            assert (lp_s - lp_l).abs().max().item() < 1e-5, mode
            assert testing.rel_diff(g_l, g_s) < 1e-5, mode
            assert testing.rel_diff(p_l, p_s) < 1e-5, mode
