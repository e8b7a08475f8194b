"""Trainer mode `longstraw_sync` (`trainer.v1.trainer_mode=longstraw_sync`): the sync V1 trainer,
balancing whole GRPO groups across data-parallel ranks so each prompt is captured once per step.

veRL's `_balance_batch` reorders single samples by sequence length, which scatters a group's
responses over ranks (each fragment then captures the prompt again). Here samples are
partitioned group by group (largest workload first, onto the least-loaded rank with room);
a group is split only when no rank has room for all of it. Groups whose prompts begin with the same
`longstraw.min_shared_tokens` tokens (a shared system prompt: what one walk of the engine shares across
groups) are placed together: onto a rank that already holds that prefix while it has room for the group.
Partitions keep veRL's equal sizes.

veRL knows this mode as "sync" and reads its settings from `trainer.v1.sync`; a
`trainer.v1.longstraw_sync` block would be ignored, so it is refused.
"""

from collections.abc import Hashable

import torch
import transfer_queue as tq
from omegaconf import DictConfig
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.seqlen_balancing import calculate_workload, log_seqlen_unbalance

from .config import as_longstraw_config, check_context_parallel


def group_of_key(key: str) -> str:
    """Group id of a TransferQueue sample key `{uid}_{session_id}_{turn}`."""
    return key.rsplit("_", 2)[0]


def balance_groups(group_ids: list[str], workloads: list[float], k_partitions: int,
                   prefix_ids: list[Hashable] | None = None) -> list[list[int]]:
    """Split sample indices into `k_partitions` equal-size lists, keeping groups whole where possible.

    group_ids/workloads/prefix_ids: one entry per sample (prefix_ids: what the sample's prompt begins with; None:
    nothing shared across groups). Prefixes are placed largest total workload first, each group onto the
    least-loaded rank with room for all of it, preferring a rank that already holds its prefix. Returns lists of
    sample indices; each group's members stay contiguous within a partition.
    """
    n = len(group_ids)
    if n % k_partitions:
        raise ValueError(f"batch of {n} samples does not split into {k_partitions} equal partitions")
    capacity = n // k_partitions
    groups: dict[str, list[int]] = {}
    for idx, gid in enumerate(group_ids):
        groups.setdefault(gid, []).append(idx)
    families: dict[Hashable, list[list[int]]] = {}
    for gid, members in groups.items():
        families.setdefault(gid if prefix_ids is None else prefix_ids[members[0]], []).append(members)

    def load(members: list[int]) -> float:
        return sum(workloads[i] for i in members)

    ordered = sorted(families.items(), key=lambda family: -sum(load(m) for m in family[1]))
    parts: list[list[int]] = [[] for _ in range(k_partitions)]
    loads = [0.0] * k_partitions
    held: list[set[Hashable]] = [set() for _ in range(k_partitions)]
    for family, members_of in ordered:
        for members in sorted(members_of, key=lambda m: -load(m)):
            remaining = members
            while remaining:
                open_parts = [p for p in range(k_partitions) if len(parts[p]) < capacity]
                candidates = [p for p in open_parts if capacity - len(parts[p]) >= len(remaining)] or open_parts
                p = min([q for q in candidates if family in held[q]] or candidates, key=lambda q: (loads[q], q))
                take = remaining[: capacity - len(parts[p])]
                parts[p].extend(take)
                loads[p] += load(take)
                held[p].add(family)
                remaining = remaining[len(take) :]
    return parts


def prompt_prefixes(prompts: torch.Tensor, length: int) -> list[tuple[int, ...]]:
    """Each sample's first ``length`` prompt tokens (all of a shorter prompt), from the nested [B, P_i] prompts."""
    values, offsets = prompts.values(), prompts.offsets().tolist()
    bounds = zip(offsets[:-1], offsets[1:], strict=True)
    return [tuple(values[start : min(end, start + length)].tolist()) for start, end in bounds]


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
        self._min_shared_tokens = as_longstraw_config(actor.get("longstraw")).min_shared_tokens
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
        prompts = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["prompts"])
        partitions = balance_groups([group_of_key(k) for k in batch.keys], workloads, dp_size,
                                    prompt_prefixes(prompts["prompts"], self._min_shared_tokens))
        batch.reorder([i for part in partitions for i in part])
        metrics.update(log_seqlen_unbalance(seqlen_list=seqlens.tolist(), partitions=partitions, prefix=logging_prefix))
        return batch
