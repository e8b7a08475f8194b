"""Response scoring: the row-chunked ``score`` (LM head + log-softmax per chunk) against the plain
``score_reference`` of the head's logits (values, gradients of hidden states and head) and what its graph saves
(no [T, vocab] tensor beyond one row chunk)."""

from __future__ import annotations

import copy

import pytest
import torch

import verl_longstraw.score as scoring
from verl_longstraw import execute, group_backward
from verl_longstraw.score import score, score_reference
from verl_longstraw.testing.compare import errors_against_exact, make_group, no_worse_than_standard
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


def exact(hidden, head, targets, temperature, with_entropy):
    """The reference's arithmetic in the dtype of ``hidden`` and ``head``, float64 copies of the inputs here: what
    both paths approximate (``score_reference`` always takes its log-softmax in float32)."""
    log_probs = torch.log_softmax(torch.nn.functional.linear(hidden, head.weight, head.bias) / temperature, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return log_probs.gather(-1, targets[:, None])[:, 0], entropy


def named(log_probs: torch.Tensor, entropy: torch.Tensor | None,
          grads: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """``scored``'s outputs by name (for ``errors_against_exact``): log-probs [T], entropy [T] if computed, and
    the gradients of hidden [T, H], the head's weight [vocab, H] and bias [vocab]."""
    outputs = {"log_probs": log_probs, "grad_hidden": grads[0], "grad_weight": grads[1], "grad_bias": grads[2]}
    return outputs if entropy is None else {**outputs, "entropy": entropy}


@pytest.mark.parametrize("chunk_rows", [1, 3, None, 40])  # one row, uneven chunks, default (one chunk), > T
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(dtype: torch.dtype, temperature: float, with_entropy: bool, chunk_rows: int | None) -> None:
    """Log-probs, entropies and the gradients of the hidden states, the head's weight and bias as accurate as the
    head's logits scored at once in the same dtype: against the float64 evaluation of the same inputs, no worse
    than ``no_worse_than_standard`` allows the reference's own error on this machine (the error depends on the
    CPU's matmul and log-softmax kernels: an absolute 1e-6 on float32 entropies held with AVX-512, not AVX2)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(29, 24, generator=gen).to(dtype)
    head = torch.nn.Linear(24, 301, dtype=dtype)
    with torch.no_grad():
        head.weight.mul_(8)
    targets = torch.randint(0, 301, (29,), generator=gen)
    log_probs, entropy, grads = scored(score, hidden, head, targets, temperature, with_entropy, chunk_rows=chunk_rows)
    standard = scored(reference, hidden, head, targets, temperature, with_entropy)
    assert log_probs.dtype == torch.float32
    assert (entropy is None) == (not with_entropy)
    for grad, ref_grad in zip(grads, standard[2], strict=True):
        assert grad.dtype == ref_grad.dtype and grad.shape == ref_grad.shape
    errors = errors_against_exact(named(log_probs, entropy, grads), named(*standard),
                                  named(*scored(exact, hidden.double(), copy.deepcopy(head).double(), targets,
                                                temperature, with_entropy)))
    assert no_worse_than_standard(errors, dtype), errors


def test_float64_head_gradients_stay_float64() -> None:
    """A float64 head's gradients are summed in float64 over the row chunks: chunks of 3 rows give one chunk's
    gradients to float64 rounding (a float32 sum, as before, differed by ~1e-8; the per-row log-softmax is
    float32 in both, so only the sum's dtype can tell them apart)."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(29, 24, generator=gen, dtype=torch.float64)
    head = torch.nn.Linear(24, 301, dtype=torch.float64)
    targets = torch.randint(0, 301, (29,), generator=gen)
    grads = scored(score, hidden, head, targets, 1.0, True, chunk_rows=3)[2]
    expected = scored(score, hidden, head, targets, 1.0, True, chunk_rows=29)[2]
    for grad, ref_grad in zip(grads, expected, strict=True):
        assert grad.dtype == torch.float64
        assert float((grad - ref_grad).norm() / ref_grad.norm()) < 1e-12


def test_without_autograd() -> None:
    """The log-prob pass (no grad) returns the reference's values (as accurate against float64) and builds no
    graph."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 12, generator=gen, requires_grad=True)
    head = torch.nn.Linear(12, 50, bias=False)
    targets = torch.randint(0, 50, (7,), generator=gen)
    with torch.no_grad():
        log_probs, entropy = score(hidden, head, targets, 0.9, True, chunk_rows=2)
        ref_log_probs, ref_entropy = reference(hidden, head, targets, 0.9, True)
        exact_log_probs, exact_entropy = exact(hidden.double(), copy.deepcopy(head).double(), targets, 0.9, True)
    assert log_probs.grad_fn is None and entropy.grad_fn is None
    errors = errors_against_exact({"log_probs": log_probs, "entropy": entropy},
                                  {"log_probs": ref_log_probs, "entropy": ref_entropy},
                                  {"log_probs": exact_log_probs, "entropy": exact_entropy})
    assert no_worse_than_standard(errors, torch.float32), errors


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
    monkeypatch.setattr(scoring, "SCORE_CHUNK_BYTES", 16 * VOCAB * 4)

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            group_backward(model, prompt, responses, lambda i, lp, ent: -(lp.mean() + 0.01 * ent.mean()),
                           with_entropy=True)

    assert [n for n, _ in saved_tensors(run) if n > 16 * VOCAB] == []
    monkeypatch.setattr(execute, "score", reference)
    big = sorted(n for n, dtype in saved_tensors(run) if n > 16 * VOCAB and dtype == torch.float32)
    assert len(big) >= 2 and set(big) == {64 * VOCAB}  # 8 MiB each
