"""Test instrumentation of FSDP2 (torch 2.13 ``torch.distributed.fsdp._fully_shard``): its collectives
and how many decoder layers are unsharded at once. Used by the CP tests and never by training; the
one module outside ``parallel/fsdp2.py`` that reads FSDP2's private state.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_group_module


def _param_group(module: nn.Module):
    return module._get_fsdp_state()._fsdp_param_group


class FsdpRecorder:
    """Inside ``with FsdpRecorder(layers) as rec``: ``rec.trace`` lists FSDP2's all-gathers and
    reduce-scatters as (kind, elements of the local shards), ``rec.max_layers_unsharded`` the most
    modules of ``layers`` (fully_shard-ed decoder layers) unsharded at once, and
    ``rec.kept_unsharded_grad()`` whether any of them holds an unsharded gradient now."""

    def __init__(self, layers: list[nn.Module]):
        self.groups = [_param_group(layer) for layer in layers]
        self.trace: list[tuple[str, int]] = []
        self.max_layers_unsharded = 0

    def kept_unsharded_grad(self) -> bool:
        return any(p.unsharded_accumulated_grad is not None for g in self.groups for p in g.fsdp_params)

    def __enter__(self) -> FsdpRecorder:
        group_class = fsdp_group_module.FSDPParamGroup
        gather, reduce = fsdp_group_module.foreach_all_gather, fsdp_group_module.foreach_reduce
        unshard = group_class.unshard
        recorder, ids = self, {id(g) for g in self.groups}

        def all_gather(fsdp_params, *args, **kwargs):
            recorder.trace.append(("fsdp_all_gather", sum(p.sharded_param.numel() for p in fsdp_params)))
            return gather(fsdp_params, *args, **kwargs)

        def reduce_scatter(fsdp_params, *args, **kwargs):
            recorder.trace.append(("fsdp_reduce_scatter", sum(p.sharded_param.numel() for p in fsdp_params)))
            return reduce(fsdp_params, *args, **kwargs)

        def unshard_and_count(group, *args, **kwargs):
            out = unshard(group, *args, **kwargs)
            live = [g for g in recorder.groups if id(g) in ids and (g.is_unsharded or g._all_gather_result is not None)]
            recorder.max_layers_unsharded = max(recorder.max_layers_unsharded, len(live))
            return out

        self._originals = (gather, reduce, unshard)
        fsdp_group_module.foreach_all_gather = all_gather
        fsdp_group_module.foreach_reduce = reduce_scatter
        group_class.unshard = unshard_and_count
        return self

    def __exit__(self, *exc) -> None:
        gather, reduce, unshard = self._originals
        fsdp_group_module.foreach_all_gather = gather
        fsdp_group_module.foreach_reduce = reduce
        fsdp_group_module.FSDPParamGroup.unshard = unshard
