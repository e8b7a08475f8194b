"""Which veRL losses split into per-response terms, so training can replay each response once.

veRL's ``ppo_loss`` (verl/workers/utils/losses.py) aggregates a policy loss, an entropy term and a KL
term with ``agg_loss``. Once the batch normalisers are fixed (``dp_size``, ``batch_num_tokens``,
``global_batch_size``, the loss-mask counts: all known from the masks before any forward), every
``loss_agg_mode`` veRL ships is a sum over responses of a term that reads only that response's
log-probs and entropies. Then d(loss)/d(response i's log-probs) is the gradient of the loss evaluated
with response i's log-probs live and any fixed values elsewhere, and each response can backpropagate
its own term inside its replay. Policy losses that read batch statistics of the log-probs (clip_cov and
kl_cov select tokens by a covariance over the batch) do not split; neither does a loss this module
does not know. Those keep the two-pass path.
"""

import functools
from typing import Callable

from verl.workers.utils.losses import ppo_loss

# policy losses (verl.trainer.ppo.core_algos, register_policy_loss) whose per-token or per-sequence terms
# read only their own response: ratios, clipping and sequence means are per row, normalisers come from masks
PER_RESPONSE_POLICY_LOSSES = frozenset(
    {"vanilla", "gspo", "gpg", "sapo", "geo_mean", "cispo", "dppo_tv", "dppo_kl"}
)


def splits_by_response(loss_function: Callable) -> bool:
    """Whether ``loss_function`` (what veRL's worker hands the engine: ``partial(ppo_loss, config=...)``) is
    a sum of per-response terms given the batch normalisers (see the module docstring)."""
    if not isinstance(loss_function, functools.partial) or loss_function.func is not ppo_loss:
        return False
    config = loss_function.keywords.get("config")
    policy_loss = getattr(config, "policy_loss", None) or {}
    return policy_loss.get("loss_mode", "vanilla") in PER_RESPONSE_POLICY_LOSSES
