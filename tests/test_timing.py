"""Phase seconds (GroupStats) count the work a phase queued on an accelerator, not only its launches."""

import time

import torch

from verl_longstraw import GroupStats, group_backward
from verl_longstraw.tiny import VOCAB, tiny_model

QUEUED_S = 0.5  # what the fake accelerator still has to run whenever it is synchronized


def test_phase_seconds_wait_for_queued_device_work(monkeypatch):
    """The CPU poses as an accelerator whose synchronize takes QUEUED_S (kernels still running):
    each phase's seconds must include one such wait at its end."""
    syncs = []
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: syncs.append(time.sleep(QUEUED_S)))
    model = tiny_model("qwen3")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (12,), generator=g)
    responses = [torch.randint(0, VOCAB, (5,), generator=g) for _ in range(2)]
    stats = GroupStats()
    group_backward(model, prompt, responses, lambda i, logps: logps.sum(), stats=stats)
    assert syncs
    assert min(stats.capture_s, stats.replay_s, stats.prompt_backward_s) >= QUEUED_S, stats
