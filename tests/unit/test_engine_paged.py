"""PagedEngine's own mechanisms: HF agreement, prefix sharing, the prefix cache, blocks,
continuous batching, aborts, and (CUDA only) decode under CUDA graphs.

The behaviour both in-process engines share (stopping, versions, pause, threads) is
tested on both in test_engine_torch.py. Tiny random models; block size 4 so prompts span
several blocks and end in partial ones. Reference for numbers: HF ``generate`` (greedy
tokens) and HF's fp32 forward of ``prompt + output`` in one pass (logprobs, 1e-4).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import transformers

from tapioca.engines import GenRequest, SamplingParams
from tapioca.engines.block_manager import BlockManager
from tapioca.engines.model_runner import DecodeInputs, unsupported_reason
from tapioca.engines.paged_engine import PagedEngine
from tapioca.schemas.errors import EngineError

VOCAB = 32
BS = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model(arch: str = "qwen2", tied: bool = False, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                  tie_word_embeddings=tied)
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    if arch == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common)).eval()
    if arch == "llama":  # with a rope scaling: the table comes from the HF rotary embedding
        cfg = transformers.LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}, **common)
        return transformers.LlamaForCausalLM(cfg).eval()
    raise ValueError(arch)


def engine(model, **kw) -> PagedEngine:
    kw.setdefault("kv_block_size_tokens", BS)
    return PagedEngine(model, **kw)


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def reference_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    p = len(prompt)
    logits = logits[p - 1 : p - 1 + len(output)] / (temperature or 1.0)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


def assert_matches_reference(model, r, temperature: float = 1.0) -> None:
    ref = reference_logprobs(model, r.prompt_ids, r.output_ids, temperature)
    torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=1e-4, rtol=0)


def certain_token_weights(model, token: int) -> dict[str, torch.Tensor]:
    """Weights under which ``token`` is certain whatever the context (as in
    test_engine_torch.py): attention and MLP outputs zeroed, one LM-head row."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for k in sd:
        if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            sd[k].zero_()
    sd["model.embed_tokens.weight"].fill_(1.0)
    sd["model.norm.weight"].fill_(1.0)
    sd["lm_head.weight"].zero_()
    sd["lm_head.weight"][token] = 1.0
    return sd


class DecodeRowsSeen:
    """Forward hook recording the rows of every decode forward."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, module, args, output) -> None:
        if isinstance(args[0], DecodeInputs):
            self.rows.append(int(args[0].input_ids_B.shape[0]))


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("qwen2", True), ("qwen3", False),
                                       ("qwen3", True), ("llama", False), ("llama", True)])
def test_greedy_equals_hf_generate_and_logprobs_match_fp32_forward(arch, tied):
    model = tiny_model(arch, tied)
    prompts = [prompt_ids(n, seed=n) for n in (1, 3, 4, 5, 9, 13)]
    with engine(model) as eng:
        results = eng.generate([GenRequest(f"r{i}", p, SamplingParams(temperature=0, max_new_tokens=12))
                                for i, p in enumerate(prompts)])
    model.generation_config.eos_token_id = None  # Llama's config default (2) would stop HF early
    for p, r in zip(prompts, results):
        with torch.no_grad():
            hf = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                do_sample=False, max_new_tokens=12, pad_token_id=0)
        assert r.output_ids == hf[0, len(p):].tolist()
        assert_matches_reference(model, r)


def test_group_prefills_its_prompt_once_and_samples_differ():
    model = tiny_model()
    prompt = prompt_ids(10, seed=3)  # 2 full blocks + a partial one (copied per sample)
    n = 8
    with engine(model, seed=1) as eng:
        results = eng.generate([GenRequest(f"g:{i}", prompt, SamplingParams(temperature=1.0, max_new_tokens=9))
                                for i in range(n)])
        stats = eng.stats()
    assert stats["prefill_tokens_computed"] == len(prompt)
    assert stats["prefill_tokens_requested"] == n * len(prompt)
    assert len({tuple(r.output_ids) for r in results}) > 1
    for r in results:  # each sample's KV (shared blocks + its copied partial block) is right
        assert_matches_reference(model, r)


def test_first_tokens_of_a_group_follow_the_model_distribution():
    """A group samples its first tokens from one set of logits with independent noise per
    sample: the empirical frequencies of 2,000 samples match softmax(logits)."""
    model = tiny_model()
    prompt = prompt_ids(6, seed=4)
    n = 2000
    with engine(model, seed=2, max_batch_size=n) as eng:
        results = eng.generate([GenRequest(f"s{i}", prompt, SamplingParams(temperature=1.0, max_new_tokens=1))
                                for i in range(n)])
    counts = torch.bincount(torch.tensor([r.output_ids[0] for r in results]), minlength=VOCAB).float()
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1)
    total_variation = 0.5 * (counts / n - probs).abs().sum().item()
    assert total_variation < 0.06  # ~0.04 expected from sampling noise alone over 32 tokens


def test_prefix_cache_reuses_a_finished_conversation():
    """Turn 2 re-sends turn 1's prompt + answer: its full blocks (prompt and generated) are
    reused and only the rest is prefilled, with the same logprobs as a full forward."""
    model = tiny_model()
    turn1 = prompt_ids(18, seed=5)
    with engine(model, seed=0) as eng:
        (r1,) = eng.generate([GenRequest("t1", turn1, SamplingParams(temperature=1.0, max_new_tokens=7))])
        before = eng.stats()
        turn2 = turn1 + r1.output_ids + [3, 4, 5]  # 28 tokens; 24 (6 blocks) have cached KV
        (r2,) = eng.generate([GenRequest("t2", turn2, SamplingParams(temperature=1.0, max_new_tokens=5))])
        after = eng.stats()
    assert after["prefix_cache_hit_blocks"] - before["prefix_cache_hit_blocks"] == 6
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == len(turn2) - 6 * BS
    assert_matches_reference(model, r2)


def test_prompt_fully_cached_still_prefills_its_last_token():
    model = tiny_model()
    prompt = prompt_ids(12, seed=6)  # exactly 3 blocks
    with engine(model, seed=0) as eng:
        eng.generate([GenRequest("a", prompt, SamplingParams(temperature=0, max_new_tokens=2))])
        before = eng.stats()["prefill_tokens_computed"]
        (r,) = eng.generate([GenRequest("b", prompt, SamplingParams(temperature=0, max_new_tokens=6))])
        computed = eng.stats()["prefill_tokens_computed"] - before
    assert computed == BS  # 2 blocks reused; the last block recomputed (it holds the last token)
    assert_matches_reference(model, r)


def test_blocks_are_freed_and_reservations_released():
    model = tiny_model()
    with engine(model, seed=0) as eng:
        reqs = [GenRequest(f"r{i}", prompt_ids(3 + i, seed=i), SamplingParams(max_new_tokens=4 + i))
                for i in range(10)]
        reqs += [GenRequest(f"g{i}", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=6)) for i in range(4)]
        eng.generate(reqs)
        bm = eng.bm
        assert bm.reserved == 0
        assert len(bm.free) == bm.num_blocks - 1  # everything but the null block
        assert all(c == 0 for c in bm.ref[1:])
        assert bm.cached_blocks() > 0  # freed blocks stay in the prefix cache until reused


def test_lru_eviction_takes_the_least_recently_freed_block():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = bm.take(), bm.take()
    ka = bm.register(a, 0, [1, 2])
    bm.register(b, ka, [3, 4])
    bm.release([b])
    bm.release([a])  # free list: 3 (never used), b, a
    assert bm.match([1, 2, 3, 4, 9], 2)[0] == [a, b]
    assert bm.take() == 3
    assert bm.take() == b  # evicts b's entry: the chain now ends at a
    assert bm.match([1, 2, 3, 4, 9], 2)[0] == [a]


def test_continuous_batching_rows_join_and_leave():
    model = tiny_model()
    seen = DecodeRowsSeen()
    with engine(model, seed=3, max_batch_size=4) as eng:
        handle = eng.decoder.register_forward_hook(seen)
        reqs = [GenRequest(f"r{i}", prompt_ids(2 + i % 5, seed=10 + i),
                           SamplingParams(temperature=0.8, max_new_tokens=2 + 3 * (i % 4))) for i in range(12)]
        results = eng.generate(reqs)
        handle.remove()
    for r, req in zip(results, reqs):
        assert len(r.output_ids) == req.sampling.max_new_tokens
        assert_matches_reference(model, r, 0.8)
    assert max(seen.rows) == 4
    # rows left (the batch shrank) and others joined (it grew again) mid-flight
    assert any(b < a for a, b in zip(seen.rows, seen.rows[1:]))
    assert any(b > a for a, b in zip(seen.rows, seen.rows[1:]))


def test_overlapped_steps_give_the_same_results_as_synchronous_ones():
    """With overlap the host learns of a stop one step late (the row's extra token is
    dropped); greedy results and freed blocks are the same as without. (Sampled ones
    differ: rows sit at other batch positions, which key the noise.)"""
    model = tiny_model()
    reqs = [GenRequest(f"r{i}", prompt_ids(2 + i % 7, seed=90 + i % 4),
                       SamplingParams(temperature=0, max_new_tokens=3 + 4 * (i % 5),
                                      stop_token_ids=(4, 21, 30) if i % 2 else ()))
            for i in range(24)]
    outs = []
    for overlap in (False, True):
        with engine(model, seed=8, max_batch_size=6, overlap=overlap) as eng:
            results = eng.generate(reqs)
            assert eng.bm.reserved == 0 and len(eng.bm.free) == eng.bm.num_blocks - 1
        outs.append(results)
    for sync, over in zip(*outs):
        assert (sync.output_ids, sync.finish_reason) == (over.output_ids, over.finish_reason)
        torch.testing.assert_close(over.output_logprobs, sync.output_logprobs, atol=1e-5, rtol=0)
    assert {r.finish_reason for r in outs[1]} == {"stop", "length"}


def test_a_full_batch_stopping_at_once_frees_its_rows_for_the_next_requests():
    """Every row of a full batch stops on the same token (a trained policy answering
    alike): the rows are free before the next requests are admitted (regression: they
    waited for a next step that never came -- the demo stalled at step 335)."""
    model = tiny_model()
    eos = 7
    with engine(model, seed=0, max_batch_size=4, eos_token_id=eos) as eng:
        eng.update_weights(certain_token_weights(tiny_model(seed=1), eos), version=1)
        for round_ in range(3):
            futures = eng.submit_all([GenRequest(f"{round_}:{i}", [1, 2, 3], SamplingParams(max_new_tokens=4))
                                      for i in range(4)])
            results = [f.result(timeout=30) for f in futures]
            assert all(r.output_ids == [eos] and r.finish_reason == "stop" for r in results)


def test_rounds_of_groups_with_updates_stops_and_cache_hits_keep_the_books_balanced():
    """The rollout worker's pattern for a while: rounds of groups (repeated prompts: prefix
    hits), weight updates between submissions, some rounds where every row stops on its
    first token. Every request finishes and every block and reservation comes back."""
    model = tiny_model()
    eos = 7
    normal = {k: v.clone() for k, v in model.state_dict().items()}
    certain = certain_token_weights(tiny_model(seed=1), eos)
    prompts = [prompt_ids(n, seed=100 + n) for n in (5, 9, 13, 17)]
    with engine(model, seed=0, max_batch_size=16, eos_token_id=eos) as eng:
        for round_ in range(6):
            futures = []
            for g in range(6):
                sp = SamplingParams(temperature=1.0, max_new_tokens=2 + g % 3)
                futures += eng.submit_all([GenRequest(f"{round_}:{g}:{i}", prompts[(round_ + g) % 4], sp)
                                           for i in range(4)])
                if g % 2:
                    eng.update_weights(certain if round_ % 3 == 2 else normal, version=10 * round_ + g)
            for f in futures:
                assert f.result(timeout=60).output_ids
        bm = eng.bm
        assert eng.stats()["prefix_cache_hit_blocks"] > 0
        assert bm.reserved == 0 and len(bm.free) == bm.num_blocks - 1 and not eng._unfinished


def test_prefill_token_budget_splits_admissions():
    model = tiny_model()
    seen: list[int] = []

    def hook(module, args, output):
        if not isinstance(args[0], DecodeInputs):
            seen.append(int(args[0].input_ids_T.shape[0]))

    with engine(model, seed=0, max_prefill_tokens=20) as eng:
        eng.decoder.register_forward_hook(hook)
        reqs = [GenRequest(f"r{i}", prompt_ids(9, seed=20 + i), SamplingParams(max_new_tokens=5))
                for i in range(6)]
        results = eng.generate(reqs)
    assert seen == [18, 18, 18]  # two 9-token prompts per prefill forward
    for r in results:
        assert_matches_reference(model, r)


def test_out_of_blocks_requests_wait_for_free_blocks():
    """A cache of 12 usable blocks holds 2 of these sequences at a time (6 blocks each);
    the rest wait in the queue, then finish correctly."""
    model = tiny_model()
    seen = DecodeRowsSeen()
    with engine(model, seed=0, kv_cache_tokens=12 * BS, max_batch_size=8) as eng:
        eng.decoder.register_forward_hook(seen)
        with pytest.raises(EngineError, match="kv_cache_tokens"):
            eng.validate(GenRequest("big", [1] * 40, SamplingParams(max_new_tokens=10)))
        reqs = [GenRequest(f"r{i}", prompt_ids(10, seed=30 + i), SamplingParams(max_new_tokens=14))
                for i in range(5)]
        results = eng.generate(reqs)
    assert max(seen.rows) == 2
    for r in results:
        assert len(r.output_ids) == 14
        assert_matches_reference(model, r)


def test_shutdown_aborts_in_flight_rows_with_their_tokens_so_far():
    model = tiny_model()
    eng = engine(model, seed=0)
    calls = []

    def hook(module, args, output):
        calls.append(1)
        if len(calls) == 3:
            eng.shutdown()  # from the engine thread: takes effect at the step boundary

    eng.decoder.register_forward_hook(hook)
    fut = eng.submit(GenRequest("a", [1, 2, 3], SamplingParams(max_new_tokens=50)))
    r = fut.result(timeout=30)
    eng._thread.join(timeout=30)
    assert r.finish_reason == "abort" and len(r.output_ids) == 3
    assert_matches_reference(model, r)
    assert eng.bm.reserved == 0 and len(eng.bm.free) == eng.bm.num_blocks - 1


def test_weight_update_copies_into_the_fused_parameters_in_place():
    model = tiny_model()
    other = tiny_model(seed=7)
    with engine(model, seed=0) as eng:
        ptrs = [t.data_ptr() for layer in eng.decoder.layers for t in (layer.qkv_w, layer.gate_up_w)]
        eng.update_weights(other.state_dict(), version=3)
        assert [t.data_ptr() for layer in eng.decoder.layers for t in (layer.qkv_w, layer.gate_up_w)] == ptrs
        (r,) = eng.generate([GenRequest("a", [4, 5, 6], SamplingParams(temperature=0, max_new_tokens=6))])
    assert r.output_versions == [3] * 6
    assert_matches_reference(other, r)


def test_weight_update_drops_the_prefix_cache():
    """KV cached under version v is never served to a request of version v+1: after an
    update the same prompt is prefilled in full again (a GRPO group of it still once) and
    its logprobs are the NEW model's."""
    model, other = tiny_model(), tiny_model(seed=7)
    prompt = prompt_ids(13, seed=11)  # 3 full blocks + a partial one
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    with engine(model, seed=0) as eng:
        eng.generate([GenRequest("a", prompt, sp)])
        assert eng.stats()["cached_blocks"] >= 3
        eng.update_weights(other.state_dict(), version=1)
        assert eng.stats()["cached_blocks"] == 0
        before = eng.stats()
        results = eng.generate([GenRequest(f"g:{i}", prompt, sp) for i in range(4)])
        after = eng.stats()
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == len(prompt)
    assert after["prefix_cache_hit_blocks"] == before["prefix_cache_hit_blocks"]
    for r in results:
        assert r.output_versions == [1] * 6
        assert_matches_reference(other, r)


def test_rows_admitted_before_an_update_never_enter_the_prefix_cache_after_it():
    """A row that continues across an update (interruptible generation) holds KV of both
    versions: the blocks it fills afterwards are not offered to later requests."""
    model, other = tiny_model(), tiny_model(seed=7)
    eng = engine(model, seed=0)
    forwards = []

    def hook(module, args, output):
        forwards.append(1)
        if len(forwards) == 4:  # hold this step until the update waits for its boundary
            deadline = time.monotonic() + 60
            while eng._update_waiters == 0 and time.monotonic() < deadline:
                time.sleep(0.005)

    with eng:
        handle = eng.decoder.register_forward_hook(hook)
        fut = eng.submit(GenRequest("long", [1, 2, 3], SamplingParams(temperature=1.0, max_new_tokens=29)))
        deadline = time.monotonic() + 60
        while len(forwards) < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        eng.update_weights(other.state_dict(), version=1)
        r1 = fut.result(timeout=60)
        handle.remove()
        assert r1.output_versions[0] == 0 and r1.output_versions[-1] == 1
        assert eng.stats()["cached_blocks"] == 0
        before = eng.stats()
        (r2,) = eng.generate([GenRequest("next", r1.prompt_ids + r1.output_ids, SamplingParams(max_new_tokens=3))])
        after = eng.stats()
    assert after["prefix_cache_hit_blocks"] == before["prefix_cache_hit_blocks"]
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == 32
    assert_matches_reference(other, r2)


def test_a_step_failing_while_its_results_are_processed_fails_every_request_and_the_engine_goes_on():
    """``_process`` raising half-way (after it finished some rows, before their results were
    handed over): no future hangs, every one gets a result or an EngineError, the books are
    balanced, and the next request is served."""
    import concurrent.futures

    model = tiny_model()
    with engine(model, seed=0) as eng:
        real, calls = eng._process, []

        def fails_on_the_third(launched):
            out = real(launched)
            calls.append(len(out))
            if len(calls) == 3:
                raise RuntimeError("host processing failed (injected)")
            return out

        eng._process = fails_on_the_third
        futs = eng.submit_all([GenRequest(f"r{n}", prompt_ids(5, seed=n),
                                          SamplingParams(temperature=1.0, max_new_tokens=n))
                               for n in range(1, 7)])
        done, not_done = concurrent.futures.wait(futs, timeout=120)
        assert not not_done, "futures left hanging"
        errors = [f.exception() for f in futs if f.exception() is not None]
        assert errors and all(isinstance(e, EngineError) and "injected" in str(e) for e in errors)
        assert "Retry them" in str(errors[0])  # says what to do
        assert calls[2] >= 1  # the failed processing had finished a row: its future failed too
        finished = [f.result() for f in futs if f.exception() is None]
        assert len(finished) == sum(calls[:2])
        eng._process = real
        stats = eng.stats()
        assert stats["free_blocks"] == stats["num_blocks"] - 1 and stats["reserved_blocks"] == 0
        (r,) = eng.generate([GenRequest("after", prompt_ids(7, seed=9), SamplingParams(max_new_tokens=4))])
    assert r.finish_reason == "length" and len(r.output_ids) == 4
    assert_matches_reference(model, r)


def test_an_error_outside_a_step_fails_every_pending_request_instead_of_hanging():
    model = tiny_model()
    with engine(model, seed=0) as eng:
        eng.pause()
        futs = eng.submit_all([GenRequest(f"r{i}", prompt_ids(5, seed=i), SamplingParams(max_new_tokens=3))
                               for i in range(3)])

        def admit_fails(queue, now):
            raise RuntimeError("admission failed (injected)")

        eng.scheduler.admit = admit_fails
        eng.resume()
        for f in futs:
            with pytest.raises(EngineError, match="injected.*Create a new PagedEngine and retry"):
                f.result(timeout=60)
        with pytest.raises(EngineError, match="shut down"):
            eng.submit(GenRequest("late", [1, 2], SamplingParams(max_new_tokens=1)))



def test_when_failing_a_step_fails_too_every_admitted_request_still_gets_the_error():
    """The last resort: ``_step`` raises and so does ``_fail_step`` (the books broke): the
    engine thread stops, and every admitted request and every queued one fails, none hangs."""
    model = tiny_model()
    with engine(model, seed=0) as eng:
        def step_fails(admitted, version):
            raise RuntimeError("step failed (injected)")

        def fail_step_fails(admitted, exc):
            raise RuntimeError("the books broke (injected)")

        running = eng.submit_all([GenRequest(f"r{i}", prompt_ids(5, seed=i),
                                             SamplingParams(max_new_tokens=200)) for i in range(2)])
        deadline = time.monotonic() + 60
        while not eng._unfinished and time.monotonic() < deadline:  # admitted and running
            time.sleep(0.01)
        eng._step, eng._fail_step = step_fails, fail_step_fails
        queued = eng.submit_all([GenRequest(f"q{i}", prompt_ids(4, seed=i), SamplingParams(max_new_tokens=2))
                                 for i in range(2)])
        for f in running + queued:
            with pytest.raises(EngineError, match="Create a new PagedEngine"):
                f.result(timeout=60)

def test_graph_bucket_padding_rows_write_nowhere_and_read_nothing():
    """The CUDA graphs' padding (rows up to a bucket: slot -1, context 0; block tables up to
    a power-of-two width), run eagerly on CPU: every real row stays exact."""
    model = tiny_model()
    steps: list[tuple[int, int, int]] = []  # (rows, real rows, block-table width)

    def hook(module, args, output):
        if isinstance(args[0], DecodeInputs):
            b = args[0]
            steps.append((b.input_ids_B.shape[0], int((b.context_lens_B > 0).sum()), b.block_tables_BM.shape[1]))

    with engine(model, seed=6, max_batch_size=12) as eng:
        eng.graphs.bucketed = True
        eng.decoder.register_forward_hook(hook)
        reqs = [GenRequest(f"r{i}", prompt_ids(2 + 3 * (i % 6), seed=80 + i % 6),
                           SamplingParams(temperature=1.0, max_new_tokens=5 + 7 * (i % 5))) for i in range(30)]
        results = eng.generate(reqs)
    assert all(rows in eng.graphs.buckets and width in (4, 8, 16) for rows, _, width in steps)
    assert any(real < rows for rows, real, _ in steps)  # some steps ran padding rows
    for r, req in zip(results, reqs):
        assert len(r.output_ids) == req.sampling.max_new_tokens
        assert_matches_reference(model, r)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_engine_on_the_triton_kernels_matches_hf(arch, monkeypatch):
    """The Triton kernels (under Triton's interpreter on CPU, TAPIOCA_KERNELS=triton) behind
    the whole engine -- strided q views, groups, graph-bucket padding rows -- give HF's
    fp32 logprobs. Runs where tests/conftest.py set TRITON_INTERPRET (no GPU)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set without a GPU)")
    pytest.importorskip("tapioca.engines.kernels.triton_attention")
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):  # numpy 2.4 vs Triton 3.6's int() of 1-element arrays (triton#9171)
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
    monkeypatch.setenv("TAPIOCA_KERNELS", "triton")
    model = tiny_model(arch)
    reqs = [GenRequest(f"r{i}", prompt_ids(3 + 2 * i, seed=i), SamplingParams(temperature=i % 2, max_new_tokens=6))
            for i in range(3)]
    reqs += [GenRequest(f"g{i}", [1, 2, 3, 4, 5, 6], SamplingParams(temperature=1.0, max_new_tokens=5))
             for i in range(3)]
    with engine(model, seed=0) as eng:
        eng.graphs.bucketed = True
        results = eng.generate(reqs)
    for r in results:
        assert_matches_reference(model, r)


def test_unsupported_models_are_named():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB))
    assert "gpt2" in unsupported_reason(gpt2)
    sliding = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert "sliding" in unsupported_reason(sliding)
    assert unsupported_reason(tiny_model("qwen3")) is None
    with pytest.raises(EngineError, match="TorchEngine"):
        PagedEngine(gpt2)


# ---------------------------------------------------------------------------- CUDA graphs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# fp32 on the GPU against HF's fp32 forward on the CPU: Triton / cuBLAS may use TF32.
GPU_ATOL = 5e-3


def assert_matches_cpu(cpu_model, r, temperature: float = 1.0) -> None:
    ref = reference_logprobs(cpu_model, r.prompt_ids, r.output_ids, temperature)
    torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=GPU_ATOL, rtol=0)


@cuda
def test_cuda_graph_decode_matches_the_reference_like_eager_decode():
    cpu_model, model = tiny_model(), tiny_model().cuda()
    reqs = [GenRequest(f"r{i}", prompt_ids(3 + i, seed=40 + i), SamplingParams(temperature=0, max_new_tokens=20))
            for i in range(5)]  # 5 rows: the graph runs a bucket of 8 (3 padding rows)
    for graphs in (False, True):
        with engine(model, device="cuda", cuda_graphs=graphs) as eng:
            results = eng.generate(reqs)
            assert (eng.stats()["cuda_graphs"] > 0) == graphs
        for r in results:
            assert len(r.output_ids) == 20
            assert_matches_cpu(cpu_model, r)


@cuda
def test_cuda_graphs_see_weight_updates_without_recapture():
    model = tiny_model().cuda()
    other = tiny_model(seed=7)
    req = GenRequest("a", [4, 5, 6], SamplingParams(temperature=0, max_new_tokens=8))
    with engine(model, device="cuda") as eng:
        eng.generate([req])
        graphs = eng.stats()["cuda_graphs"]
        eng.update_weights(other.state_dict(), version=1)
        (r,) = eng.generate([req])
        assert eng.stats()["cuda_graphs"] == graphs
    assert r.output_versions == [1] * 8
    assert_matches_cpu(other, r)


@cuda
def test_cuda_graphs_sampled_and_filtered_batches_follow_the_logprob_convention():
    cpu_model, model = tiny_model(), tiny_model().cuda()
    samplings = [SamplingParams(temperature=0.7, max_new_tokens=16),
                 SamplingParams(temperature=1.0, top_k=5, top_p=0.9, max_new_tokens=16)]
    with engine(model, device="cuda", seed=4) as eng:
        for sp in samplings:
            results = eng.generate([GenRequest(f"r{i}", prompt_ids(5, seed=50 + i), sp) for i in range(6)])
            for r in results:
                assert_matches_cpu(cpu_model, r, sp.temperature)


@cuda
def test_cuda_graph_groups_and_rows_joining_keep_every_row_exact():
    """Groups (shared blocks, copied partial blocks), rows joining and leaving across
    buckets and block-table widths: every row's logprobs still match the reference."""
    cpu_model, model = tiny_model(), tiny_model().cuda()
    reqs = [GenRequest(f"r{i}", prompt_ids(2 + 3 * (i % 6), seed=70 + i % 6),
                       SamplingParams(temperature=1.0, max_new_tokens=5 + 7 * (i % 5))) for i in range(30)]
    with engine(model, device="cuda", seed=5, max_batch_size=12) as eng:
        results = eng.generate(reqs)
        assert eng.stats()["prefill_tokens_computed"] < eng.stats()["prefill_tokens_requested"]
    for r, req in zip(results, reqs):
        assert len(r.output_ids) == req.sampling.max_new_tokens
        assert_matches_cpu(cpu_model, r)
