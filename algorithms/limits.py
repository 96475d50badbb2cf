"""Bounds on the numbers an event may carry into training math (pure constants).

The schema already refuses NaN and infinities; these bounds refuse finite values that
no genuine producer makes and that overflow the math downstream (a reward of 1.5e308
overflowed the advantage step; behaviour logprobs of -1e30 gave a loss of -inf).
Shared by the advantage processor (rewards) and the trainer (samples).
"""

from __future__ import annotations

#: Behaviour logprobs of generated tokens. A token sampled from a float32 softmax has
#: probability >= 1.4e-45 (the smallest float32), so logprob >= -103.3; -1e3 leaves a
#: wide margin for other engines and precisions. Tokens not generated (loss mask 0)
#: carry 0.0.
MIN_BEHAV_LOGPROB = -1e3
#: A log-probability is <= 0; a log-softmax's rounding can land a hair above it.
MAX_BEHAV_LOGPROB = 1e-3
#: Rewards, normalised rewards and advantages. |x| <= 1e9 keeps squares (group std,
#: critic loss) and sums over any batch finite in float32 (max 3.4e38) and gradients
#: clippable; genuine rewards are many orders of magnitude smaller (scale larger ones in
#: the reward function: ``advantage.reward_scaling`` is applied after this check).
MAX_ABS_REWARD = 1e9
