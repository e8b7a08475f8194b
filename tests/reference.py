"""The standard path the tests compare against: one full forward per prompt ++ response."""

from __future__ import annotations

import torch


def full_log_probs(model, prompt, response, temperature: float = 1.0):
    """Log-probs [T] and entropies [T] of ``response`` from a forward over prompt ++ response."""
    logits = model(torch.cat([prompt, response])[None]).logits[0].float() / temperature
    log_probs = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(response) - 1], dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, response[:, None])[:, 0], entropy


def standard_grads(model, prompt, responses, loss_fn) -> dict[str, torch.Tensor]:
    """Gradient of sum_i loss_fn(i, logps_i) computed the standard way."""
    model.zero_grad(set_to_none=True)
    for i, response in enumerate(responses):
        loss_fn(i, full_log_probs(model, prompt, response)[0]).backward()
    return grads_of(model)


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Relative L2 error of gradient set ``a`` against reference ``b`` over all parameters."""
    num = sum((a[n].double() - b[n].double()).pow(2).sum() for n in b)
    den = sum(v.double().pow(2).sum() for v in b.values())
    return float((num / den).sqrt())


def weighted_loss(i: int, log_probs: torch.Tensor) -> torch.Tensor:
    """A GRPO-like per-response loss: advantage-signed, position-weighted log-likelihood."""
    advantage = 1.0 if i % 2 == 0 else -0.5
    weights = torch.linspace(0.5, 1.5, len(log_probs), dtype=log_probs.dtype)
    return -advantage * (weights * log_probs).mean()


def make_group(vocab: int, prompt_len: int, response_lens, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=g)
    responses = [torch.randint(0, vocab, (t,), generator=g) for t in response_lens]
    return prompt, responses
