"""Regroup samples: a walk's micro-batches into rows for prefix trees (``prefix_trees``: whatever the rows share,
found from their token ids by the plan; ``WalkRows`` numbers the rows across the micro-batches), and a micro-batch's
rows into their GRPO groups (``grpo_groups``, by uid and prompt: the star path's units, what the
``longstraw/star_tokens_forwarded`` metric counts)."""

import bisect
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from tensordict import TensorDict

from ..plan import Plan


@dataclass
class Tree:
    """Samples of one walk run as one prefix tree (``verl_longstraw.plan.tree_plan`` finds what they share).

    rows: walk rows (``WalkRows``); sequences: [P_i + T_i] prompt ++ response tokens per row (no padding);
    score_starts: P_i (the first response token is the first scored); temperature: the rows' common one.
    """

    rows: list[int]
    sequences: list[torch.Tensor]
    score_starts: list[int]
    temperature: float
    plan: Optional[Plan] = None  # this rank's plan with the engine's knobs, built once per step (engine._unit_plan)


def prefix_trees(micro_batches: Sequence[TensorDict], first_row: int = 0) -> list[Tree]:
    """The rows with response tokens of no-padding micro-batches (rows numbered across them in order from
    ``first_row``: a walk's rows, ``WalkRows``), one tree per sampling temperature (one capture serves one
    temperature), in first-seen row order. Rows without response tokens are in no tree: they have nothing to
    score and, as in veRL's engines, no loss term."""
    trees: dict[float, Tree] = {}
    first = first_row
    for data in micro_batches:
        values = data["input_ids"].values()
        offsets = data["input_ids"].offsets().tolist()
        lengths = prompt_lengths(data).tolist()
        temperatures = sample_temperatures(data, len(offsets) - 1)
        for row, p in enumerate(lengths):
            if p < 1:
                raise ValueError(f"sample {row} has no prompt tokens; LongStraw needs at least one.")
            if offsets[row + 1] - offsets[row] <= p:
                continue
            tree = trees.setdefault(temperatures[row], Tree([], [], [], temperatures[row]))
            tree.rows.append(first + row)
            tree.sequences.append(values[offsets[row] : offsets[row + 1]])
            tree.score_starts.append(int(p))
        first += len(data)
    return list(trees.values())


class WalkRows:
    """The rows of one walk: its micro-batches' rows numbered in order (row ``g`` is row ``g - first[m]`` of
    micro-batch ``m``). A unit's ``rows`` are these numbers."""

    def __init__(self, micro_batches: Sequence[TensorDict]):
        self.micro_batches = list(micro_batches)
        self.first = [0]
        for data in self.micro_batches:
            self.first.append(self.first[-1] + len(data))

    def __len__(self) -> int:
        return self.first[-1]

    def locate(self, row: int) -> tuple[int, int]:
        """(micro-batch index, row within it) of walk row ``row``."""
        m = bisect.bisect_right(self.first, row) - 1
        return m, row - self.first[m]

    def of(self, m: int) -> range:
        """The walk rows of micro-batch ``m``."""
        return range(self.first[m], self.first[m + 1])


def prompt_lengths(data: TensorDict) -> torch.Tensor:
    """[B] unpadded prompt length per sample, in veRL 0.9.1's no-padding layout."""
    prompts = data["prompts"]
    if prompts.is_nested:
        return prompts.offsets().diff()
    return data["attention_mask"][:, : prompts.shape[1]].sum(dim=1)


def sample_uids(data: TensorDict) -> Optional[list[Any]]:
    """Per-sample group ids (`uid`) when the batch carries them."""
    if "uid" not in data.keys():
        return None
    uids = data["uid"]
    if hasattr(uids, "tolist"):
        uids = uids.tolist()
    return list(uids)


def sample_temperatures(data: TensorDict, batch_size: int) -> list[float]:
    """Per-sample temperature: veRL passes a scalar or a [B] tensor."""
    temperature = data["temperature"] if "temperature" in data.keys() else 1.0
    if isinstance(temperature, torch.Tensor) and temperature.numel() > 1:
        return [float(t) for t in temperature.reshape(-1).tolist()]
    return [float(temperature)] * batch_size


def prompt_checksums(data: TensorDict, lengths: torch.Tensor) -> torch.Tensor:
    """[B] int64 checksum of each row's prompt tokens (the first ``lengths[b]`` of its ``input_ids``),
    computed on the batch's device with no host sync.

    Sum over prompt positions t of ``id_t * w_t``, position weights ``w_t`` in [1, 8191]: equal
    prompts have equal checksums; rows with equal checksums are compared token by token.
    """
    input_ids = data["input_ids"]
    values, offsets = input_ids.values(), input_ids.offsets()
    rows = torch.arange(len(offsets) - 1, device=values.device)
    row_of = torch.repeat_interleave(rows, offsets.diff(), output_size=values.numel())
    position = torch.arange(values.numel(), device=values.device) - offsets[row_of]
    weights = position * 2654435761 % 8191 + 1
    terms = torch.where(position < lengths.to(values.device)[row_of], values.long() * weights, 0)
    return torch.zeros(len(rows), dtype=torch.long, device=values.device).index_add_(0, row_of, terms)


def grpo_groups(data: TensorDict) -> list[list[int]]:
    """The rows of a no-padding micro-batch grouped by (uid, prompt tokens, temperature), each group in first-seen
    row order.

    `input_ids` is a nested [B, P_i + T_i] tensor. Rows sharing a prompt but not a uid stay in separate groups, as do
    rows whose temperatures differ (one capture serves one temperature). Rows without response tokens are in no
    group: they have nothing to score and, as in veRL's engines, no loss term. Rows are matched by uid, prompt
    length and `prompt_checksums`, then each group's prompts are compared on the device at once (one host sync per
    group).
    """
    input_ids = data["input_ids"]
    values = input_ids.values()
    offsets = input_ids.offsets().tolist()
    lengths = prompt_lengths(data)
    checksums = prompt_checksums(data, lengths).tolist()
    lengths = lengths.tolist()
    batch_size = len(offsets) - 1
    uids = sample_uids(data) or [None] * batch_size
    temperatures = sample_temperatures(data, batch_size)
    candidates: dict[tuple, list[int]] = {}
    for row in range(batch_size):
        p = int(lengths[row])
        if p < 1:
            raise ValueError(f"sample {row} has no prompt tokens; LongStraw needs at least one.")
        if offsets[row + 1] - offsets[row] > p:
            candidates.setdefault((uids[row], p, checksums[row], temperatures[row]), []).append(row)
    groups = []
    for (_, p, _, _), rows in candidates.items():
        prompts = [values[offsets[row] : offsets[row] + p] for row in rows]
        groups.extend(_same_prompt_runs(rows, prompts))
    return groups


def _same_prompt_runs(rows: list[int], prompts: list[torch.Tensor]) -> list[list[int]]:
    """`rows` split by identical prompt ([P] each, equal length); one device comparison when all match."""
    if bool(torch.stack([prompt.eq(prompts[0]).all() for prompt in prompts]).all()):
        return [rows]
    runs: list[tuple[torch.Tensor, list[int]]] = []  # a checksum collision: compare pairwise
    for row, prompt in zip(rows, prompts, strict=True):
        run = next((members for first, members in runs if torch.equal(first, prompt)), None)
        if run is None:
            runs.append((prompt, [row]))
        else:
            run.append(row)
    return [members for _, members in runs]


def check_positions(data: TensorDict) -> None:
    """LongStraw places tokens at positions 0..L-1; reject other layouts (e.g. 3-D mrope)."""
    position_ids = data["position_ids"]
    if position_ids.dim() != 2:
        raise ValueError("LongStraw supports 1-D position ids only (text models); got multimodal position ids.")
    offsets = position_ids.offsets()
    expected = torch.cat([torch.arange(int(n), device=offsets.device) for n in offsets.diff().tolist()])
    if not torch.equal(position_ids.values().to(expected.device), expected):
        raise ValueError("LongStraw requires position_ids = 0..L-1 per sample (no packing, no offsets).")


def response_starts(data: TensorDict) -> list[int]:
    """Per row, the flat position of its first response log-prob in veRL's layout over prompt + response
    (position t scores token t+1, so response values start at the last prompt token: offset + P_i - 1)."""
    offsets = data["input_ids"].offsets().tolist()
    return [offsets[row] + int(p) - 1 for row, p in enumerate(prompt_lengths(data).tolist())]


def scatter_response_values(
    per_row: Sequence[Optional[torch.Tensor]], data: TensorDict, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Place each row's [T_i] response values at positions P_i-1 .. P_i+T_i-2 of a [total] flat tensor.

    That is veRL's layout for log_probs/entropy over prompt + response (position t scores token t+1);
    other positions, and rows whose entry is None (no response tokens), are zero.
    """
    values = data["input_ids"].values()
    out = torch.zeros(values.numel(), dtype=dtype, device=values.device)
    for start, vals in zip(response_starts(data), per_row, strict=True):
        if vals is not None:
            out[start : start + vals.numel()] = vals
    return out


def gather_response_values(flat: torch.Tensor, data: TensorDict) -> list[torch.Tensor]:
    """Inverse of `scatter_response_values`: per-row [T_i] views of a [total] flat tensor."""
    ends = data["input_ids"].offsets()[1:].tolist()
    return [flat[start : end - 1] for start, end in zip(response_starts(data), ends, strict=True)]
