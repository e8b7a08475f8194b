"""Two data-parallel ranks (two processes, gloo): groups split across ranks and micro-batches."""

import torch
import torch.multiprocessing as mp

from verl_longstraw.integration import testing

MBS = 3  # 12 shuffled samples of 3 groups -> 6 per rank -> 2 micro-batches per rank
CASES = (("token-mean", True), ("seq-mean-token-mean", False))  # (loss_agg_mode, KL loss + entropy)


def _worker(rank: int, model_path: str, out_dir: str, port: int) -> None:
    from verl.workers.utils.padding import no_padding_2_padding

    testing.init_dist(rank=rank, world_size=2, port=port)
    results = {}
    for strategy in ("fsdp2", "longstraw"):
        for mode, kl in CASES:
            cfg = testing.actor_config(strategy, mode, kl, 0.01 if kl else 0.0, MBS)
            engine = testing.make_engine(strategy, model_path, cfg, MBS)
            td = testing.make_batch(n_groups=3, group_size=4, seed=5, rank=rank, world_size=2)
            logp = no_padding_2_padding(testing.compute_log_prob(engine, td.clone(), MBS)["log_probs"], td)
            grads, params, _ = testing.train_step(engine, td.clone(), cfg, MBS)
            results[strategy, mode] = (logp * td["response_mask"], grads, params)
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_two_ranks_match_fsdp2(model_dirs, tmp_path):
    port = testing.free_port()
    mp.start_processes(_worker, args=(model_dirs["qwen3"], str(tmp_path), port), nprocs=2, start_method="spawn")
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for mode, _ in CASES:
            lp_s, g_s, p_s = results["fsdp2", mode]
            lp_l, g_l, p_l = results["longstraw", mode]
            assert (lp_s - lp_l).abs().max().item() < 1e-5, mode
            assert testing.rel_diff(g_l, g_s) < 1e-5, mode
            assert testing.rel_diff(p_l, p_s) < 1e-5, mode
