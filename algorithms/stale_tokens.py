"""Stale-token masking (AReaL's ``actor.max_token_version_gap``): the rule, on plain lists.

Consumes, per sequence of a training step, its output tokens' policy versions and loss
mask, the version being trained and the gap; emits the loss masks the step trains with
and the counts its metrics are made of. Keyed by nothing: one call per step
(trainers/trainer.py applies it to the step's items before the token advantages and the
policy loss).

The rule (AReaL's, ``docs/en/algorithms/partial_rollout.md``): an output token generated
by version ``u`` is *stale* when ``v - u > max_gap``, ``v`` the version of the weights
being trained (the trainer's version before the update); a gap equal to ``max_gap`` is
still trained. A stale token keeps its place in the sequence -- it is context for every
later token, in the forward of the update and of pi_prox -- but leaves the loss mask, so
it drops out of everything computed "over the trained tokens":

* the policy loss and its aggregation denominators (trainers/ppo_actor.py),
* GAE and the discounted returns (timesteps are the trained tokens, algorithms/gae.py;
  the terminal reward goes on the last *trained* token, which is the freshest one:
  versions never decrease along a sequence),
* the batch levels of the advantage normalisation (trainers/token_advantages.py), and
  the critic's loss.

A sequence generated across a weights switch (interruptible generation: ``0 0 1 1 2``)
straddles the gap: only its old prefix is masked. A sequence whose every token is stale
trains nothing. ``max_gap`` None: the rule is off and the masks come back as they are.

Why per token and not per group: the tail gate (``rollout.max_head_offpolicyness``)
bounds a group by its *oldest* token; with partial rollouts a long sequence's newest
tokens are often on-policy while its first ones are not. prime-rl drops whole samples
instead; AReaL and xtuner mask tokens, as here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import AlgorithmInputError


@dataclass(frozen=True)
class StaleCounts:
    """What one application of the rule did (AReaL's statistics, one step)."""

    #: Whether the rule is on (``max_gap`` set): off, it reports no metrics.
    active: bool = False
    #: Output tokens with loss mask 1 before the rule (AReaL's ``stale_generated_tokens``).
    trainable: int = 0
    #: Of those, the tokens the rule took out of the mask (``stale_masked_tokens``).
    masked: int = 0
    #: Sequences keeping some tokens while losing others (``stale_partially_masked_trajectories``).
    partial_seqs: int = 0
    #: Sequences that had trainable tokens and lost every one.
    emptied_seqs: int = 0

    @property
    def masked_ratio(self) -> float:
        """``stale_masked_ratio``: masked over trainable tokens (0 with none trainable)."""
        return self.masked / self.trainable if self.trainable else 0.0

    def metrics(self, *, empty_minibatches: int = 0, minibatches: int = 0,
                prefix: str = "actor/") -> dict[str, float]:
        """The step's metrics (none when the rule is off). ``empty_minibatches`` of
        ``minibatches``: optimizer minibatches left with no trained token (AReaL's
        ``stale_empty_minibatch_fraction``; their step changes nothing)."""
        if not self.active:
            return {}
        return {f"{prefix}stale_masked_ratio": self.masked_ratio,
                f"{prefix}stale_masked_tokens": float(self.masked),
                f"{prefix}stale_partially_masked_seqs": float(self.partial_seqs),
                f"{prefix}stale_emptied_seqs": float(self.emptied_seqs),
                f"{prefix}stale_empty_minibatch_fraction": (empty_minibatches / minibatches
                                                            if minibatches else 0.0)}


def check_max_gap(max_gap: int | None) -> None:
    """Raise :class:`AlgorithmInputError` unless ``max_gap`` is None or an int >= 0."""
    if max_gap is not None and (isinstance(max_gap, bool) or not isinstance(max_gap, int) or max_gap < 0):
        raise AlgorithmInputError(
            f"max_token_version_gap={max_gap!r} must be an integer >= 0 (0: train only tokens of "
            "the version being trained) or null (off)")


def stale_token_masks(versions: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]], *,
                      version: int, max_gap: int | None) -> tuple[list[list[int]], StaleCounts]:
    """The loss masks after the rule, one per sequence, and what it did.

    ``versions[i][t]`` / ``loss_masks[i][t]``: output token t of sequence i (equal
    lengths per sequence). A token stays trained when its mask is 1 and
    ``version - versions[i][t] <= max_gap``. Vectorised over the whole step (one flat
    tensor), no Python per token.
    """
    check_max_gap(max_gap)
    if len(versions) != len(loss_masks):
        raise AlgorithmInputError(f"stale_token_masks: {len(versions)} version lists for "
                                  f"{len(loss_masks)} loss masks")
    lengths = [len(m) for m in loss_masks]
    for i, (v, n) in enumerate(zip(versions, lengths)):
        if len(v) != n:
            raise AlgorithmInputError(f"stale_token_masks: sequence {i} has {len(v)} versions for "
                                      f"{n} loss-mask entries")
    if max_gap is None:  # off: the masks as they are (the same lists)
        return list(loss_masks), StaleCounts()
    if not sum(lengths):
        return [list(m) for m in loss_masks], StaleCounts(active=True)
    mask_N = torch.cat([torch.tensor(m, dtype=torch.bool) for m in loss_masks])
    vers_N = torch.cat([torch.tensor(v, dtype=torch.long) for v in versions])
    keep_N = mask_N & (version - vers_N <= max_gap)
    seq_N = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    had_S = torch.zeros(len(lengths), dtype=torch.long).index_add_(0, seq_N, mask_N.long())
    kept_S = torch.zeros(len(lengths), dtype=torch.long).index_add_(0, seq_N, keep_N.long())
    lost_S = had_S - kept_S
    counts = StaleCounts(active=True, trainable=int(had_S.sum()), masked=int(lost_S.sum()),
                         partial_seqs=int(((lost_S > 0) & (kept_S > 0)).sum()),
                         emptied_seqs=int(((had_S > 0) & (kept_S == 0)).sum()))
    return [part.tolist() for part in keep_N.to(torch.int8).split(lengths)], counts
