"""Prefix trees in the longstraw engine == veRL's stock fsdp2 engine on batches whose rows share more than a
GRPO prompt (1 rank, gloo, CPU, fp32): a system prompt across groups, per-turn samples of multi-turn
trajectories, branched rollouts sharing scored response prefixes, and masked tool tokens inside shared segments.
The metrics show the sharing: the tokens forwarded and segments walked are the plan's (``plan.tree_plan`` on the
same rows), fewer than the rows run one by one."""

import dataclasses

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

import verl_longstraw.api as api_module
import verl_longstraw.integration.engine as engine_module
from verl_longstraw.integration.losses import PER_RESPONSE_POLICY_LOSSES
from verl_longstraw.integration.regroup import prefix_trees
from verl_longstraw.plan import tree_plan
from verl_longstraw.testing.verl_harness import (
    TREE_BATCHES,
    actor_config,
    infer,
    make_engine,
    rel_diff,
    save_tiny_model,
    train_step,
)

MIN_SHARED = 8  # longstraw.min_shared_tokens: shorter than the test prompts, so every case shares
TOL = 1e-5  # fp32: log-probs and entropies (absolute), gradients and parameters after the step (relative)




@pytest.fixture(scope="module")
def engines(dist, tmp_path_factory):
    """Per family: (stock fsdp2 engine, longstraw engine with min_shared_tokens=MIN_SHARED), from one saved model."""
    cache = {}
    root = tmp_path_factory.mktemp("tree_models")

    def get(family):
        if family not in cache:
            path = save_tiny_model(family, str(root / family))
            stock = make_engine("fsdp2", path, actor_config("fsdp2", "token-mean", False, 0.0, 1), 1)
            longstraw = make_engine(
                "longstraw", path,
                actor_config("longstraw", "token-mean", False, 0.0, 1, min_shared_tokens=MIN_SHARED), 1,
            )
            cache[family] = stock, longstraw
        return cache[family]

    return get


def plans(td, knobs):
    """The plans the engine walks for ``td`` as one micro-batch (one per tree), and the plans of its rows run
    one by one (the same knobs, nothing shared)."""
    trees = prefix_trees([td])

    def plan(sequences, starts):
        return tree_plan(sequences, starts, knobs.knobs)

    shared = [plan(t.sequences, t.score_starts) for t in trees]
    alone = [plan([s], [p]) for t in trees for s, p in zip(t.sequences, t.score_starts, strict=True)]
    return shared, alone


def metric_sum(metrics: dict, key: str) -> float:
    return sum(metrics[key].values)


def assert_walked(metrics: dict, td, knobs, modes: tuple[str, ...]) -> None:
    """The step ran the plans of ``td``'s trees, one walk per mode in ``modes``, and forwarded fewer tokens than
    its rows would one by one."""
    shared, alone = plans(td, knobs)
    tokens = sum(p.tokens_forwarded(mode) for p in shared for mode in modes)
    assert metric_sum(metrics, "longstraw/tokens_forwarded") == tokens
    assert metric_sum(metrics, "longstraw/tree_segments") == len(modes) * sum(len(p.segments) for p in shared)
    assert tokens < sum(p.tokens_forwarded(mode) for p in alone for mode in modes)


@pytest.mark.parametrize("case", sorted(TREE_BATCHES))
def test_compute_log_prob_matches_fsdp2(engines, case):
    """Forward only: the same log-probs and entropies; each input position of a tree is run once (fewer tokens
    than the rows' own input positions)."""
    stock, longstraw = engines("qwen3")
    td = TREE_BATCHES[case](seed=1, temperature=0.7)
    a = infer(stock, td.clone(), len(td))["model_output"]
    out = infer(longstraw, td.clone(), len(td))
    for key in ("log_probs", "entropy"):
        x, y = no_padding_2_padding(a[key], td), no_padding_2_padding(out["model_output"][key], td)
        assert (x - y).abs().max().item() <= TOL, key
    assert_walked(out["metrics"], td, longstraw.longstraw, ("log_probs",))
    row_positions = int(td["input_ids"].offsets().diff().sum()) - len(td)
    assert metric_sum(out["metrics"], "longstraw/tokens_forwarded") < row_positions


@dataclasses.dataclass(frozen=True)
class Case:
    """One update_actor step: the batch (``TREE_BATCHES``), veRL's policy loss and aggregation, the model family, the
    longstraw knobs, and the micro-batch size (None: the whole batch, one micro-batch)."""

    batch: str
    loss_mode: str = "vanilla"
    agg: str = "token-mean"
    family: str = "qwen3"
    single_forward: bool = True
    response_chunk_size: int | None = None
    micro_batch_size: int | None = None

    @property
    def policy_loss(self) -> dict:
        """veRL's PolicyLossConfig fields; clip_cov with bounds that clip tokens of these tiny models (a loss
        that reads the whole batch's log-probs: two passes)."""
        if self.loss_mode == "clip_cov":
            return {"loss_mode": "clip_cov", "clip_cov_lb": 0.0, "clip_cov_ratio": 0.1}
        return {"loss_mode": self.loss_mode}

    @property
    def replays_once(self) -> bool:
        """Whether the step takes one replay per response (else two passes)."""
        return self.single_forward and self.loss_mode in PER_RESPONSE_POLICY_LOSSES


CASES = {
    "system_prompt-vanilla": Case("system_prompt"),
    "system_prompt-two_pass-mbs8": Case("system_prompt", single_forward=False, micro_batch_size=8),
    "multi_turn-gspo": Case("multi_turn", "gspo", "seq-mean-token-mean"),
    "multi_turn-vanilla-two_pass": Case("multi_turn", agg="seq-mean-token-sum", single_forward=False),
    "branched-clip_cov": Case("branched", "clip_cov"),
    "branched-cispo-response_chunk3": Case("branched", "cispo", response_chunk_size=3),
    "multi_turn-clip_cov-response_chunk3": Case("multi_turn", "clip_cov", response_chunk_size=3),
    "branched-qwen3_5": Case("branched", agg="seq-mean-token-mean", family="qwen3_5"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_update_actor_matches_fsdp2(engines, name, monkeypatch):
    """One update_actor step with KL loss and entropy on: the parameters fsdp2 reaches; the path taken (one replay
    per response, or two passes) is the one asked for; clip_cov clips the same tokens; with one micro-batch, the
    plan's tokens and segments, each tree's plan built once in the step (the walks read the engine's)."""
    built = {"engine": 0, "walk": 0}

    def counting(where: str, build):
        def counted(*args, **kwargs):
            built[where] += 1
            return build(*args, **kwargs)
        return counted

    monkeypatch.setattr(engine_module, "tree_plan", counting("engine", engine_module.tree_plan))
    monkeypatch.setattr(api_module, "tree_plan", counting("walk", api_module.tree_plan))
    case = CASES[name]
    stock, longstraw = engines(case.family)
    td = TREE_BATCHES[case.batch](seed=2)
    mbs = case.micro_batch_size or len(td)
    cfg_s, cfg_l = (actor_config(s, case.agg, True, 0.01, mbs, policy_loss=case.policy_loss)
                    for s in ("fsdp2", "longstraw"))
    knobs = longstraw.longstraw
    longstraw.longstraw = dataclasses.replace(knobs, single_forward=case.single_forward,
                                              response_chunk_size=case.response_chunk_size)
    try:
        torch.manual_seed(0)  # clip_cov draws the clipped tokens from the global generator
        gs, ps, stock_metrics = train_step(stock, td.clone(), cfg_s, mbs)
        torch.manual_seed(0)
        gl, pl, metrics = train_step(longstraw, td.clone(), cfg_l, mbs)
        assert set(metrics["longstraw/single_forward"].values) == {float(case.replays_once)}
        if mbs == len(td):
            modes = ("exact",) if case.replays_once else ("log_probs", "exact")
            assert_walked(metrics, td, longstraw.longstraw, modes)
            assert built == {"engine": len(prefix_trees([td])), "walk": 0}
    finally:
        longstraw.longstraw = knobs
    if case.loss_mode == "clip_cov":
        clipped = stock_metrics["actor/pg_clipfrac"].values
        assert min(clipped) > 0 and metrics["actor/pg_clipfrac"].values == clipped
    assert rel_diff(gl, gs) <= TOL
    assert rel_diff(pl, ps) <= TOL


def count_trees(monkeypatch) -> list[int]:
    """The number of micro-batches of each ``prefix_trees`` call the engine makes from now on."""
    made = []

    def counted(micro_batches, *args, **kwargs):
        made.append(len(micro_batches))
        return prefix_trees(micro_batches, *args, **kwargs)

    monkeypatch.setattr(engine_module, "prefix_trees", counted)
    return made


@pytest.mark.parametrize("single_forward", [True, False], ids=["single_forward", "two_pass"])
def test_one_walk_spans_the_micro_batches(engines, single_forward, monkeypatch):
    """Micro-batches of 4 rows, groups spread across them (4 groups sharing a system prompt): the step walks
    every row as one set of trees (the tokens forwarded are those trees' plans', fewer than the micro-batches'
    own trees'), while each row's loss term stays its micro-batch's. Without veRL's ``global_batch_size``,
    seq-mean-token-mean divides each micro-batch's loss by its own count of rows, so weighing a row by the tree's
    rows instead (1/16, not 1/4) moves the parameters away from fsdp2's. The micro-batches' own trees (the
    pre-flight's fallback) are never made: the call's fit."""
    made = count_trees(monkeypatch)
    stock, longstraw = engines("qwen3")
    td = TREE_BATCHES["system_prompt"](seed=3)
    tu.assign_non_tensor(td, global_batch_size=None)
    mbs = 4  # the batch's rows are shuffled (``samples_batch``): each group's in several micro-batches
    agg = "seq-mean-token-mean"
    cfg_s, cfg_l = (actor_config(s, agg, True, 0.01, mbs) for s in ("fsdp2", "longstraw"))
    knobs = longstraw.longstraw
    longstraw.longstraw = dataclasses.replace(knobs, single_forward=single_forward)
    try:
        gs, ps, _ = train_step(stock, td.clone(), cfg_s, mbs)
        gl, pl, metrics = train_step(longstraw, td.clone(), cfg_l, mbs)
    finally:
        longstraw.longstraw = knobs
    assert rel_diff(gl, gs) <= TOL
    assert rel_diff(pl, ps) <= TOL
    assert made and set(made) == {len(td) // mbs}  # the whole call's trees only
    modes = ("exact",) if single_forward else ("log_probs", "exact")
    assert_walked(metrics, td, longstraw.longstraw, modes)
    per_micro_batch = [p for mb in tu.chunk_tensordict(td, len(td) // mbs) for p in plans(mb, longstraw.longstraw)[0]]
    tokens = metric_sum(metrics, "longstraw/tokens_forwarded")
    assert tokens < sum(p.tokens_forwarded(mode) for p in per_micro_batch for mode in modes)
    assert metric_sum(metrics, "longstraw/unshared_tokens_forwarded") == int(td["input_ids"].offsets()[-1])


def test_preflight_walks_the_micro_batches_where_one_walk_would_not_fit(engines, monkeypatch):
    """When the estimate says a tree of the whole call does not fit (here: any tree of more than 4 rows), the
    micro-batches' own trees are walked (made once the call's were refused): fsdp2's parameters, the tokens of the
    per-micro-batch plans."""
    made = count_trees(monkeypatch)
    monkeypatch.setattr(engine_module.LongStrawEngine, "_over_budget",
                        lambda self, unit, estimate, model_bytes: "too big" if len(unit.rows) > 4 else None)
    stock, longstraw = engines("qwen3")
    td = TREE_BATCHES["system_prompt"](seed=4)
    mbs = 4
    cfg_s, cfg_l = (actor_config(s, "token-mean", False, 0.0, mbs) for s in ("fsdp2", "longstraw"))
    gs, ps, _ = train_step(stock, td.clone(), cfg_s, mbs)
    gl, pl, metrics = train_step(longstraw, td.clone(), cfg_l, mbs)
    assert rel_diff(gl, gs) <= TOL
    assert rel_diff(pl, ps) <= TOL
    assert made == [len(td) // mbs] + [1] * (len(td) // mbs)  # the call's trees, refused, then each micro-batch's
    per_micro_batch = [p for mb in tu.chunk_tensordict(td, len(td) // mbs) for p in plans(mb, longstraw.longstraw)[0]]
    assert metric_sum(metrics, "longstraw/fragments") == len(per_micro_batch)
    tokens = sum(p.tokens_forwarded("exact") for p in per_micro_batch)
    assert metric_sum(metrics, "longstraw/tokens_forwarded") == tokens


@pytest.mark.parametrize("single_forward", [True, False], ids=["single_forward", "two_pass"])
def test_dynamic_batch_sizes_match_fsdp2(engines, single_forward):
    """veRL's use_dynamic_bsz (micro-batches packed by a token budget, rows reordered and restored): one walk over
    the call, fsdp2's log-probs in veRL's row order and its parameters after a step with KL and entropy on."""
    stock, longstraw = engines("qwen3")
    td = TREE_BATCHES["multi_turn"](seed=5)
    budget = int(td["input_ids"].offsets().diff().max()) + 8  # one or two rows per micro-batch
    tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=budget)
    a = infer(stock, td.clone(), 1)
    b = infer(longstraw, td.clone(), 1)
    for key in ("log_probs", "entropy"):
        x, y = no_padding_2_padding(a["model_output"][key], td), no_padding_2_padding(b["model_output"][key], td)
        assert (x - y).abs().max().item() <= TOL, key
    assert metric_sum(b["metrics"], "longstraw/fragments") == len(prefix_trees([td]))
    cfg_s, cfg_l = (actor_config(s, "seq-mean-token-mean", True, 0.01, 1) for s in ("fsdp2", "longstraw"))
    knobs = longstraw.longstraw
    longstraw.longstraw = dataclasses.replace(knobs, single_forward=single_forward)
    try:
        gs, ps, _ = train_step(stock, td.clone(), cfg_s, 1)
        gl, pl, _ = train_step(longstraw, td.clone(), cfg_l, 1)
    finally:
        longstraw.longstraw = knobs
    assert rel_diff(gl, gs) <= TOL
    assert rel_diff(pl, ps) <= TOL
