"""Prefix-tree execution in one process (``tree_log_probs`` / ``tree_backward``, issue 19): equal to the standard
full forward/backward of every row, the detached gradient equal to its definition, memory and work as promised,
bad input rejected.

Trees come from ``random_tree`` (seeded, depth 1-4): scored tokens inside shared segments with different per-row
weights, a row that is a prefix of another (per-turn samples), identical rows, one-token segments and masked
tokens (weight 0); ``test_random_trees_cover_every_case`` checks each tree used has them.
"""

import random
import re
from dataclasses import dataclass, replace

import pytest
import torch

from verl_longstraw import Knobs, api, tree_backward, tree_log_probs
from verl_longstraw.adapters import adapter_for
from verl_longstraw.execute import run_segment
from verl_longstraw.memory import parameter_meter
from verl_longstraw.plan import Plan, star_plan, tree_plan
from verl_longstraw.score import Scoring
from verl_longstraw.state import Fixed, Rows
from verl_longstraw.testing.compare import Grads, float64_throughout, grads_of, max_abs_error, relative_error
from verl_longstraw.tiny import FAMILIES, VOCAB, tiny_model

VALUE_TOL = 1e-5  # float32 log-probs and entropies, absolute (as tests/test_core_equivalence.py)
GRAD_TOL = 1e-5  # float32 gradients, relative L2
FLOAT64_TOL = 1e-10  # test_tree_gradient_float64: measured <= 1e-15 (AMD EPYC Zen 4; passes with its AVX2 kernels too)
DETACHED_ERROR_MIN = 0.05  # detached vs standard gradient, relative L2 (tests/test_core_equivalence.py)
TREES = dict(zip(FAMILIES, ((11, 4), (12, 3), (13, 2), (14, 1), (21, 4)), strict=True))  # family: (seed, depth)
# (chunk_size, response_chunk_size, with_entropy)
CONFIGS = ((None, None, False), (None, 3, True), (5, None, True), (5, 3, False))
CHUNKED = (5, 3)  # the chunking of the float64 and detached tests


# -- trees ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tree:
    """Rows ``sequences[i]`` [L_i] (token ids) scored from token ``score_starts[i]`` on, and the loss of row i:
    sum_t weights[i][t] * log p_t (+ sum_t entropy_weights[i][t] * entropy_t), weights [L_i - score_starts[i]]."""

    sequences: list[torch.Tensor]
    score_starts: list[int]
    weights: list[torch.Tensor]
    entropy_weights: list[torch.Tensor]

    def loss(self, row: int, log_probs: torch.Tensor, entropies: torch.Tensor | None = None) -> torch.Tensor:
        """Row ``row``'s loss of its log-probs [T] (and entropies [T]): a scalar."""
        loss = (self.weights[row].to(log_probs) * log_probs).sum()
        if entropies is not None:
            loss = loss + (self.entropy_weights[row].to(entropies) * entropies).sum()
        return loss

    def loss_scale(self, row: int, with_entropy: bool) -> float:
        """Bound of |d loss| per unit of error of every value: the weights' L1 norm (the loss is linear in them)."""
        scale = float(self.weights[row].abs().sum())
        return scale + (float(self.entropy_weights[row].abs().sum()) if with_entropy else 0.0)


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(count)]


def random_tree(seed: int, depth: int) -> Tree:
    """A prefix tree of ``depth`` levels of branching under a shared prompt (depth 1: a prompt and its responses).

    Every node has 2-3 children (distinct first tokens), the first at level 1 one token long; the first child of
    every node branches on down to ``depth``, the others stop early at random. Rows: every leaf's path, scored from
    a random token at or after the prompt's last two (so scored tokens fall inside shared segments); one branch's
    path (a turn) and a leaf below it scored only after it (the next turn: an identical row to that leaf's with its
    own score start); the first row again. Loss weights: random, a quarter of them 0 (masked tokens)."""
    rng = random.Random(seed)
    prompt = _tokens(rng, rng.randint(6, 9))
    branches, leaves = [prompt], []

    def grow(prefix: list[int], level: int) -> None:
        for j, first in enumerate(rng.sample(range(VOCAB), rng.choice((2, 2, 3)))):
            leaf = level == depth or (j > 0 and rng.random() < 0.6)
            length = 1 if j == 0 and level == 1 else rng.randint(1, 6 if leaf else 4)
            path = prefix + [first] + _tokens(rng, length - 1)
            (leaves if leaf else branches).append(path)
            if not leaf:
                grow(path, level + 1)

    grow(prompt, 1)
    low = len(prompt) - 2
    rows = [(leaf, rng.randint(low, len(leaf) - 1)) for leaf in leaves]
    turn = rng.choice(branches[1:] or branches)
    later = rng.choice([leaf for leaf in leaves if leaf[: len(turn)] == turn])
    rows += [(turn, rng.randint(low, len(turn) - 1)), (later, rng.randint(len(turn), len(later) - 1)), rows[0]]
    rng.shuffle(rows)
    weights = [[0.0 if rng.random() < 0.25 else rng.uniform(-1.5, 1.5) for _ in range(len(r) - s)] for r, s in rows]
    entropy_weights = [[rng.uniform(-0.1, 0.1) for _ in range(len(r) - s)] for r, s in rows]
    return Tree([torch.tensor(r) for r, _ in rows], [s for _, s in rows], [torch.tensor(w) for w in weights],
                [torch.tensor(w) for w in entropy_weights])


def group_tree(system_len: int, groups: int, prompt_len: int, responses: int, response_len: int) -> Tree:
    """``groups`` GRPO groups sharing a system prompt of ``system_len`` tokens: group g's prompt is the system
    prompt + ``prompt_len`` tokens, its ``responses`` rows that prompt + ``response_len`` tokens, scored on the
    response; siblings differ at their first token. Unit weights."""
    gen = torch.Generator().manual_seed(system_len * 1000 + groups)
    system = torch.randint(0, VOCAB, (system_len,), generator=gen)
    rows = []
    for first in torch.randperm(VOCAB, generator=gen)[:groups]:
        prompt = torch.cat([system, first[None], torch.randint(0, VOCAB, (prompt_len - 1,), generator=gen)])
        for head in torch.randperm(VOCAB, generator=gen)[:responses]:
            rows.append(torch.cat([prompt, head[None], torch.randint(0, VOCAB, (response_len - 1,), generator=gen)]))
    start = system_len + prompt_len
    return Tree(rows, [start] * len(rows), [torch.ones(response_len)] * len(rows),
                [torch.zeros(response_len)] * len(rows))


def turns_tree(turns: int, user_len: int, response_len: int) -> Tree:
    """Per-turn samples of one ``turns``-turn trajectory: sample k is user turn 1, response 1, ..., user turn k,
    response k, scored on response k (sample k's prompt = sample k-1's row + user turn k). Unit weights."""
    gen = torch.Generator().manual_seed(turns)
    parts = [torch.randint(0, VOCAB, (n,), generator=gen) for _ in range(turns) for n in (user_len, response_len)]
    rows = [torch.cat(parts[: 2 * k]) for k in range(1, turns + 1)]
    return Tree(rows, [len(r) - response_len for r in rows], [torch.ones(response_len)] * turns,
                [torch.zeros(response_len)] * turns)


# -- references -----------------------------------------------------------------------------------------------------
@dataclass
class Standard:
    """The standard path's per-row log-probs and entropies [T_i], and by ``with_entropy`` its losses [rows] and
    gradient."""

    log_probs: list[torch.Tensor]
    entropies: list[torch.Tensor]
    losses: dict[bool, torch.Tensor]
    grads: dict[bool, Grads]


def row_log_probs(model, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One standard forward over row ``ids`` [L]: float32 log-probs and entropies [L - start] of tokens t >= start."""
    logits = model(ids[None]).logits[0, start - 1 : -1].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return log_probs.gather(-1, ids[start:, None])[:, 0], -(log_probs.exp() * log_probs).sum(-1)


def standard(model, tree: Tree, entropy_options: tuple[bool, ...] = (False, True)) -> Standard:
    """One full forward/backward per row, summed (``model``'s .grad is overwritten)."""
    result = Standard([], [], {}, {})
    for with_entropy in entropy_options:
        model.zero_grad(set_to_none=True)
        losses = []
        for row, (ids, start) in enumerate(zip(tree.sequences, tree.score_starts, strict=True)):
            log_probs, entropies = row_log_probs(model, ids, start)
            loss = tree.loss(row, log_probs, entropies if with_entropy else None)
            loss.backward()
            losses.append(loss.detach())
            if with_entropy == entropy_options[0]:
                result.log_probs.append(log_probs.detach())
                result.entropies.append(entropies.detach())
        result.losses[with_entropy] = torch.stack(losses)
        result.grads[with_entropy] = grads_of(model)
    return result


def _continued(kind, before: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """The state after a segment from the state ``before`` it and the segment's own ``value`` of one tensor."""
    if isinstance(kind, Rows):
        return value if before is None else torch.cat([before, value], dim=-2)
    if isinstance(kind, Fixed):
        return value
    raise TypeError(f"no reference for state kind {type(kind).__name__}")


def detached_grads(model, plan: Plan, tree: Tree, with_entropy: bool) -> Grads:
    """The detached gradient by its definition: each row walks its plan path segment by segment (``run_segment``,
    autograd inside a segment), continuing the concatenation of the detached states of the segments before it,
    and backpropagates its loss; summed over rows (``model``'s .grad is overwritten)."""
    adapter = adapter_for(model)
    kinds = adapter.specs()
    model.zero_grad(set_to_none=True)
    for row, (ids, start) in enumerate(zip(tree.sequences, tree.score_starts, strict=True)):
        past, log_probs, entropies = None, [], []
        for index in plan.path(plan.ends[row]):
            s = plan.segments[index]
            scoring = Scoring(ids[s.start + 1 : s.end + 1], 1.0, with_entropy)
            out = run_segment(adapter, ids[s.start : s.end], s.start, past, scoring)
            log_probs.append(out.log_probs)
            entropies.append(out.entropies)
            before = past or [(None,) * len(layer) for layer in kinds]
            past = [tuple(_continued(kind, b, v.detach()) for kind, b, v in zip(layer, bs, vs, strict=True))
                    for layer, bs, vs in zip(kinds, before, out.states, strict=True)]
        log_probs = torch.cat(log_probs)
        assert len(log_probs) == len(ids) - 1  # the path covers the row's positions
        loss = tree.loss(row, log_probs[start - 1 :], torch.cat(entropies)[start - 1 :] if with_entropy else None)
        loss.backward()
    return grads_of(model)


def state_bytes(model, plan: Plan, held_segments: int) -> int:
    """Bytes of the path store holding the ``Rows`` kinds' buffer of ``plan.capacity`` rows and the ``Fixed``
    kinds' values of ``held_segments`` segments."""
    dtype = next(model.parameters()).dtype
    kinds = [kind for layer in adapter_for(model).specs() for kind in layer]
    rows = sum(k.nbytes(plan.capacity, dtype) for k in kinds if isinstance(k, Rows))
    return rows + held_segments * sum(k.nbytes(0, dtype) for k in kinds if isinstance(k, Fixed))


def path_state_bytes(model, plan: Plan) -> int:
    """One root-to-leaf path's state: the Rows buffer and a Fixed value of every captured segment on the path
    with the most (an exact walk keeps each captured segment's state until its recompute, after its subtree)."""
    return state_bytes(model, plan, max((len(plan.path(c)) for c in plan.captured), default=0))


def scheduled_state_bytes(model, plan: Plan, mode: str) -> int:
    """The state held at its fullest following ``plan.steps(mode)``: after each capture, the Fixed values of the
    segments captured and not yet released."""
    held, most = set(), 0
    for step in plan.steps(mode):
        if step.writes is not None:
            held.add(step.writes)
            most = max(most, len(held))
        elif step.frees is not None:
            held.discard(step.frees)
    return state_bytes(model, plan, most)


def star_tokens(tree: Tree, prompt_lens: list[int]) -> int:
    """Tokens the star path (one ``star_plan`` per prompt: ``group_backward``, exact) runs for ``tree``'s rows, rows
    grouped by their prompt: consecutive rows with the same prompt of ``prompt_lens[i]`` tokens."""
    total, first = 0, 0
    while first < len(tree.sequences):
        prompt = tree.sequences[first][: prompt_lens[first]]
        last = first
        while last < len(tree.sequences) and torch.equal(tree.sequences[last][: prompt_lens[last]], prompt):
            last += 1
        responses = [len(r) - prompt_lens[first] for r in tree.sequences[first:last]]
        total += star_plan(len(prompt), responses).tokens_forwarded("exact")
        first = last
    return total


# -- fixtures -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    """(float32 model, its random tree, the standard path on it)."""
    model = tiny_model(request.param)
    tree = random_tree(*TREES[request.param])
    return model, tree, standard(model, tree)


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3")


def _run(model, tree: Tree, with_entropy: bool = False, **knobs):
    """tree_backward of ``tree``'s loss with ``Knobs(**knobs)``, from zero gradients: (result, gradient)."""
    model.zero_grad(set_to_none=True)
    result = tree_backward(model, tree.sequences, tree.score_starts, tree.loss, with_entropy=with_entropy,
                           knobs=Knobs(**knobs))
    return result, grads_of(model)


# -- 1. equivalence -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, depth", sorted(set(TREES.values())))
def test_random_trees_cover_every_case(seed, depth):
    """Each tree used has the shapes the equivalence test is about (so a generator change cannot drop one)."""
    tree = random_tree(seed, depth)
    plan = tree_plan(tree.sequences, tree.score_starts)
    seqs, starts = tree.sequences, tree.score_starts
    shared_scored = {s.index for s in plan.segments if s.children and s.scored}
    scorers = {i: [r for r in range(plan.num_rows) if any(p.segment == i for p in plan.pieces[r])]
               for i in shared_scored}
    assert any(len(rows) > 1 for rows in scorers.values()), "no shared segment scored by several rows"
    turns = [r for r in range(plan.num_rows) if not plan.is_leaf(plan.ends[r])]
    assert any(len(seqs[b]) > len(seqs[a]) and torch.equal(seqs[b][: len(seqs[a])], seqs[a])
               and starts[b] >= len(seqs[a]) for a in turns for b in range(plan.num_rows)), "no per-turn pair"
    pairs = [(a, b) for a in range(len(seqs)) for b in range(a) if torch.equal(seqs[a], seqs[b])]
    assert any(starts[a] == starts[b] for a, b in pairs) and any(starts[a] != starts[b] for a, b in pairs)
    one_token = [s for s in plan.segments if s.length == 1 and (s.children or depth == 1)]
    assert one_token, "no one-token segment"
    masked = False
    for row in range(plan.num_rows):
        for k in (tree.weights[row] == 0).nonzero()[:, 0].tolist():
            position = starts[row] - 1 + k
            masked |= any(plan.segments[i].start <= position < plan.segments[i].end
                          for i in plan.path(plan.ends[row]) if i in shared_scored)
    assert masked, "no masked token inside a shared scored segment"
    branching = [sum(len(plan.segments[i].children) > 1 for i in plan.path(e)) for e in plan.ends]
    assert max(branching) == depth


@pytest.mark.parametrize("chunk_size, response_chunk_size, with_entropy", CONFIGS)
def test_tree_matches_standard(case, chunk_size, response_chunk_size, with_entropy):
    """Log-probs, entropies, losses and the exact gradient equal one standard forward/backward per row; the state
    held at the fullest is one root-to-leaf path's."""
    model, tree, ref = case
    knobs = dict(chunk_size=chunk_size, response_chunk_size=response_chunk_size)
    values = tree_log_probs(model, tree.sequences, tree.score_starts, return_entropy=with_entropy,
                            knobs=Knobs(**knobs))
    assert values.losses is None
    assert [lp.shape for lp in values.log_probs] == [r.shape for r in ref.log_probs]
    assert max_abs_error(values.log_probs, ref.log_probs) < VALUE_TOL
    if with_entropy:
        assert max_abs_error(values.entropies, ref.entropies) < VALUE_TOL
    else:
        assert values.entropies is None

    result, grads = _run(model, tree, with_entropy=with_entropy, **knobs)
    assert relative_error(grads, ref.grads[with_entropy]) < GRAD_TOL
    assert max_abs_error(result.log_probs, ref.log_probs) < VALUE_TOL
    assert result.losses.shape == (len(tree.sequences),) and not result.losses.requires_grad
    for row, (loss, expected) in enumerate(zip(result.losses, ref.losses[with_entropy], strict=True)):
        assert abs(float(loss - expected)) <= VALUE_TOL * tree.loss_scale(row, with_entropy), row

    plan = tree_plan(tree.sequences, tree.score_starts, Knobs(**knobs))
    assert result.stats.prompt_state_bytes == path_state_bytes(model, plan)
    assert scheduled_state_bytes(model, plan, "exact") == path_state_bytes(model, plan)
    assert values.stats.prompt_state_bytes == scheduled_state_bytes(model, plan, "log_probs")


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_gradient_float64(family):
    """Float64 models computing in float64 throughout (``compare.float64_throughout``), chunked: the exact gradient
    and log-probs within FLOAT64_TOL of the standard ones."""
    model = tiny_model(family, dtype=torch.float64)
    tree = random_tree(*TREES[family])
    with float64_throughout():
        ref = standard(model, tree, (True,))
        result, grads = _run(model, tree, with_entropy=True, chunk_size=CHUNKED[0],
                             response_chunk_size=CHUNKED[1])
    assert relative_error(grads, ref.grads[True]) < FLOAT64_TOL
    assert max_abs_error(result.log_probs, ref.log_probs) < FLOAT64_TOL


# -- 2. detached ----------------------------------------------------------------------------------------------------
def test_detached_tree_is_its_definition(case, record_property):
    """prompt_grad="detached" equals the gradient with every segment's continued state held constant, and is far
    from the standard gradient."""
    model, tree, ref = case
    chunk_size, response_chunk_size = CHUNKED
    plan = tree_plan(tree.sequences, tree.score_starts,
                     Knobs(chunk_size=chunk_size, response_chunk_size=response_chunk_size))
    expected = detached_grads(model, plan, tree, with_entropy=True)
    result, grads = _run(model, tree, prompt_grad="detached", with_entropy=True, chunk_size=chunk_size,
                         response_chunk_size=response_chunk_size)
    assert relative_error(grads, expected) < GRAD_TOL
    bias = relative_error(grads, ref.grads[True])
    record_property("detached_relative_error", bias)
    assert DETACHED_ERROR_MIN < bias < 1.0, bias
    assert max_abs_error(result.log_probs, ref.log_probs) < VALUE_TOL
    assert result.stats.prompt_state_bytes == scheduled_state_bytes(model, plan, "detached")
    scoring = [plan.segments[c].length for c in plan.captured if plan.segments[c].scored]
    assert result.stats.tokens_recomputed == sum(scoring) > 0  # only the captured segments that score


# -- 3. memory ------------------------------------------------------------------------------------------------------
MEMORY_FAMILIES = ("qwen3", "qwen3_next", "deepseek_v3")  # one per adapter module


def _peak_saved(model, tree: Tree, **knobs) -> tuple[int, Plan]:
    """Peak bytes saved for backward by ``tree``'s tree_backward (parameters not counted), and its plan."""
    with parameter_meter(model) as meter:
        _run(model, tree, **knobs)
    return meter.peak, tree_plan(tree.sequences, tree.score_starts, Knobs(**knobs))


@pytest.mark.parametrize("family", MEMORY_FAMILIES)
def test_memory_flat_in_leaves(family):
    """16 leaves under one prompt, replayed one per batch, save no more than 2 (within 5%); the same 16 replayed
    in one batch save more (the meter sees the leaves)."""
    model = tiny_model(family)
    leaf = 16
    few, many = (group_tree(32, 1, 1, n, leaf) for n in (2, 16))
    small, _ = _peak_saved(model, few, chunk_size=8, replay_tokens=leaf)
    large, _ = _peak_saved(model, many, chunk_size=8, replay_tokens=leaf)
    batched, _ = _peak_saved(model, many, chunk_size=8, replay_tokens=16 * leaf)
    assert large <= 1.05 * small, (small, large)
    assert batched > 1.5 * small, (small, batched)


@pytest.mark.parametrize("family", MEMORY_FAMILIES)
def test_memory_flat_in_response_length(family):
    """A response of 8 L tokens with response_chunk_size=L saves for backward within 1.2x of a response of L
    tokens, beyond the path state's Rows buffer (the rows of the longer context: ``test_tree_matches_standard``
    bounds the state); replayed whole it saves more than 1.5x."""
    model = tiny_model(family)
    length = 8
    # MLA's attention (value dim != key dim: the "sdpa_mask" path) saves a concatenated copy of the context's
    # keys and values per segment; a prompt of 8 L keeps the 7 L extra rows' share of it below 1.2x (measured
    # 1.18x deepseek_v3; qwen3 1.01x, qwen3_next 1.00x)
    prompt = 8 * length + 1

    def activations(response: int, response_chunk_size: int | None) -> int:
        peak, plan = _peak_saved(model, group_tree(prompt - 1, 1, 1, 1, response), chunk_size=length,
                                 response_chunk_size=response_chunk_size, replay_tokens=8 * length)
        return peak - state_bytes(model, plan, 0)

    short, chunked, whole = activations(length, None), activations(8 * length, length), activations(8 * length, None)
    assert chunked <= 1.2 * short, (short, chunked)
    assert whole > 1.5 * short, (short, whole)


# -- 4. work --------------------------------------------------------------------------------------------------------
SYSTEM, PROMPT, RESPONSE = 12, 5, 4  # tokens: shared system prompt, per-group prompt, response
USER, TURN_RESPONSE, TURNS = 6, 5, 3


@pytest.mark.parametrize("chunk_size", (None, 5))
def test_work_groups_sharing_a_system_prompt(qwen3, chunk_size):
    """4 groups x 4 responses under one system prompt: the shared prompt and each group prompt are captured once
    and recomputed once, each response replayed once."""
    tree = group_tree(SYSTEM, 4, PROMPT, 4, RESPONSE)
    result, _ = _run(qwen3, tree, chunk_size=chunk_size)
    plan = tree_plan(tree.sequences, tree.score_starts, Knobs(chunk_size=chunk_size))
    captured = (SYSTEM - 1) + 4 * PROMPT  # input positions: the system prompt's shared, each group's own
    replayed = 16 * RESPONSE
    stats = result.stats
    assert (stats.tokens_captured, stats.tokens_recomputed, stats.tokens_replayed) == (captured, captured, replayed)
    assert stats.tokens_forwarded == plan.tokens_forwarded("exact") == 2 * captured + replayed
    star = star_tokens(tree, [SYSTEM + PROMPT] * 16)
    assert star == 4 * (2 * (SYSTEM + PROMPT - 1) + 4 * RESPONSE)  # every group's prompt captured + recomputed
    assert stats.tokens_forwarded < star


@pytest.mark.parametrize("chunk_size", (None, 5))
def test_work_per_turn_samples(qwen3, chunk_size):
    """Per-turn samples of a 3-turn trajectory: one chain, every position but the last response's captured once
    and recomputed once, the last response replayed once; the star path re-runs each sample's prompt."""
    tree = turns_tree(TURNS, USER, TURN_RESPONSE)
    result, _ = _run(qwen3, tree, chunk_size=chunk_size)
    plan = tree_plan(tree.sequences, tree.score_starts, Knobs(chunk_size=chunk_size))
    captured = TURNS * (USER + TURN_RESPONSE) - 1 - TURN_RESPONSE
    stats = result.stats
    assert (stats.tokens_captured, stats.tokens_recomputed, stats.tokens_replayed) == (captured, captured,
                                                                                       TURN_RESPONSE)
    assert stats.tokens_forwarded == plan.tokens_forwarded("exact") == 2 * captured + TURN_RESPONSE
    prompts = [k * USER + (k - 1) * TURN_RESPONSE for k in range(1, TURNS + 1)]
    star = star_tokens(tree, prompts)
    assert star == sum(2 * (p - 1) + TURN_RESPONSE for p in prompts)
    assert stats.tokens_forwarded < star


# -- 5. bad input and min_shared_tokens ----------------------------------------------------------------------------
# name: (the bad (sequences, score_starts, knobs) made from good sequences and score_starts, the field named)
BAD_INPUTS = {
    "empty row": (lambda s, t: ([s[0], s[1][:0]], t, {}), "sequences[1]"),
    "row too long": (lambda s, t: ([s[0], torch.zeros(4097, dtype=torch.long)], t, {}), "sequences[1]"),
    "one-token row": (lambda s, t: ([s[0], s[1][:1]], t, {}), "score_starts[1]"),
    "score start 0": (lambda s, t: (s, [t[0], 0], {}), "score_starts[1]"),
    "score start at the end": (lambda s, t: (s, [t[0], len(s[1])], {}), "score_starts[1]"),
    "score start not an int": (lambda s, t: (s, [t[0], float(t[1])], {}), "score_starts[1]"),
    "score starts missing": (lambda s, t: (s, t[:1], {}), "score_starts"),
    "chunk_size 0": (lambda s, t: (s, t, {"chunk_size": 0}), "chunk_size"),
    "response_chunk_size 0": (lambda s, t: (s, t, {"response_chunk_size": 0}), "response_chunk_size"),
    "min_shared_tokens 0": (lambda s, t: (s, t, {"min_shared_tokens": 0}), "min_shared_tokens"),
    "replay_tokens 0": (lambda s, t: (s, t, {"replay_tokens": 0}), "replay_tokens"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_names_the_field(qwen3, name):
    make_bad, field = BAD_INPUTS[name]
    tree = turns_tree(2, 3, 3)
    sequences, starts, knobs = make_bad(tree.sequences, tree.score_starts)
    qwen3.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=re.escape(field)):
        tree_log_probs(qwen3, sequences, starts, knobs=Knobs(**knobs))
    with pytest.raises(ValueError, match=re.escape(field)):
        tree_backward(qwen3, sequences, starts, tree.loss, knobs=Knobs(**knobs))
    assert all(p.grad is None for p in qwen3.parameters())  # rejected before computing anything


def test_a_plan_built_by_the_caller_serves_its_rows_only(qwen3, monkeypatch):
    """A plan passed in (the engine's, built once per step) is the one walked, not built again; one built for rows
    of other lengths, tokens or score starts, other plan knobs or another rank is a ValueError naming ``plan``,
    before anything is computed (a knob the plan does not read, prompt_grad, may differ)."""
    tree = turns_tree(2, 3, 3)
    knobs = Knobs(chunk_size=8)
    plan = tree_plan(tree.sequences, tree.score_starts, knobs)
    own = tree_log_probs(qwen3, tree.sequences, tree.score_starts, knobs=knobs)

    def no_build(*args, **kwargs):
        raise AssertionError("a plan passed in is built again")

    monkeypatch.setattr(api, "tree_plan", no_build)
    given = tree_log_probs(qwen3, tree.sequences, tree.score_starts, knobs=knobs, plan=plan)
    assert all(torch.equal(a, b) for a, b in zip(own.log_probs, given.log_probs, strict=True))
    tree_backward(qwen3, tree.sequences, tree.score_starts, tree.loss, knobs=Knobs(chunk_size=8,
                  prompt_grad="detached"), plan=plan)
    shorter = [tree.sequences[0], tree.sequences[1][:-1]]
    mismatches = {
        "lengths": (shorter, tree.score_starts, knobs, plan),
        # same lengths, one token changed: the tree's sharing would be another (a silent wrong value if accepted)
        "tokens": ([tree.sequences[0], torch.cat([tree.sequences[1][:-2], (tree.sequences[1][-2:-1] + 1) % 100,
                                                  tree.sequences[1][-1:]])], tree.score_starts, knobs, plan),
        "score starts": (tree.sequences, [tree.score_starts[0], tree.score_starts[1] + 1], knobs, plan),
        "knobs": (tree.sequences, tree.score_starts, Knobs(chunk_size=16), plan),
        "rank": (tree.sequences, tree.score_starts, knobs, replace(plan, rank=1, world=2)),
    }
    qwen3.zero_grad(set_to_none=True)
    for sequences, starts, other_knobs, other_plan in mismatches.values():
        with pytest.raises(ValueError, match="plan is not plan.tree_plan's"):
            tree_backward(qwen3, sequences, starts, tree.loss, knobs=other_knobs, plan=other_plan)
    assert all(p.grad is None for p in qwen3.parameters())


def test_bad_prompt_grad(qwen3):
    tree = turns_tree(2, 3, 3)
    with pytest.raises(ValueError, match="prompt_grad"):
        tree_backward(qwen3, tree.sequences, tree.score_starts, tree.loss, knobs=Knobs(prompt_grad="none"))


@pytest.mark.parametrize("row", (0, 1))  # row 0 ends inside the tree (a captured segment), row 1 at a leaf
def test_non_scalar_loss(qwen3, row):
    tree = turns_tree(2, 3, 3)

    def loss(i, log_probs):
        return log_probs if i == row else log_probs.sum()

    with pytest.raises(ValueError, match=rf"loss_fn must return a scalar tensor.*row {row}"):
        tree_backward(qwen3, tree.sequences, tree.score_starts, loss)


def test_min_shared_tokens(qwen3):
    """Groups share their system prompt only when it has at least min_shared_tokens tokens; either way the
    results are the standard ones, and not sharing costs the star's tokens."""
    tree = group_tree(SYSTEM, 3, PROMPT, 2, RESPONSE)
    ref = standard(qwen3, tree, (False,))
    forwarded = {}
    for min_shared, roots in ((SYSTEM, 1), (SYSTEM + 1, 3)):
        plan = tree_plan(tree.sequences, tree.score_starts, Knobs(min_shared_tokens=min_shared))
        assert len(plan.roots) == roots
        result, grads = _run(qwen3, tree, min_shared_tokens=min_shared)
        assert relative_error(grads, ref.grads[False]) < GRAD_TOL
        assert max_abs_error(result.log_probs, ref.log_probs) < VALUE_TOL
        values = tree_log_probs(qwen3, tree.sequences, tree.score_starts, knobs=Knobs(min_shared_tokens=min_shared))
        assert max_abs_error(values.log_probs, ref.log_probs) < VALUE_TOL
        forwarded[min_shared] = result.stats.tokens_forwarded
        assert forwarded[min_shared] == plan.tokens_forwarded("exact")
    assert forwarded[SYSTEM + 1] == star_tokens(tree, [SYSTEM + PROMPT] * 6) > forwarded[SYSTEM]


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("response_chunk_size", [None, 8])
def test_a_star_plans_as_its_tree(world, response_chunk_size):
    """``star_plan`` (the estimate's, the dry run's, ``group_backward``'s) and ``tree_plan`` (the engine's) of one
    GRPO group give every rank the same segments and steps, long responses cut into ``response_chunk_size``
    chains by both."""
    prompt_len, lengths = 100, [30, 17, 9]
    prompt = torch.randint(10, 50, (prompt_len,), generator=torch.Generator().manual_seed(0))
    rows = [torch.cat([prompt, torch.full((n,), 60 + i)]) for i, n in enumerate(lengths)]
    knobs = Knobs(chunk_size=40, response_chunk_size=response_chunk_size)
    for rank in range(world):
        star = star_plan(prompt_len, lengths, knobs, world, rank)
        tree = tree_plan(rows, [prompt_len] * len(rows), knobs, world, rank)
        assert star.segments == tree.segments
        assert list(star.steps("exact")) == list(tree.steps("exact"))
    # the prompt's 3 chunks, then 3 leaves, or chains of 8-token segments (a tail under R tokens joins the one before)
    chains = {None: 3, 8: 4 + 3 + 2 if world == 1 else 4 + 2 + 1}[response_chunk_size]
    assert len(star.segments) == 3 + chains
