"""Seeded, logged sampling and regeneration (engines/regenerate.py, runtime/regenerate.py):
per-row noise keyed only by (request seed, token position); a paged engine's request
draws the same tokens alone or in any batch, and reports its seed; a trajectory made
across a weights switch regenerates exactly (tokens, logprobs, versions) with the same
batch and token for token alone; what a regeneration refuses and how it reports a
difference. Tiny random models on a CPU; what a different batch does to the logprobs is
measured here, not assumed (docs/provenance.md)."""

from __future__ import annotations

import copy
import dataclasses
import math
import threading

import pytest
import torch
import transformers

from tapioca.engines import GenRequest, SamplingParams
from tapioca.engines.base import GenResult
from tapioca.engines.kernels import reference as R
from tapioca.engines.paged_engine import PagedEngine
from tapioca.engines.regenerate import ScheduledEngine, compare, first_difference, version_runs
from tapioca.engines.sampling import request_seed
from tapioca.schemas.errors import CannotRegenerateError, ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64


def tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)
    return transformers.Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def models():
    # The engine takes the model's tensors (and copies updates into them): each engine
    # gets its own copy of the initial weights.
    return tiny(0), {k: v.clone() for k, v in tiny(1).state_dict().items()}


def requests(n: int = 6, **sampling) -> list[GenRequest]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist()
        out.append(GenRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=16, seed=request_seed(7, f"r{i}"),
                                                              **sampling)))
    return out


def test_row_noise_depends_on_the_rows_own_key_only():
    seeds = torch.tensor([3, 4, 5, 6], dtype=torch.int64)
    ctrs = torch.tensor([10, 10, 11, 1 << 40], dtype=torch.int64)
    noise = R.row_gumbel_noise(seeds, ctrs, 257)
    for i in range(4):
        assert torch.equal(R.row_gumbel_noise(seeds[i:i + 1], ctrs[i:i + 1], 257)[0], noise[i])
    assert torch.equal(R.row_gumbel_noise(seeds.flip(0), ctrs.flip(0), 257), noise.flip(0))
    assert not torch.equal(noise[0], noise[1])  # another seed, same position
    # Gumbel(0, 1): mean 0.5772, variance pi^2 / 6, over 4 x 4096 draws of distinct keys.
    many = R.row_gumbel_noise(torch.arange(4), torch.full((4,), 9), 4096).double().flatten()
    assert abs(many.mean().item() - 0.5772) < 0.05 and abs(many.var().item() - math.pi ** 2 / 6) < 0.15
    u = R.row_uniform(torch.arange(20000), torch.zeros(20000, dtype=torch.int64))
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert torch.equal(R.row_uniform(seeds[1:2], ctrs[1:2]), R.row_uniform(seeds, ctrs)[1:2])


def test_request_seeds_are_stable_names():
    assert request_seed(1, "g:0") == request_seed(1, "g:0") != request_seed(1, "g:1")
    assert 0 <= request_seed("x") < 2**63
    with pytest.raises(ConfigError, match="seed"):
        SamplingParams(seed=-1)


@pytest.mark.parametrize("sampling", [{}, {"top_p": 0.8}], ids=["full-vocab", "top-p"])
def test_a_request_draws_the_same_tokens_alone_or_in_a_batch(models, sampling):
    initial, _ = models
    reqs = requests(**sampling)
    eng = PagedEngine(copy.deepcopy(initial), kv_block_size_tokens=4)
    batch = eng.generate(reqs)
    again = eng.generate(list(reversed(reqs)))[::-1]  # another order, the same engine
    eng.shutdown()
    assert [r.seed for r in batch] == [q.sampling.seed for q in reqs]
    assert [r.output_ids for r in again] == [r.output_ids for r in batch]
    worst = 0.0
    for req, b in zip(reqs, batch):
        e = PagedEngine(copy.deepcopy(initial), kv_block_size_tokens=4)
        (alone,) = e.generate([req])
        e.shutdown()
        assert alone.output_ids == b.output_ids, req.request_id
        worst = max(worst, max(abs(x - y) for x, y in zip(alone.output_logprobs, b.output_logprobs)))
    # Alone, a row's logits move by a few fp32 ulps (GEMMs of another batch size): the
    # logprobs are not bit for bit, the tokens are (docs/provenance.md).
    assert worst < 1e-5
    print(f"\nlogprobs alone vs in a batch of {len(reqs)}: max |diff| {worst:.3g}")


def test_an_engine_seed_gives_every_unseeded_request_its_own_reported_seed(models):
    initial, _ = models
    reqs = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, seed=None)) for r in requests(3)]
    runs = []
    for _ in range(2):
        eng = PagedEngine(copy.deepcopy(initial), kv_block_size_tokens=4, seed=123)
        runs.append(eng.generate(reqs))
        eng.shutdown()
    seeds = [r.seed for r in runs[0]]
    assert None not in seeds and len(set(seeds)) == 3 and seeds == [r.seed for r in runs[1]]
    # The reported seed replays the request on another engine.
    eng = PagedEngine(copy.deepcopy(initial), kv_block_size_tokens=4, seed=999)
    (replay,) = eng.generate([dataclasses.replace(reqs[1], sampling=dataclasses.replace(
        reqs[1].sampling, seed=seeds[1]))])
    eng.shutdown()
    assert replay.output_ids == runs[0][1].output_ids


def _generate_across_a_switch(initial, sd1, reqs, attempts: int = 20) -> list[GenResult]:
    """Results of ``reqs`` whose weights switched to version 1 mid-generation (the rollout
    worker's interruptible update), retried until some result spans both versions."""
    for attempt in range(attempts):
        eng = PagedEngine(copy.deepcopy(initial), kv_block_size_tokens=4)
        eng.pause()
        futures = eng.submit_all(reqs)
        eng.resume()
        threading.Event().wait(0.002 * attempt)
        eng.update_weights(sd1, 1)
        results = [f.result() for f in futures]
        eng.shutdown()
        if any(len(set(r.output_versions)) > 1 for r in results):
            return results
    pytest.fail("no generation spanned the weights switch")


def test_a_trajectory_across_a_weights_switch_regenerates_exactly(models):
    initial, sd1 = models
    reqs = requests(4)
    logged = _generate_across_a_switch(initial, sd1, reqs)
    weights = {0: None, 1: sd1}.get
    schedule = logged[0].output_versions  # one step boundary for the whole batch
    # The same batch: tokens, logprobs and versions bit for bit.
    eng = ScheduledEngine(copy.deepcopy(initial), schedule=schedule, weights=weights, kv_block_size_tokens=4)
    same = eng.generate(reqs)
    eng.shutdown()
    for r, g in zip(logged, same):
        c = compare(r.output_ids, r.output_logprobs, r.output_versions, g)
        assert c.identical and c.logprobs_identical and c.versions_identical, c
    # Alone: every token, with its version.
    for req, r in zip(reqs, logged):
        eng = ScheduledEngine(copy.deepcopy(initial), schedule=r.output_versions, weights=weights,
                              kv_block_size_tokens=4)
        (g,) = eng.generate([req])
        eng.shutdown()
        c = compare(r.output_ids, r.output_logprobs, r.output_versions, g)
        assert c.identical and c.versions_identical and c.logprob_max_abs_diff < 1e-5, c
    # Another seed: a difference, found at its first position.
    wrong = dataclasses.replace(reqs[0], sampling=dataclasses.replace(reqs[0].sampling, seed=1))
    eng = ScheduledEngine(copy.deepcopy(initial), schedule=logged[0].output_versions, weights=weights,
                          kv_block_size_tokens=4)
    (g,) = eng.generate([wrong])
    eng.shutdown()
    c = compare(logged[0].output_ids, logged[0].output_logprobs, logged[0].output_versions, g)
    assert not c.identical and c.first_difference == first_difference(logged[0].output_ids, g.output_ids)
    assert c.logged_token == logged[0].output_ids[c.first_difference]


def test_comparison_helpers_by_hand():
    assert version_runs([3, 3, 4, 4, 4, 6]) == [(0, 3), (2, 4), (5, 6)]
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # the regeneration stopped early
    r = GenResult("x", [1], [1, 2, 9], [-0.5, -0.25, -1.0], [0, 0, 1], "stop")
    c = compare([1, 2, 3], [-0.5, -0.125, -2.0], [0, 0, 1], r)
    assert (c.identical, c.first_difference, c.logged_token, c.regenerated_token) == (False, 2, 3, 9)
    assert c.logprob_max_abs_diff == 0.125  # over the tokens before the difference


def test_what_cannot_be_regenerated_says_why(tmp_path):
    from tapioca.config.schema import TrainConfig
    from tapioca.runtime.regenerate import regenerate, weights_of
    from tapioca.schemas.events import TrajectoryEvent

    traj = TrajectoryEvent(traj_id="g:0", group_id="g", prompt_id="p", sample_index=0, group_size=1,
                           prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-1.0], output_versions=[2])
    with pytest.raises(CannotRegenerateError, match="no sampling_seed") as exc:
        regenerate(TrainConfig(), traj)
    assert exc.value.exit_code == 2
    with pytest.raises(CannotRegenerateError, match=r"version\(s\) \[2\] are no longer"):
        weights_of(tmp_path, {0, 2})
    assert weights_of(tmp_path, {0})(0) is None  # version 0: the initial model itself


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_regenerate_the_same_batch_bit_for_bit(models):
    """On a GPU (Triton sampling, decode in CUDA graphs): a batch made across a weights
    switch regenerates bit for bit with the same batch; alone, token for token unless the
    batch moved a logit across a near-tie (reported, not asserted)."""
    initial, sd1 = models
    initial = copy.deepcopy(initial).cuda()
    sd1 = {k: v.cuda() for k, v in sd1.items()}
    reqs = requests(8)
    kw = dict(kv_block_size_tokens=4, device="cuda", cuda_graphs=True, prefix_caching=False)
    for attempt in range(20):
        eng = PagedEngine(copy.deepcopy(initial), **kw)
        eng.pause()
        futures = eng.submit_all(reqs)
        eng.resume()
        threading.Event().wait(0.001 * attempt)
        eng.update_weights(sd1, 1)
        logged = [f.result() for f in futures]
        eng.shutdown()
        if any(len(set(r.output_versions)) > 1 for r in logged):
            break
    schedule = max((r.output_versions for r in logged), key=lambda v: len(set(v)))
    eng = ScheduledEngine(copy.deepcopy(initial), schedule=schedule, weights={0: None, 1: sd1}.get, **kw)
    same = eng.generate(reqs)
    eng.shutdown()
    for r, g in zip(logged, same):
        c = compare(r.output_ids, r.output_logprobs, r.output_versions, g)
        assert c.identical and c.logprobs_identical and c.versions_identical, c
