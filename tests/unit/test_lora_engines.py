"""The in-process engines serving LoRA adapters (``update_adapter``), and the readers' checks
of a LoRA weights event.

- Both engines' logprobs with an adapter equal a merged-model reference: the base with
  ``W + alpha/r * B A`` folded in by peft's own ``merge`` (fp32, 1e-5; measured <= 1.5e-6).
- The paged engine merges at the switch from a kept base copy: after many switches its
  weights equal a single switch to the last adapter bit for bit (no delta is ever
  subtracted), a module the new adapter leaves out gets its base back, and whole weights
  replace the base.
- Bad input (an adapter for another base, other target modules, a rank over the maximum,
  an adapter for a full-weights worker) is refused by the weights loader before the
  engine is touched, the rollout worker dead-letters the event at once (no retries), and
  the engine keeps serving the previous adapter.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from peft.tuners.lora import LoraLayer

from tapioca.bus.role import Source
from tapioca.config.lora import LoraSpec
from tapioca.config.policy import PolicySpec
from tapioca.config.schema import GenerationConfig
from tapioca.config.sections import RolloutSection
from tapioca.engines import GenRequest, SamplingParams
from tapioca.engines.paged_engine import PagedEngine
from tapioca.engines.torch_engine import TorchEngine
from tapioca.models.lora import (
    LoraAdapter,
    adapter_config,
    adapter_config_bytes,
    adapter_state_dict,
    apply_lora,
    base_state_dict,
)
from tapioca.producers.rollout import RolloutWorker
from tapioca.schemas.errors import BadEventError, EngineError
from tapioca.schemas.events import PromptEvent, WeightsAdapter, WeightsEvent
from tapioca.weights import make_weight_loader
from tapioca.weights.adapter_files import adapter_dir, write_adapter_tensors
from tapioca.weights.base_id import base_identity
from tapioca.weights.files import WeightsRefusedError

VOCAB = 32
ALL = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
ENGINES = {"paged": lambda m: PagedEngine(m, kv_block_size_tokens=4, seed=0),
           "torch": lambda m: TorchEngine(m, seed=0)}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def base_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def trained(base: torch.nn.Module, seed: int, rank: int = 4, targets=("all-linear",)):
    """``base`` with a random (non-zero) adapter: ``(model, LoraAdapter)``."""
    model = copy.deepcopy(base)
    names = apply_lora(model, rank=rank, alpha=2 * rank, target_modules=list(targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    tensors = {k: v.detach().clone() for k, v in adapter_state_dict(model).items()}
    return model, LoraAdapter(name=f"lora-v{seed}", rank=rank, alpha=2.0 * rank, target_modules=names,
                              tensors=tensors)


def merged_reference(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model with peft's own merge of every LoRA layer (W + scale * B A)."""
    m = copy.deepcopy(model)
    for layer in m.modules():
        if isinstance(layer, LoraLayer):
            layer.merge()
    ref = transformers.Qwen2ForCausalLM(model.config).eval()
    ref.load_state_dict(base_state_dict(m))
    return ref


def reference_logprobs(model, prompt, output) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    p = len(prompt)
    return torch.log_softmax(logits[p - 1:p - 1 + len(output)], -1).gather(
        -1, torch.tensor(output)[:, None]).squeeze(-1)


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 3, 1, 2, 6, 7, 1]]


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_logprobs_with_an_adapter_equal_the_merged_model(kind):
    base = base_model()
    model, lora = trained(base, seed=1)
    ref = merged_reference(model)
    eng = ENGINES[kind](copy.deepcopy(base))
    try:
        eng.update_adapter(lora, 1)
        results = eng.generate([GenRequest(f"r{i}", p, SamplingParams(max_new_tokens=6))
                                for i, p in enumerate(PROMPTS)])
    finally:
        eng.shutdown()
    for r in results:
        assert r.output_versions == [1] * len(r.output_ids)
        want = reference_logprobs(ref, r.prompt_ids, r.output_ids)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), want, atol=1e-5, rtol=0)
        base_lp = reference_logprobs(base, r.prompt_ids, r.output_ids)
        assert (want - base_lp).abs().max() > 1e-3  # the adapter changes them


def test_paged_merges_from_the_kept_base_never_subtracting_a_delta():
    base = base_model()
    eng, once = PagedEngine(copy.deepcopy(base), kv_block_size_tokens=4), PagedEngine(copy.deepcopy(base),
                                                                                        kv_block_size_tokens=4)
    try:
        for seed in range(1, 11):
            eng.update_adapter(trained(base, seed)[1], seed)
        once.update_adapter(trained(base, 10)[1], 10)
        got, want = eng.decoder.hf_state_dict(), once.decoder.hf_state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
        # An adapter on q/v only: the other projections get their base back, exactly.
        _, qv = trained(base, 11, targets=("q_proj", "v_proj"))
        eng.update_adapter(qv, 11)
        got, sd = eng.decoder.hf_state_dict(), base.state_dict()
        for k in sd:
            if not (k.endswith("q_proj.weight") or k.endswith("v_proj.weight")):
                assert torch.equal(got[k], sd[k]), k
        assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                               sd["model.layers.0.self_attn.q_proj.weight"])
        # Whole weights are a new base: the merged adapter goes with the old one.
        eng.update_weights(sd, 12)
        assert all(torch.equal(eng.decoder.hf_state_dict()[k], v) for k, v in sd.items())
    finally:
        eng.shutdown()
        once.shutdown()


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_an_adapter_for_another_shape_is_refused_and_the_engine_keeps_serving(kind):
    base = base_model()
    _, good = trained(base, seed=1)
    other = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, tie_word_embeddings=False))
    _, bad = trained(other, seed=2)
    eng = ENGINES[kind](copy.deepcopy(base))
    try:
        eng.update_adapter(good, 1)
        before = eng.generate([GenRequest("a", PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=5))])
        with pytest.raises(EngineError, match="another model"):
            eng.update_adapter(bad, 2)
        assert eng.version == 1
        after = eng.generate([GenRequest("b", PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=5))])
        assert after[0].output_ids == before[0].output_ids and after[0].output_versions[0] == 1
    finally:
        eng.shutdown()


# ---------------------------------------------------------------- the readers' checks


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("base") / "model"
    base_model().save_pretrained(d)
    return d


def adapter_event(tmp_path, base_dir, version: int, *, rank: int = 4, targets=("all-linear",),
                  base_id: str | None = None) -> WeightsEvent:
    """A LoRA version as the trainer writes it: its PEFT directory and the event naming it."""
    base = transformers.Qwen2ForCausalLM.from_pretrained(base_dir).eval()
    _, lora = trained(base, seed=version, rank=rank, targets=targets)
    doc = adapter_config(rank=rank, alpha=2 * rank, targets=lora.target_modules, base_model_path=str(base_dir))
    d = adapter_dir(tmp_path / "weights", "lora", version)
    sha, size = write_adapter_tensors(d, adapter_config_bytes(doc), dict(lora.tensors))
    return WeightsEvent(version=version, path=str(d), sha256=sha, num_bytes=size, adapter=WeightsAdapter(
        name=d.name, rank=rank, alpha=2.0 * rank, target_modules=lora.target_modules,
        base_id=base_id or base_identity(base_dir)))


SPEC = LoraSpec(peft_type="lora", rank=4, alpha=8, target_modules=("all-linear",), name="lora", max_rank=8,
                max_loaded=3)


@pytest.fixture
def served(base_dir, tmp_path):
    """A paged engine on the base at ``base_dir`` serving version 1's adapter, and its loader."""
    eng = PagedEngine(transformers.Qwen2ForCausalLM.from_pretrained(base_dir).eval(), kv_block_size_tokens=4)
    load = make_weight_loader(eng, "cpu", lora=SPEC, model_path=str(base_dir))
    load(adapter_event(tmp_path, base_dir, 1))
    assert eng.version == 1
    yield eng, load
    eng.shutdown()


@pytest.mark.parametrize("bad,match", [
    (dict(base_id="0" * 64), "trained on base"),
    (dict(targets=("q_proj", "v_proj")), "wraps"),
    (dict(rank=16), "above the engine's maximum"),
])
def test_the_loader_refuses_a_bad_adapter_before_the_engine_changes(served, base_dir, tmp_path, bad, match):
    eng, load = served
    before = {k: v.clone() for k, v in eng.decoder.hf_state_dict().items()}
    with pytest.raises(WeightsRefusedError, match=match):
        load(adapter_event(tmp_path, base_dir, 2, **bad))
    assert eng.version == 1
    assert all(torch.equal(before[k], v) for k, v in eng.decoder.hf_state_dict().items())


def test_whole_weights_are_refused_by_a_lora_worker_and_an_adapter_by_a_full_one(served, base_dir, tmp_path):
    eng, load = served
    full = WeightsEvent(version=2, path=str(tmp_path / "v000002.safetensors"), sha256="x")
    with pytest.raises(WeightsRefusedError, match="whole weights"):
        load(full)
    plain = make_weight_loader(eng, "cpu", model_path=str(base_dir))
    with pytest.raises(WeightsRefusedError, match="without actor.lora.enabled"):
        plain(adapter_event(tmp_path, base_dir, 3))
    assert eng.version == 1


def test_the_rollout_worker_dead_letters_a_refused_adapter_at_once_and_keeps_serving(served, base_dir, tmp_path):
    eng, load = served
    role = RolloutWorker(RolloutSection(gconfig=GenerationConfig(max_new_tokens=2), seed=0,
                                        policy=PolicySpec(adapter=SPEC)),
                         engine=eng, load_weights=load, decode=lambda ids: "")
    state = role.init_state()
    bad = adapter_event(tmp_path, base_dir, 2, base_id="f" * 64)
    role.handle(bad, state, Source(topic="t.weights.v1", partition=0, offset=5))
    with pytest.raises(BadEventError, match="trained on base") as info:
        role.on_tick(state, 0.0)
    assert info.value.retryable is False and info.value.event is bad  # dead-lettered at once
    role.on_dead_letter(state, bad, info.value)
    assert state.loaded_version == 1 and eng.version == 1 and state.pending_weights is None
    prompt = PromptEvent(group_id="g0", prompt_id="p0", group_index=0, n_samples=2, prompt_ids=[1, 2, 3],
                         admitted_at_version=1)
    role.handle(prompt, state, Source(topic="t.prompts.v1", partition=0, offset=0))
    for f in state.inflight["g0"].futures:
        assert f.result(timeout=60).output_versions == [1, 1]
