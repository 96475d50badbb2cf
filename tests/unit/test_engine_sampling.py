"""The batched sampler: draws follow the filtered distribution; logprobs do not renormalise.

Golden numbers, by hand, for probabilities p = [0.5, 0.3, 0.15, 0.05] (logits = log p):
- top_p = 0.7: mass before token 1 is 0.5 < 0.7 (kept), before token 2 is 0.8 >= 0.7
  (dropped) -> draws from {0: 0.5/0.8 = 0.625, 1: 0.375}.
- top_k = 3, then top_p = 0.9 on the renormalised top 3 (/0.95): [0.5263, 0.3158, 0.1579];
  mass before token 2 is 0.8421 < 0.9 -> all three kept, frequencies as listed.
- temperature 2: p^(1/2) normalised = [0.7071, 0.5477, 0.3873, 0.2236] / 1.8657
  = [0.3790, 0.2936, 0.2076, 0.1199].
The behaviour logprob of token t is always log softmax(logits / T)[t] over all 4 tokens.
"""

from __future__ import annotations

import pytest
import torch

from tapioca.engines.sampling import RowParams, sample_next

P = [0.5, 0.3, 0.15, 0.05]
N_ROWS = 40_000  # frequency standard error <= 0.0025


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def draw(temperature: float, top_p: float = 1.0, top_k: int = 0, seed: int = 0):
    logits_BV = torch.tensor(P).log().expand(N_ROWS, 4)
    params = RowParams.build([temperature] * N_ROWS, [top_p] * N_ROWS, [top_k] * N_ROWS, "cpu")
    tok_B, logp_B = sample_next(logits_BV, params, torch.Generator().manual_seed(seed))
    freq = torch.bincount(tok_B, minlength=4).double() / N_ROWS
    return tok_B, logp_B, freq


def test_plain_sampling_matches_probabilities():
    tok_B, logp_B, freq = draw(1.0)
    torch.testing.assert_close(freq, torch.tensor(P, dtype=torch.float64), atol=0.012, rtol=0)
    torch.testing.assert_close(logp_B, torch.tensor(P).log()[tok_B], atol=1e-6, rtol=0)


def test_top_p_truncates_and_renormalises_draws_but_not_logprobs():
    tok_B, logp_B, freq = draw(1.0, top_p=0.7)
    expected = torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(freq, expected, atol=0.012, rtol=0)
    assert set(tok_B.unique().tolist()) == {0, 1}
    torch.testing.assert_close(logp_B, torch.tensor(P).log()[tok_B], atol=1e-6, rtol=0)


def test_top_k_then_top_p():
    _, _, freq = draw(1.0, top_p=0.9, top_k=3)
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0], dtype=torch.float64) / 0.95
    torch.testing.assert_close(freq, expected, atol=0.012, rtol=0)


def test_temperature_flattens_and_logprob_uses_it():
    tok_B, logp_B, freq = draw(2.0)
    sq = torch.tensor(P, dtype=torch.float64).sqrt()
    expected = sq / sq.sum()  # [0.3790, 0.2936, 0.2076, 0.1199]
    torch.testing.assert_close(freq, expected, atol=0.012, rtol=0)
    torch.testing.assert_close(logp_B.double(), expected.log()[tok_B], atol=1e-6, rtol=0)


def test_greedy_rows_take_argmax_with_temperature_1_logprob():
    logits_BV = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    params = RowParams.build([0.0, 0.0], [1.0, 1.0], [0, 0], "cpu")
    tok_B, logp_B = sample_next(logits_BV, params)
    assert tok_B.tolist() == [1, 0]
    torch.testing.assert_close(logp_B, torch.log_softmax(logits_BV, -1)[[0, 1], [1, 0]])


def test_zero_probability_tokens_are_never_drawn():
    logits_BV = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]]).expand(N_ROWS, 4)
    params = RowParams.build([1.0] * N_ROWS, [1.0] * N_ROWS, [0] * N_ROWS, "cpu")
    tok_B, _ = sample_next(logits_BV, params, torch.Generator().manual_seed(1))
    assert set(tok_B.unique().tolist()) == {0, 2}
