"""Test helpers for the veRL integration: engines (stock fsdp2 and longstraw) on tiny saved
models, veRL 0.9.1 GRPO batches, a gloo process group on a free port.

Used by tests/integration and the engine benchmarks (benchmarks/bench_*.py); imports veRL.
"""

import os
import socket
from functools import partial

import numpy as np
import torch
import verl  # noqa: F401  (loads the verl.plugins entry point: CPU platform + longstraw engine)
from verl import DataProto
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl.workers.config import (
    FSDPActorConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
    PolicyLossConfig,
)
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding

from verl_longstraw.integration.config import LongStrawActorConfig, LongStrawConfig
from verl_longstraw.integration.engine import LongStrawEngine
from verl_longstraw.tiny import VOCAB, tiny_model

FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it), for a rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_dist(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    """Join (or create) the gloo process group; ``port`` is the rendezvous port every rank passes
    (``free_port()`` chosen by the launcher); a single rank picks a free one itself."""
    if torch.distributed.is_initialized():
        return
    if port is None:
        if world_size > 1:
            raise ValueError(f"init_dist: world_size={world_size} needs port= (free_port() from the launcher)")
        port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)


def save_tiny_model(family: str, path: str, **overrides) -> str:
    """Random-init tiny `family` model (``overrides`` set config fields) saved for veRL to load."""
    tiny_model(family, **overrides).save_pretrained(path)
    return path


def actor_config(
    strategy: str,
    loss_agg_mode: str,
    use_kl: bool,
    entropy_coeff: float,
    mbs: int,
    fsdp_size: int = -1,
    policy_loss: dict | None = None,
    **longstraw,
):
    """veRL actor config (policy loss settings + FSDP engine config, fp32, no compile); ``fsdp_size``
    ranks per FSDP shard group (-1: all), ``policy_loss`` veRL's PolicyLossConfig fields (None: vanilla),
    ``longstraw`` the LongStraw knobs."""
    common = dict(
        rollout_n=1,
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=mbs,
        loss_agg_mode=loss_agg_mode,
        use_kl_loss=use_kl,
        kl_loss_coef=0.1,
        entropy_coeff=entropy_coeff,
        policy_loss=PolicyLossConfig(**(policy_loss or {})),
        use_torch_compile=False,
        fsdp_config=FSDPEngineConfig(
            strategy="fsdp2",
            model_dtype="fp32",
            mixed_precision=FP32,
            use_torch_compile=False,
            use_dynamic_bsz=False,
            fsdp_size=fsdp_size,
        ),
    )
    if strategy == "longstraw":
        return LongStrawActorConfig(strategy="longstraw", longstraw=LongStrawConfig(**longstraw), **common)
    return FSDPActorConfig(strategy="fsdp2", **common)


def make_engine(strategy: str, model_path: str, config, mbs: int, lr: float = 0.1, lora: dict | None = None,
                attn_implementation: str = "sdpa", checkpoint: CheckpointConfig | None = None):
    """An initialized engine: veRL's FSDPEngineWithLMHead (fsdp2) or LongStrawEngine; ``lora``: HFModelConfig's
    LoRA fields (``lora_rank``, ``lora_alpha``, ``target_modules``), which make veRL build a peft model;
    ``attn_implementation``: the model's (transformers refuses sdpa for gpt_oss, whose sinks it cannot express);
    ``checkpoint``: what ``save_checkpoint``/``load_checkpoint`` keep (None: the engine cannot save)."""
    model_config = HFModelConfig(
        path=model_path,
        load_tokenizer=False,
        use_remove_padding=False,
        enable_gradient_checkpointing=True,
        override_config={"attn_implementation": attn_implementation},
        **(lora or {}),
    )
    engine_config = config.engine
    engine_config.micro_batch_size_per_gpu = mbs
    engine_config.infer_micro_batch_size_per_gpu = mbs
    optim = FSDPOptimizerConfig(optimizer="SGD", lr=lr, weight_decay=0.0, clip_grad=1e9, total_training_steps=1)
    cls = LongStrawEngine if strategy == "longstraw" else FSDPEngineWithLMHead
    engine = cls(model_config=model_config, engine_config=engine_config, optimizer_config=optim,
                 checkpoint_config=checkpoint)
    engine.initialize()
    return engine


def make_batch(
    n_groups: int,
    group_size: int,
    seed: int = 0,
    temperature: float = 1.0,
    rank: int = 0,
    world_size: int = 1,
    prompt_len: tuple[int, int] = (4, 12),
    response_len: tuple[int, int] = (2, 9),
    empty_responses: int = 0,
):
    """GRPO batch in veRL 0.9.1's layout: no-padding nested input_ids, `uid`, rows shuffled.

    Lengths are drawn from the half-open ranges `prompt_len` and `response_len`; the last
    `empty_responses` samples have none (attention mask zero over the response). Returns this
    rank's contiguous slice (rows are shuffled first, so groups split across ranks and
    micro-batches).
    """
    g = torch.Generator().manual_seed(seed)

    def tokens(lengths: tuple[int, int]) -> torch.Tensor:
        return torch.randint(1, VOCAB, (int(torch.randint(*lengths, (1,), generator=g)),), generator=g)

    prompts, responses, uids = [], [], []
    for k in range(n_groups):
        prompt = tokens(prompt_len)
        for _ in range(group_size):
            prompts.append(prompt)
            responses.append(tokens(response_len))
            uids.append(f"uid-{k}")
    n = len(prompts)
    responses[n - empty_responses :] = [responses[0][:0]] * empty_responses
    masks = [torch.ones(len(r), dtype=torch.long) for r in responses]
    masks[0][1:2] = 0  # a masked-out token inside a response (e.g. tool output)
    return samples_batch(prompts, responses, uids, g, temperature, rank, world_size, masks)


def samples_batch(
    prompts: list[torch.Tensor],
    responses: list[torch.Tensor],
    uids: list[str],
    generator: torch.Generator,
    temperature: float = 1.0,
    rank: int = 0,
    world_size: int = 1,
    response_masks: list[torch.Tensor] | None = None,
):
    """veRL 0.9.1 batch of the given samples: prompt i [P_i] and response i [T_i] token ids, group id `uids[i]`,
    `response_masks[i]` [T_i] (0: a token without a loss term, e.g. tool output; None: all ones). Old/reference
    log-probs and advantages are drawn from `generator`, rows shuffled by it; returns this rank's contiguous slice
    (no-padding nested input_ids, as `make_batch`)."""
    n = len(prompts)
    if response_masks is None:
        response_masks = [torch.ones(len(r), dtype=torch.long) for r in responses]
    p_max, r_max = max(len(p) for p in prompts), max(len(r) for r in responses)
    prompt_pad = torch.zeros(n, p_max, dtype=torch.long)
    resp_pad = torch.zeros(n, r_max, dtype=torch.long)
    attn = torch.zeros(n, p_max + r_max, dtype=torch.long)
    response_mask = torch.zeros(n, r_max, dtype=torch.long)
    for i, (p, r, m) in enumerate(zip(prompts, responses, response_masks, strict=True)):
        prompt_pad[i, p_max - len(p) :] = p
        resp_pad[i, : len(r)] = r
        attn[i, p_max - len(p) : p_max + len(r)] = 1
        response_mask[i, : len(r)] = m
    perm = torch.randperm(n, generator=generator)
    tensors = {
        "prompts": prompt_pad,
        "responses": resp_pad,
        "input_ids": torch.cat([prompt_pad, resp_pad], dim=1),
        "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "old_log_probs": -torch.rand(n, r_max, generator=generator) * 3 - 3.5,
        "ref_log_prob": -torch.rand(n, r_max, generator=generator) * 3 - 3.5,
        "advantages": torch.randn(n, 1, generator=generator).expand(n, r_max).contiguous(),
    }
    tensors = {k: v[perm] for k, v in tensors.items()}
    uid = np.array(uids, dtype=object)[perm.numpy()]
    rows = slice(rank * n // world_size, (rank + 1) * n // world_size)
    proto = DataProto.from_dict(
        tensors={k: v[rows] for k, v in tensors.items()},
        non_tensors={"uid": uid[rows]},
        meta_info={"temperature": temperature},
    )
    td = left_right_2_no_padding(proto.to_tensordict())
    tu.assign_non_tensor(
        td,
        use_remove_padding=False,
        use_dynamic_bsz=False,
        use_fused_kernels=False,
        global_batch_size=n,
    )
    return td


def _tokens(g: torch.Generator, low: int, high: int | None = None) -> torch.Tensor:
    """[n] random token ids, n = ``low`` or drawn from [low, high)."""
    n = low if high is None else int(torch.randint(low, high, (1,), generator=g))
    return torch.randint(1, VOCAB, (n,), generator=g)


def _masked(response: torch.Tensor, *positions: int) -> torch.Tensor:
    """[T] response mask, 0 at ``positions`` (tool output: no loss term)."""
    mask = torch.ones(len(response), dtype=torch.long)
    mask[list(positions)] = 0
    return mask


def system_prompt_batch(seed: int, temperature: float = 1.0, rank: int = 0, world_size: int = 1):
    """4 GRPO groups x 4 responses; every prompt is one 48-token system prompt + a 4-11 token user prompt."""
    g = torch.Generator().manual_seed(seed)
    system = _tokens(g, 48)
    prompts, responses, uids = [], [], []
    for k in range(4):
        prompt = torch.cat([system, _tokens(g, 4, 12)])
        for _ in range(4):
            prompts.append(prompt)
            responses.append(_tokens(g, 2, 9))
            uids.append(f"group-{k}")
    return samples_batch(prompts, responses, uids, g, temperature, rank, world_size)


def multi_turn_batch(seed: int, temperature: float = 1.0, rank: int = 0, world_size: int = 1):
    """Per-turn samples of 2 trajectories x 3 turns, each sample its own uid: turn k's prompt is turn k-1's prompt +
    response + a new user turn. Every response has tool tokens (mask 0) at positions 1 and 2; turn k's response is
    scored in sample k and lies inside the segment it shares with samples k+1, k+2."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, masks, uids = [], [], [], []
    for t in range(2):
        prompt = _tokens(g, 24)
        for turn in range(3):
            response = _tokens(g, 4, 8)
            prompts.append(prompt)
            responses.append(response)
            masks.append(_masked(response, 1, 2))
            uids.append(f"trajectory-{t}-turn-{turn}")
            prompt = torch.cat([prompt, response, _tokens(g, 3, 6)])
    return samples_batch(prompts, responses, uids, g, temperature, rank, world_size, masks)


def branched_batch(seed: int, temperature: float = 1.0, rank: int = 0, world_size: int = 1):
    """2 GRPO groups x 5 branched rollouts of one prompt: a 5-token trunk scored by every row, two 3-token
    branches, then tails; one row ends at the branch point, one repeats another. Tool tokens (mask 0) in the
    shared trunk (one row) and the shared branch (another)."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, masks, uids = [], [], [], []
    for k in range(2):
        prompt, trunk = _tokens(g, 10), _tokens(g, 5)
        branches = [torch.cat([trunk, _tokens(g, 3)]) for _ in range(2)]
        tails = [torch.cat([branches[0], _tokens(g, 2, 6)]), torch.cat([branches[0], _tokens(g, 2, 6)]),
                 torch.cat([branches[1], _tokens(g, 2, 6)])]
        rows = [tails[0], tails[1], tails[2], tails[2], trunk]
        row_masks = [_masked(tails[0], 1, 2), _masked(tails[1]), _masked(tails[2], 5), _masked(tails[2]),
                     _masked(trunk)]
        for response, mask in zip(rows, row_masks, strict=True):
            prompts.append(prompt)
            responses.append(response)
            masks.append(mask)
            uids.append(f"group-{k}")
    return samples_batch(prompts, responses, uids, g, temperature, rank, world_size, masks)


# batches whose rows share more than a GRPO prompt (this rank's slice, as ``samples_batch``)
TREE_BATCHES = {"system_prompt": system_prompt_batch, "multi_turn": multi_turn_batch, "branched": branched_batch}


def infer(engine, td, micro_batch_size: int) -> dict:
    """veRL's compute_log_prob call (log-probs and entropy, no loss): the engine's whole output
    (``model_output``, ``metrics``)."""
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, micro_batch_size_per_gpu=micro_batch_size)
    with engine.eval_mode():
        return engine.infer_batch(td, loss_function=None)


def compute_log_prob(engine, td, micro_batch_size: int):
    return infer(engine, td, micro_batch_size)["model_output"]


def train_step(engine, td, config, micro_batch_size: int):
    """One update_actor step; returns (full gradients, full parameters after the step, metrics: the engine's, and
    ``grad_norm``, the gradient norm veRL's clipping computed)."""
    tu.assign_non_tensor(
        td, calculate_entropy=config.entropy_coeff != 0, compute_loss=True, micro_batch_size_per_gpu=micro_batch_size
    )
    loss_fn = partial(ppo_loss, config=config)
    with engine.train_mode():
        engine.optimizer_zero_grad()
        out = engine.forward_backward_batch(td, loss_fn, forward_only=False)
        grads = {n: full(p.grad).clone() for n, p in engine.module.named_parameters() if p.grad is not None}
        metrics = {**out["metrics"], "grad_norm": engine.optimizer_step()}
    params = {n: full(p.data).clone() for n, p in engine.module.named_parameters()}
    return grads, params, metrics


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel_diff(a: dict, b: dict) -> float:
    """Relative L2 difference over all tensors of two name -> tensor dicts with equal keys."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / max(den, 1e-30)) ** 0.5
