"""Trainer mode `longstraw_sync` (`trainer.v1.trainer_mode=longstraw_sync`): the sync V1 trainer,
balancing whole GRPO groups across data-parallel ranks so each prompt is captured once per step.

veRL's `_balance_batch` reorders single samples by sequence length, which scatters a group's
responses over ranks (each fragment then captures the prompt again). Here samples are
partitioned group by group (largest workload first, onto the least-loaded rank with room);
a group is split only when no rank has room for all of it. Partitions keep veRL's equal sizes.

veRL knows this mode as "sync" and reads its settings from `trainer.v1.sync`; a
`trainer.v1.longstraw_sync` block would be ignored, so it is refused.
"""

import torch
from omegaconf import DictConfig
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.seqlen_balancing import calculate_workload, log_seqlen_unbalance

from .config import check_context_parallel


def group_of_key(key: str) -> str:
    """Group id of a TransferQueue sample key `{uid}_{session_id}_{turn}`."""
    return key.rsplit("_", 2)[0]


def balance_groups(group_ids: list[str], workloads: list[float], k_partitions: int) -> list[list[int]]:
    """Split sample indices into `k_partitions` equal-size lists, keeping groups whole where possible.

    group_ids/workloads: one entry per sample. Returns lists of sample indices; each group's
    members stay contiguous within a partition.
    """
    n = len(group_ids)
    if n % k_partitions:
        raise ValueError(f"batch of {n} samples does not split into {k_partitions} equal partitions")
    capacity = n // k_partitions
    groups: dict[str, list[int]] = {}
    for idx, gid in enumerate(group_ids):
        groups.setdefault(gid, []).append(idx)
    ordered = sorted(groups.values(), key=lambda members: -sum(workloads[i] for i in members))
    parts: list[list[int]] = [[] for _ in range(k_partitions)]
    loads = [0.0] * k_partitions
    for members in ordered:
        remaining = members
        while remaining:
            open_parts = [p for p in range(k_partitions) if len(parts[p]) < capacity]
            whole = [p for p in open_parts if capacity - len(parts[p]) >= len(remaining)]
            p = min(whole or open_parts, key=lambda q: (loads[q], q))
            take = remaining[: capacity - len(parts[p])]
            parts[p].extend(take)
            loads[p] += sum(workloads[i] for i in take)
            remaining = remaining[len(take) :]
    return parts


@register_trainer("longstraw_sync")
class LongStrawTrainerSync(PPOTrainerSync):
    """Sync V1 trainer with group-preserving data-parallel balancing."""

    # veRL branches on `trainer_mode == "sync"` in many places; behave exactly like "sync" there.
    trainer_mode = property(lambda self: "sync", lambda self, value: None)

    def __init__(self, config: DictConfig) -> None:
        if config.trainer.v1.get("longstraw_sync"):
            raise ValueError(
                "trainer.v1.longstraw_sync is not read: the longstraw_sync mode runs veRL's sync trainer, "
                "whose settings veRL reads from trainer.v1.sync; move them to trainer.v1.sync."
            )
        actor = config.actor_rollout_ref.actor
        check_context_parallel(
            actor.get("longstraw", {}).get("context_parallel_size", 1),
            config.trainer.nnodes * config.trainer.n_gpus_per_node,
            actor.fsdp_config.get("fsdp_size", -1),
        )
        super().__init__(config)

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        """Reorder the batch so each dp rank gets whole groups and similar total workload."""
        worker_group = self.actor_rollout_wg
        if "actor" not in worker_group._dispatch_info:
            worker_group._dispatch_info["actor"] = worker_group._query_dispatch_info("actor")
        dp_size = max(worker_group._dispatch_info["actor"]) + 1
        batch = upsample_batch_to_divisible_size(
            batch, self._get_required_batch_multiple(dp_size), self.tokenizer.eos_token_id
        )
        seqlens = torch.tensor([tag["seq_len"] for tag in batch.tags], dtype=torch.int64)
        workloads = calculate_workload(seqlens).tolist()
        partitions = balance_groups([group_of_key(k) for k in batch.keys], workloads, dp_size)
        batch.reorder([i for part in partitions for i in part])
        metrics.update(log_seqlen_unbalance(seqlen_list=seqlens.tolist(), partitions=partitions, prefix=logging_prefix))
        return batch
