"""FSDP2 control for replay: hold parameters unsharded for a micro-batch, reduce gradients once.

LongStraw calls the root module and each decoder layer several times per prompt group, and
the number of groups differs between data-parallel ranks. With FSDP2's default per-call
unshard/reshard (and a reduce-scatter per backward) the ranks would issue different numbers
of collectives and hang. Inside `held_unsharded` every FSDP module is all-gathered once, in
the same order on every rank; no forward/backward issues a collective. `sync_gradients` then
reduce-scatters the accumulated gradients with one backward that every rank runs identically.
"""

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule


def _fsdp_modules(root: nn.Module) -> list[FSDPModule]:
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


@contextmanager
def held_unsharded(root: nn.Module) -> Iterator[None]:
    """All-gather every FSDP2 module of `root` once; keep them unsharded and gradient sync off.

    On exit restores each module's reshard-after-forward/backward settings, turns gradient
    sync back on and reshards. Gradients accumulate unsharded until `sync_gradients`.
    """
    modules = _fsdp_modules(root)
    if not modules:
        yield
        return
    root._get_fsdp_state()._lazy_init()
    saved = []
    for m in modules:
        state = m._get_fsdp_state()
        group = state._fsdp_param_group
        saved.append((state._auto_reshard_after_forward, group and group.post_forward_mesh_info))
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        for m in modules:
            m.unshard()
        yield
    finally:
        for m, (auto, mesh_info) in zip(modules, saved):
            state = m._get_fsdp_state()
            state._auto_reshard_after_forward = auto
            if state._fsdp_param_group is not None:
                state._fsdp_param_group.post_forward_mesh_info = mesh_info
            m.set_reshard_after_backward(True, recurse=False)
            m.set_requires_gradient_sync(True, recurse=False)
        for m in modules:
            m.reshard()


def sync_gradients(root: nn.Module, device: str, autocast_dtype: torch.dtype) -> None:
    """Reduce-scatter the gradients accumulated inside `held_unsharded` (call it inside).

    Runs a one-token forward whose loss is multiplied by zero, with gradient sync on: every
    parameter group's post-backward hook reduce-scatters its accumulated gradient (plus zeros).
    The call is identical on every rank, so the collectives match.
    """
    modules = _fsdp_modules(root)
    if not modules:
        return
    for m in modules:
        m.set_requires_gradient_sync(True, recurse=False)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    device_type = device.split(":")[0]
    ctx = (
        torch.autocast(device_type=device_type, dtype=autocast_dtype)
        if autocast_dtype != torch.float32
        else torch.autocast(device_type=device_type, enabled=False)
    )
    with torch.enable_grad(), ctx:
        logits = root(input_ids=ids, use_cache=False).logits
    (logits.float().sum() * 0.0).backward()
    for m in modules:
        m.set_requires_gradient_sync(False, recurse=False)
