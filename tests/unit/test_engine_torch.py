"""The in-process engines (TorchEngine and PagedEngine, every test run on both where it
applies): correctness against a no-cache full forward, stopping, versions, threads.

Reference for every numeric check: the same model run on ``prompt + output`` in one
forward pass without a KV cache, padding or batching. Tiny random models (2 layers,
width 64, vocab 32) keep the whole file at a few seconds on CPU. The paged engine's own
mechanisms (prefix sharing, blocks, CUDA graphs) are tested in test_engine_paged.py.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch
import transformers

from tapioca.engines import GenRequest, GenResult, SamplingParams, TorchEngine
from tapioca.engines.paged_engine import PagedEngine
from tapioca.schemas.errors import ConfigError, EngineError

VOCAB = 32


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model(arch: str = "qwen2", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=False,
    )
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    if arch == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common)).eval()
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    raise ValueError(arch)


def full_forward_logits(model, result: GenResult) -> torch.Tensor:
    """Logits predicting each output token, from one no-cache forward: [n_out, V] fp32."""
    ids = torch.tensor([result.prompt_ids + result.output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    p = len(result.prompt_ids)
    return logits[p - 1 : p - 1 + len(result.output_ids)]


def reference_logprobs(model, result: GenResult, temperature: float) -> torch.Tensor:
    t = 1.0 if temperature == 0 else temperature
    logits = full_forward_logits(model, result)
    out = torch.tensor(result.output_ids)
    return torch.log_softmax(logits / t, -1).gather(-1, out[:, None]).squeeze(-1)


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [1 + (7 * i) % 13 for i in range(n)]  # 1..13 tokens: heavy left padding in one batch
    return [torch.randint(1, VOCAB, (n_,), generator=g).tolist() for n_ in lens]


@pytest.fixture
def model():
    return tiny_model()


# Block size 4 on the tiny prompts: prompts span several blocks and partial last blocks.
ENGINES = {"torch": TorchEngine,
           "paged": lambda model, **kw: PagedEngine(model, kv_block_size_tokens=4, **kw)}


@pytest.fixture(params=sorted(ENGINES))
def Engine(request):
    return ENGINES[request.param]


def hook_target(eng, model) -> torch.nn.Module:
    """The module whose forward hook fires once per engine forward (prefill or decode)."""
    return getattr(eng, "decoder", model)


@pytest.fixture
def engine(model, Engine):
    eng = Engine(model, seed=0)
    yield eng
    eng.shutdown()


def make_reqs(prefix: str, prompt_list: list[list[int]], **sampling) -> list[GenRequest]:
    return [GenRequest(f"{prefix}{i}", p, SamplingParams(**sampling)) for i, p in enumerate(prompt_list)]


def assert_logprobs_match(model, r: GenResult, temperature: float) -> None:
    ref = reference_logprobs(model, r, temperature)
    torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=1e-4, rtol=0)


def assert_lengths(r: GenResult) -> None:
    assert len(r.output_ids) == len(r.output_logprobs) == len(r.output_versions) > 0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_greedy_is_stepwise_argmax_of_full_forward(arch, Engine):
    model = tiny_model(arch)
    with Engine(model) as eng:
        reqs = make_reqs("r", prompts(6), temperature=0, max_new_tokens=10)
        results = eng.generate(reqs)
    for r in results:
        assert_lengths(r)
        assert r.finish_reason == "length" and len(r.output_ids) == 10
        logits = full_forward_logits(model, r)
        assert r.output_ids == logits.argmax(-1).tolist()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.output_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_behaviour_logprobs_match_full_forward_mixed_batch(arch, Engine):
    """KV cache + left padding + mixed per-row sampling: logprob = log_softmax(logits / T)[tok]."""
    model = tiny_model(arch)
    samplings = [
        SamplingParams(temperature=0.7, max_new_tokens=12),
        SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=9),
        SamplingParams(temperature=1.0, top_k=5, max_new_tokens=14),
        SamplingParams(temperature=0, max_new_tokens=7),
        SamplingParams(temperature=0.9, top_k=8, top_p=0.9, max_new_tokens=12),
    ]
    with Engine(model, seed=3) as eng:
        reqs = [GenRequest(f"r{i}", p, samplings[i % 5]) for i, p in enumerate(prompts(10))]
        results = eng.generate(reqs)
    for req, r in zip(reqs, results):
        assert r.request_id == req.request_id and r.prompt_ids == req.prompt_ids
        assert_lengths(r)
        assert r.output_versions == [0] * len(r.output_ids)
        ref = reference_logprobs(model, r, req.sampling.temperature)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=1e-4, rtol=0)


def test_top_k_filter_is_respected_but_not_renormalised(model, Engine):
    with Engine(model, seed=5) as eng:
        results = eng.generate(make_reqs("r", prompts(8), top_k=2, max_new_tokens=16))
    for r in results:
        top2 = full_forward_logits(model, r).topk(2, -1).indices
        assert all(t in row for t, row in zip(r.output_ids, top2.tolist()))
        # full-vocabulary logprob, so it is NOT log(p / (p1 + p2)) and stays < 0 even for 2 candidates
        ref = reference_logprobs(model, r, 1.0)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=1e-4, rtol=0)


def test_top_k_1_and_tiny_top_p_equal_greedy(engine):
    ps = prompts(5)
    greedy = engine.generate(make_reqs("g", ps, temperature=0, max_new_tokens=8))
    topk1 = engine.generate(make_reqs("k", ps, top_k=1, max_new_tokens=8))
    topp = engine.generate(make_reqs("p", ps, top_p=1e-6, max_new_tokens=8))
    for g, k, p in zip(greedy, topk1, topp):
        assert g.output_ids == k.output_ids == p.output_ids
        # temperature 1 for all three, so the logprobs agree too
        torch.testing.assert_close(torch.tensor(g.output_logprobs), torch.tensor(k.output_logprobs))


def test_max_new_tokens_gives_length(engine):
    (r,) = engine.generate([GenRequest("a", [1, 2, 3], SamplingParams(max_new_tokens=5))])
    assert r.finish_reason == "length" and len(r.output_ids) == 5
    assert r.timings["queued_s"] >= 0 and r.timings["generate_s"] > 0


def test_stop_token_included_and_finish_reason_stop(engine):
    prompt = [3, 1, 4, 1, 5]
    (free,) = engine.generate([GenRequest("free", prompt, SamplingParams(temperature=0, max_new_tokens=12))])
    stop_tok = free.output_ids[4]
    k = free.output_ids.index(stop_tok)  # first occurrence
    stopped = make_reqs("s", [prompt], temperature=0, max_new_tokens=12, stop_token_ids=[stop_tok])
    (r,) = engine.generate(stopped)
    assert r.finish_reason == "stop"
    assert r.output_ids == free.output_ids[: k + 1] and r.output_ids[-1] == stop_tok
    assert_lengths(r)


def test_engine_eos_stops_every_request(model, Engine):
    with Engine(model) as eng:
        (free,) = eng.generate([GenRequest("free", [7, 8], SamplingParams(temperature=0, max_new_tokens=10))])
    eos = free.output_ids[2]
    with Engine(model, eos_token_id=eos) as eng:
        (r,) = eng.generate([GenRequest("e", [7, 8], SamplingParams(temperature=0, max_new_tokens=10))])
    assert r.finish_reason == "stop" and r.output_ids[-1] == eos and len(r.output_ids) <= 3


def letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) + ("" if i < 26 else "!") for i in ids)


def test_stop_string_spanning_tokens(model, Engine):
    prompt = [2, 7, 1, 8]
    with Engine(model, decode=letters) as eng:
        (free,) = eng.generate([GenRequest("free", prompt, SamplingParams(temperature=0, max_new_tokens=12))])
        text = letters(free.output_ids)
        stop = letters(free.output_ids[3:5])  # spans two tokens
        end_tok = next(j for j in range(len(free.output_ids)) if stop in letters(free.output_ids[: j + 1]))
        stops = ("zzzz", stop)
        (r,) = eng.generate(make_reqs("s", [prompt], temperature=0, max_new_tokens=12, stop_strings=stops))
    assert stop in text
    assert r.finish_reason == "stop"
    assert r.output_ids == free.output_ids[: end_tok + 1]


def test_stop_strings_need_decode(engine):
    with pytest.raises(EngineError, match="decode"):
        engine.submit(GenRequest("x", [1], SamplingParams(stop_strings=("a",))))
    with pytest.raises(EngineError, match="empty prompt"):
        engine.submit(GenRequest("x", []))
    with pytest.raises(EngineError, match="outside"):
        engine.submit(GenRequest("x", [1, VOCAB]))
    with pytest.raises(ConfigError):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError):
        SamplingParams(max_new_tokens=0)


def test_seed_reproducible(model, Engine):
    reqs = make_reqs("r", prompts(6), temperature=1.0, top_p=0.9, max_new_tokens=10)
    outs = []
    for _ in range(2):
        with Engine(model, seed=11) as eng:
            outs.append([(r.output_ids, r.output_logprobs) for r in eng.generate(reqs)])
    assert outs[0] == outs[1]


def certain_token_weights(model, token: int) -> dict[str, torch.Tensor]:
    """Weights under which ``token`` is (numerically) certain whatever the context.

    Attention and MLP outputs are zeroed, so the last hidden state is
    RMSNorm(embedding) = ones (every embedding row is all-ones, norm weight 1);
    lm_head has a single non-zero row of ones at ``token``: logit = hidden_size = 64
    there, 0 elsewhere, so log p(token) = -log(1 + 31 e^-64) ~ -5e-27.
    """
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for k in sd:
        if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            sd[k].zero_()
    sd["model.embed_tokens.weight"].fill_(1.0)
    sd["model.norm.weight"].fill_(1.0)
    sd["lm_head.weight"].zero_()
    sd["lm_head.weight"][token] = 1.0
    return sd


class StepHook:
    """Forward hook that, at forward call ``at``, runs ``action`` in the test and waits for it to register."""

    def __init__(self, engine, at: int, action):
        self.engine, self.at, self.action, self.calls = engine, at, action, 0
        self.thread: threading.Thread | None = None

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls == self.at:
            self.thread = threading.Thread(target=self.action)
            self.thread.start()
            deadline = time.monotonic() + 10
            # hold the step until the update is registered, so it lands exactly at this boundary
            while self.engine._update_waiters == 0 and time.monotonic() < deadline:
                time.sleep(0.001)


def test_interruptible_update_mid_generation_switches_versions(model, Engine):
    new_sd = certain_token_weights(tiny_model(seed=1), token=7)
    eng = Engine(model, seed=0, interruptible=True)
    hook = StepHook(eng, at=4, action=lambda: eng.update_weights(new_sd, version=1))
    handle = hook_target(eng, model).register_forward_hook(hook)
    try:
        results = eng.generate(make_reqs("r", prompts(3), temperature=1.0, max_new_tokens=12))
        hook.thread.join()
    finally:
        handle.remove()
        eng.shutdown()
    assert eng.version == 1
    for r in results:
        assert_lengths(r)
        # forward 1 = prefill (token 0) ... forward 4 = token 3; the update lands after it
        assert r.output_versions == [0] * 4 + [1] * 8
        assert r.output_ids[4:] == [7] * 8
        assert all(lp > -1e-6 for lp in r.output_logprobs[4:])
        assert r.output_ids[:4] != [7] * 4
        # old-weight tokens were sampled from the old weights (no recompute)
        head = GenResult(r.request_id, r.prompt_ids, r.output_ids[:4], r.output_logprobs[:4], [], "length")
        assert_logprobs_match(tiny_model(), head, 1.0)


def test_non_interruptible_update_waits_for_batch(model, Engine):
    new_sd = certain_token_weights(tiny_model(seed=1), token=7)
    eng = Engine(model, interruptible=False)
    hook = StepHook(eng, at=3, action=lambda: eng.update_weights(new_sd, version=1))
    handle = hook_target(eng, model).register_forward_hook(hook)
    try:
        results = eng.generate(make_reqs("r", prompts(3), max_new_tokens=10))
        hook.thread.join()
        assert eng.version == 1
        (after,) = eng.generate([GenRequest("after", [1, 2], SamplingParams(max_new_tokens=4))])
    finally:
        handle.remove()
        eng.shutdown()
    for r in results:
        assert r.output_versions == [0] * 10
    assert after.output_versions == [1] * 4 and after.output_ids == [7] * 4


def test_update_from_safetensors_path(model, tmp_path, Engine):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file(certain_token_weights(tiny_model(seed=2), token=3), str(path))
    with Engine(model) as eng:
        eng.update_weights(str(path), version=5)
        (r,) = eng.generate([GenRequest("a", [1], SamplingParams(max_new_tokens=3))])
    assert eng.version == 5 and r.output_ids == [3, 3, 3] and r.output_versions == [5, 5, 5]


def test_update_rejects_unknown_names(engine):
    with pytest.raises(EngineError, match="does not have"):
        engine.update_weights({"nope.weight": torch.zeros(1)}, version=1)
    assert engine.version == 0


def test_continuous_batching_joins_and_compacts_exactly(model, Engine):
    """Rows join a running batch (left-padded merge) and leave it (compaction) mid-flight."""
    eng = Engine(model, seed=4, max_batch_size=3)
    late: list[concurrent.futures.Future] = []
    queued = threading.Event()
    ps = prompts(9, seed=7)

    def hook(module, args, output):
        if not queued.is_set():  # during the first step, queue more work than fits
            for i, p in enumerate(ps[3:]):
                sampling = SamplingParams(temperature=0.8, max_new_tokens=3 + 2 * i)
                late.append(eng.submit(GenRequest(f"late{i}", p, sampling)))
            queued.set()

    handle = hook_target(eng, model).register_forward_hook(hook)
    try:
        first = [
            eng.submit(GenRequest(f"first{i}", p, SamplingParams(temperature=1.0, max_new_tokens=4 + 5 * i)))
            for i, p in enumerate(ps[:3])
        ]
        assert queued.wait(timeout=10)
        results = [f.result(timeout=30) for f in first + late]
    finally:
        handle.remove()
        eng.shutdown()
    assert len(results) == 9
    for r in results:
        assert_lengths(r)
        t = 1.0 if r.request_id.startswith("first") else 0.8
        assert_logprobs_match(model, r, t)
    # queued behind a full batch, the late ones waited
    assert max(r.timings["queued_s"] for r in results[3:]) > 0


def test_submit_from_many_threads(model, Engine):
    with Engine(model, seed=0, max_batch_size=8) as eng:
        def worker(tid: int) -> list[GenResult]:
            futs = [
                eng.submit(GenRequest(f"t{tid}-{i}", p, SamplingParams(temperature=0, max_new_tokens=3 + i)))
                for i, p in enumerate(prompts(5, seed=tid))
            ]
            return [f.result(timeout=30) for f in futs]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            per_thread = list(pool.map(worker, range(4)))
    for tid, results in enumerate(per_thread):
        for i, r in enumerate(results):
            assert r.request_id == f"t{tid}-{i}" and len(r.output_ids) == 3 + i
            assert r.output_ids == full_forward_logits(model, r).argmax(-1).tolist()


def test_pause_resume_and_update_while_paused(model, Engine):
    new_sd = certain_token_weights(tiny_model(seed=1), token=9)
    with Engine(model) as eng:
        eng.pause()
        fut = eng.submit(GenRequest("p", [1, 2, 3], SamplingParams(max_new_tokens=4)))
        time.sleep(0.2)
        assert not fut.done()
        eng.update_weights(new_sd, version=2)  # interruptible: applies while paused
        eng.resume()
        r = fut.result(timeout=10)
    assert r.output_versions == [2] * 4 and r.output_ids == [9] * 4


def test_shutdown_aborts_queued_requests(model, Engine):
    eng = Engine(model)
    eng.pause()
    fut = eng.submit(GenRequest("q", [1, 2], SamplingParams(max_new_tokens=4)))
    eng.shutdown()
    r = fut.result(timeout=5)
    assert r.finish_reason == "abort" and r.output_ids == []
    with pytest.raises(EngineError, match="shut down"):
        eng.submit(GenRequest("late", [1]))


@pytest.mark.parametrize("bucket", [8, 64])  # the CPU and the CUDA cache bucket
def test_long_prompts_cross_cache_buckets_and_prefill_chunks(model, bucket):
    """Prompts of 40-90 tokens + 30 new cross the 64-column cache buckets; admissions are
    prefilled in several forwards (max_prefill_tokens) and rows join a running batch."""
    g = torch.Generator().manual_seed(9)
    reqs = [GenRequest(f"r{i}", torch.randint(1, VOCAB, (40 + 7 * i,), generator=g).tolist(),
                       SamplingParams(temperature=0.9, max_new_tokens=10 + 5 * i)) for i in range(8)]
    with TorchEngine(model, seed=2, max_batch_size=5, max_prefill_tokens=150) as eng:
        eng._kv_bucket = bucket
        results = eng.generate(reqs)
    for r in results:
        assert_lengths(r)
        assert_logprobs_match(model, r, 0.9)


def test_gqa_decode_attention_matches_transformers_sdpa_with_padding(model):
    """The engine's decode attention (SDPA enable_gqa, no repeat_kv) gives transformers'
    sdpa result for a left-padded decode batch, and prefill is transformers' own path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tapioca.engines.attention import NAME, decode_sdpa_forward

    layer = model.model.layers[0].self_attn
    assert layer.num_key_value_groups == 2  # the tiny model is grouped-query
    g = torch.Generator().manual_seed(0)
    q_BHQD = torch.randn(3, 4, 1, 16, generator=g)
    k_BHKD, v_BHKD = torch.randn(2, 3, 2, 10, 16, generator=g)
    mask_B1QK = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    mask_B1QK[0, ..., :4] = False  # left padding of different lengths
    mask_B1QK[2, ..., :7] = False
    got, _ = decode_sdpa_forward(layer, q_BHQD, k_BHKD, v_BHKD, mask_B1QK, scaling=0.25)
    want, _ = sdpa_attention_forward(layer, q_BHQD, k_BHKD, v_BHKD, mask_B1QK, scaling=0.25)
    assert got.shape == want.shape == (3, 1, 4, 16)
    assert torch.allclose(got, want, atol=1e-6)
    q3 = torch.randn(3, 4, 3, 16, generator=g)  # prefill: delegated, identical
    assert torch.equal(decode_sdpa_forward(layer, q3, k_BHKD, v_BHKD, None)[0],
                       sdpa_attention_forward(layer, q3, k_BHKD, v_BHKD, None)[0])
    eng = TorchEngine(model, seed=0)
    try:
        assert model.config._attn_implementation == NAME
        again = TorchEngine(model, seed=0)  # a second engine on the switched model
        again.shutdown()
    finally:
        eng.shutdown()
