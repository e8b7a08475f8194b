"""Response scoring: the row-chunked ``score`` (LM head + log-softmax per chunk) against the plain
``score_reference`` of the head's logits (values, gradients of hidden states and head) and what its graph saves
(no [T, vocab] tensor beyond one row chunk)."""

from __future__ import annotations

import pytest
import torch

from verl_longstraw import group_backward, replay
from verl_longstraw.replay import score, score_reference
from verl_longstraw.testing import make_group
from verl_longstraw.tiny import tiny_model


def scored(fn, hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, temperature: float,
           with_entropy: bool, **kwargs):
    """Log-probs, entropy (or None) and the gradients of hidden and of the head's parameters under a loss
    weighting both outputs at random."""
    hidden = hidden.detach().requires_grad_()
    log_probs, entropy = fn(hidden, head, targets, temperature, with_entropy, **kwargs)
    gen = torch.Generator().manual_seed(1)
    loss = (log_probs * torch.randn(log_probs.shape, generator=gen)).sum()
    if with_entropy:
        loss = loss + (entropy * torch.randn(entropy.shape, generator=gen)).sum()
    grads = torch.autograd.grad(loss, [hidden, *head.parameters()])
    return log_probs.detach(), None if entropy is None else entropy.detach(), grads


def reference(hidden, head, targets, temperature, with_entropy, **kwargs):
    """``score_reference`` of the head's logits (what ``score`` computes a chunk at a time)."""
    return score_reference(torch.nn.functional.linear(hidden, head.weight, head.bias), targets, temperature,
                           with_entropy)  # not head(hidden): inside the replay this runs as the head's forward


@pytest.mark.parametrize("chunk_rows", [1, 3, None, 40])  # one row, uneven chunks, default (one chunk), > T
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(dtype: torch.dtype, temperature: float, with_entropy: bool, chunk_rows: int | None) -> None:
    """Same log-probs and entropies as the head's logits scored at once (< 1e-6 apart in float32), gradients of
    the hidden states, the head's weight and bias as close as float32 rounding (bf16: the rounding of the
    standard path's own bf16 products)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(29, 24, generator=gen).to(dtype)
    head = torch.nn.Linear(24, 301, dtype=dtype)
    with torch.no_grad():
        head.weight.mul_(8)
    targets = torch.randint(0, 301, (29,), generator=gen)
    log_probs, entropy, grads = scored(score, hidden, head, targets, temperature, with_entropy, chunk_rows=chunk_rows)
    ref_log_probs, ref_entropy, ref_grads = scored(reference, hidden, head, targets, temperature, with_entropy)
    assert log_probs.dtype == torch.float32
    # float32: logits of a row chunk and of all rows round alike to a few ulps; bfloat16: to a bf16 ulp
    rtol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(log_probs, ref_log_probs, atol=1e-6, rtol=rtol)
    assert (entropy is None) == (not with_entropy)
    if with_entropy:
        torch.testing.assert_close(entropy, ref_entropy, atol=1e-6, rtol=rtol)
    # float32: a few float32 ulps of the largest entry; bfloat16: products rounded once to bf16 (a few bf16 ulps)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-6
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert grad.dtype == ref_grad.dtype and grad.shape == ref_grad.shape
        assert float((grad.float() - ref_grad.float()).abs().max()) <= tolerance * float(ref_grad.float().abs().max())


def test_without_autograd() -> None:
    """The log-prob pass (no grad) returns the reference's values and builds no graph."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 12, generator=gen, requires_grad=True)
    head = torch.nn.Linear(12, 50, bias=False)
    targets = torch.randint(0, 50, (7,), generator=gen)
    with torch.no_grad():
        log_probs, entropy = score(hidden, head, targets, 0.9, True, chunk_rows=2)
        ref_log_probs, ref_entropy = reference(hidden, head, targets, 0.9, True)
    assert log_probs.grad_fn is None and entropy.grad_fn is None
    torch.testing.assert_close(log_probs, ref_log_probs, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-6, rtol=0)


VOCAB = 32768


def saved_tensors(run) -> list[tuple[int, torch.dtype]]:
    """(numel, dtype) of every tensor of rows x vocabulary (logits-shaped: the last dim is VOCAB, not the head's
    [VOCAB, hidden] weight) that autograd saves for backward while ``run()`` runs."""
    saved: list[tuple[int, torch.dtype]] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        if x.dim() and x.shape[-1] == VOCAB:
            saved.append((x.numel(), x.dtype))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        run()
    return saved


@pytest.mark.parametrize("autocast", [False, True])
def test_scoring_saves_no_logits(autocast: bool) -> None:
    """LM head + score of T = 256 rows over a 32K vocabulary, 32 rows a chunk, in float32 or under bf16 autocast:
    no saved tensor of any dtype reaches one chunk of logits (the head runs inside the chunks). The reference
    saves the logits and its float32 log-softmax and exp: [T, vocab] each."""
    rows, hidden_size, chunk = 256, 16, 32  # the head weight [vocab, hidden] stays below a chunk
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, hidden_size, generator=gen, requires_grad=True)
    head = torch.nn.Linear(hidden_size, VOCAB, bias=False)
    targets = torch.randint(0, VOCAB, (rows,), generator=gen)

    def run(fn, **kwargs) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            log_probs, entropy = fn(hidden, head, targets, 1.0, True, **kwargs)
        (log_probs.sum() + entropy.sum()).backward()

    assert [n for n, _ in saved_tensors(lambda: run(score, chunk_rows=chunk)) if n > chunk * VOCAB] == []
    big = sorted(n for n, dtype in saved_tensors(lambda: run(reference)) if n > chunk * VOCAB
                 and dtype == torch.float32)
    assert big[-2:] == [rows * VOCAB] * 2


def test_replay_saves_no_logits(monkeypatch) -> None:
    """One response replayed with autograd (tiny qwen3, 32K vocabulary, T = 64, 16 rows a chunk, bf16 autocast as
    the engine runs it): no saved tensor reaches one chunk of logits; scoring the head's logits at once (the
    reference) saves float32 tensors of T x vocab (log-softmax, its exp, ...)."""
    model = tiny_model("qwen3", vocab_size=VOCAB)
    prompt, responses = make_group(VOCAB, 48, [64])
    monkeypatch.setattr(replay, "SCORE_CHUNK_BYTES", 16 * VOCAB * 4)

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            group_backward(model, prompt, responses, lambda i, lp, ent: -(lp.mean() + 0.01 * ent.mean()),
                           with_entropy=True)

    assert [n for n, _ in saved_tensors(run) if n > 16 * VOCAB] == []
    monkeypatch.setattr(replay, "score", reference)
    big = sorted(n for n, dtype in saved_tensors(run) if n > 16 * VOCAB and dtype == torch.float32)
    assert len(big) >= 2 and set(big) == {64 * VOCAB}  # 8 MiB each
