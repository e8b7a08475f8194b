"""Response scoring: the row-chunked ``score`` against the plain ``score_reference`` (values, gradients) and
what its graph saves (no float32 [T, vocab] tensor beyond one row chunk)."""

from __future__ import annotations

import pytest
import torch

from verl_longstraw import api, group_backward, replay
from verl_longstraw.replay import score, score_reference
from verl_longstraw.testing import make_group
from verl_longstraw.tiny import tiny_model


def scored(fn, logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, **kwargs):
    """Log-probs, entropy (or None) and d(loss)/d(logits) of a loss weighting both outputs at random."""
    logits = logits.detach().requires_grad_()
    log_probs, entropy = fn(logits, targets, temperature, with_entropy, **kwargs)
    gen = torch.Generator().manual_seed(1)
    loss = (log_probs * torch.randn(log_probs.shape, generator=gen)).sum()
    if with_entropy:
        loss = loss + (entropy * torch.randn(entropy.shape, generator=gen)).sum()
    (grad,) = torch.autograd.grad(loss, logits)
    return log_probs.detach(), None if entropy is None else entropy.detach(), grad


@pytest.mark.parametrize("chunk_rows", [1, 3, None, 40])  # one row, uneven chunks, default (one chunk), > T
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(dtype: torch.dtype, temperature: float, with_entropy: bool, chunk_rows: int | None) -> None:
    """Same log-probs and entropies (the same per-row ops; < 1e-6 apart), gradients as close as float32 rounding."""
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(29, 301, generator=gen)).to(dtype)
    targets = torch.randint(0, 301, (29,), generator=gen)
    log_probs, entropy, grad = scored(score, logits, targets, temperature, with_entropy, chunk_rows=chunk_rows)
    ref_log_probs, ref_entropy, ref_grad = scored(score_reference, logits, targets, temperature, with_entropy)
    assert log_probs.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(log_probs, ref_log_probs, atol=1e-6, rtol=0)
    assert (entropy is None) == (not with_entropy)
    if with_entropy:
        torch.testing.assert_close(entropy, ref_entropy, atol=1e-6, rtol=0)
    # float32: below one part in 1e6 of the largest gradient (a few float32 ulps; entries are ~1 / temperature)
    # bfloat16: the gradient is rounded once to bf16 and may land one bf16 ulp away
    tolerance = 1e-6 if dtype == torch.float32 else 2**-7
    assert float((grad.float() - ref_grad.float()).abs().max()) <= tolerance * float(ref_grad.float().abs().max())


def test_without_autograd() -> None:
    """The log-prob pass (no grad) returns the reference's values and builds no graph."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (7,), generator=gen)
    with torch.no_grad():
        log_probs, entropy = score(logits, targets, 0.9, True, chunk_rows=2)
        ref_log_probs, ref_entropy = score_reference(logits, targets, 0.9, True)
    assert log_probs.grad_fn is None and entropy.grad_fn is None
    torch.testing.assert_close(log_probs, ref_log_probs, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-6, rtol=0)


VOCAB = 32768


def saved_float32(run) -> list[tuple[int, int]]:
    """(numel, data_ptr) of every float32 tensor autograd saves for backward while ``run()`` runs."""
    saved: list[tuple[int, int]] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            saved.append((x.numel(), x.untyped_storage().data_ptr()))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        run()
    return saved


@pytest.mark.parametrize("autocast", [False, True])
def test_scoring_saves_no_float32_logits(autocast: bool) -> None:
    """LM head + score of T = 256 rows over a 32K vocabulary, 32 rows a chunk: under bf16 autocast no saved float32
    tensor reaches one chunk of logits; in float32 the only one is the logits themselves (the head's output, which
    ``score`` takes). The reference saves its log-softmax and exp: two float32 [T, vocab] tensors (64 MiB)."""
    rows, hidden, chunk = 256, 16, 32  # the head weight [vocab, hidden] stays below a chunk
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=gen, requires_grad=True)
    head = torch.nn.Linear(hidden, VOCAB, bias=False)
    targets = torch.randint(0, VOCAB, (rows,), generator=gen)
    logits_ptr = []

    def run(fn, **kwargs) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = head(h)
            logits_ptr.append(logits.untyped_storage().data_ptr())
            log_probs, entropy = fn(logits, targets, 1.0, True, **kwargs)
        (log_probs.sum() + entropy.sum()).backward()

    big = [ptr for numel, ptr in saved_float32(lambda: run(score, chunk_rows=chunk)) if numel > chunk * VOCAB]
    assert big == ([] if autocast else [logits_ptr[-1]])
    reference = {(numel, ptr) for numel, ptr in saved_float32(lambda: run(score_reference)) if numel > chunk * VOCAB}
    assert sorted(numel for numel, _ in reference)[-2:] == [rows * VOCAB] * 2


def test_replay_saves_no_float32_logits(monkeypatch) -> None:
    """One response replayed with autograd (tiny qwen3, 32K vocabulary, T = 64, 16 rows a chunk, bf16 autocast as
    the engine runs it): no saved float32 tensor reaches one chunk of logits; the reference score saved two of
    T x vocab."""
    model = tiny_model("qwen3", vocab_size=VOCAB)
    prompt, responses = make_group(VOCAB, 48, [64])
    monkeypatch.setattr(replay, "SCORE_CHUNK_BYTES", 16 * VOCAB * 4)

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            group_backward(model, prompt, responses, lambda i, lp, ent: -(lp.mean() + 0.01 * ent.mean()),
                           with_entropy=True)

    assert [numel for numel, _ in saved_float32(run) if numel > 16 * VOCAB] == []
    monkeypatch.setattr(api, "score", score_reference)
    reference = {(numel, ptr) for numel, ptr in saved_float32(run) if numel > 16 * VOCAB}
    assert sorted(numel for numel, _ in reference) == [64 * VOCAB] * 2  # 16 MiB
