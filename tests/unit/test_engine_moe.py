"""Qwen3-MoE on the paged engine (CPU): logprobs against HF's fp32 forward, graph-bucket
padding, the Triton kernels (interpreted), both expert namings in weight updates, the
recorded routes, and the family checks of the in-process engines.

The CPU measurement of issue 23 is ``test_logprobs_match_hf_fp32_forward``: every
sampled token's logprob within 1e-4 of HF's no-cache forward of the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tapioca.engines.base import GenRequest, SamplingParams
from tapioca.engines.model_runner import unsupported_reason
from tapioca.engines.paged_engine import PagedEngine
from tapioca.engines.torch_engine import TorchEngine
from tapioca.models.factory import build_tiny_model
from tapioca.models.moe import expert_aliases
from tapioca.schemas.errors import EngineError

VOCAB = 48
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def moe_model(norm_topk_prob: bool = True, seed: int = 0, mlp_only_layers=(1,)) -> torch.nn.Module:
    """Three layers: 0 and 2 sparse (8 experts, top 2), 1 dense (``mlp_only_layers``)."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, mlp_only_layers=list(mlp_only_layers), max_position_embeddings=256)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logprobs(model, p: list[int], out: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([p + out])).logits[0].float()
    lp = torch.log_softmax(logits[len(p) - 1:len(p) - 1 + len(out)], -1)
    return lp.gather(-1, torch.tensor(out)[:, None]).squeeze(-1)


def assert_matches_hf(model, r) -> None:
    torch.testing.assert_close(torch.tensor(r.output_logprobs), hf_logprobs(model, r.prompt_ids, r.output_ids),
                               atol=1e-4, rtol=0)


def requests(n: int = 6, new: int = 7) -> list[GenRequest]:
    reqs = [GenRequest(f"r{i}", prompt(2 + 3 * i, seed=i), SamplingParams(temperature=1.0, max_new_tokens=new))
            for i in range(n)]
    # A group: one prompt, three samples (shared blocks, a copied partial block).
    return reqs + [GenRequest(f"g{i}", prompt(6, seed=99), SamplingParams(temperature=1.0, max_new_tokens=new))
                   for i in range(3)]


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logprobs_match_hf_fp32_forward(norm_topk_prob):
    model = moe_model(norm_topk_prob)
    assert unsupported_reason(model) is None
    with PagedEngine(model, seed=3, kv_block_size_tokens=4) as eng:
        results = eng.generate(requests())
    for r in results:
        assert len(r.output_ids) == 7
        assert_matches_hf(model, r)


def test_greedy_equals_hf_generate():
    model = moe_model()
    model.generation_config.eos_token_id = None
    p = prompt(5, seed=1)
    with PagedEngine(model, kv_block_size_tokens=4) as eng:
        (r,) = eng.generate([GenRequest("a", p, SamplingParams(temperature=0, max_new_tokens=10))])
    with torch.no_grad():
        hf = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, 5, dtype=torch.long), do_sample=False,
                            max_new_tokens=10, pad_token_id=0)
    assert r.output_ids == hf[0, 5:].tolist()


def test_graph_bucket_padding_rows_route_but_change_nothing():
    """Padding rows of a graph bucket (token 0, slot -1) are routed like any row: their
    pairs take expert slots, yet every real row stays exact."""
    model = moe_model()
    with PagedEngine(model, seed=5, max_batch_size=12, kv_block_size_tokens=4) as eng:
        eng.graphs.bucketed = True
        results = eng.generate(requests(8, new=9))
    for r in results:
        assert_matches_hf(model, r)


def test_engine_on_the_triton_kernels_matches_hf(triton_interpreter, monkeypatch):
    """The Triton routing and grouped-GEMM kernels (interpreted on CPU) behind the whole
    engine, with the other Triton kernels and graph-bucket padding."""
    pytest.importorskip("tapioca.engines.kernels.triton_moe")
    monkeypatch.setenv("TAPIOCA_KERNELS", "triton")
    model = moe_model()
    with PagedEngine(model, seed=0, kv_block_size_tokens=4) as eng:
        eng.graphs.bucketed = True
        results = eng.generate(requests(3, new=4))
    for r in results:
        assert_matches_hf(model, r)


def test_weight_updates_take_fused_or_per_expert_names_in_place():
    """transformers 5's fused expert names and the per-expert names of checkpoints on
    disk both load, into the same tensors (no reallocation); the engine's own names are
    the model's."""
    model, other = moe_model(), moe_model(seed=7)
    p = prompt(4, seed=3)
    req = GenRequest("a", p, SamplingParams(temperature=1.0, max_new_tokens=6))
    with PagedEngine(model, seed=1, kv_block_size_tokens=4) as eng:
        assert set(eng.decoder.hf_state_dict()) == set(model.state_dict())
        ptrs = [t.data_ptr() for t in (eng.decoder.layers[0].moe.w13, eng.decoder.layers[0].moe.router_w)]
        eng.update_weights(other.state_dict(), version=1)
        (r1,) = eng.generate([req])
        per_expert = {k: v for k, v in other.state_dict().items() if ".experts." not in k}
        per_expert.update({k: v.clone() for k, v in expert_aliases(other.state_dict()).items()})
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in per_expert
        eng.update_weights(model.state_dict(), version=2)
        eng.update_weights(per_expert, version=3)
        (r3,) = eng.generate([req])
        assert ptrs == [t.data_ptr() for t in (eng.decoder.layers[0].moe.w13, eng.decoder.layers[0].moe.router_w)]
        assert eng.decoder.layers[0].moe.router_w.dtype == torch.float32  # the fp32 router copy
        with pytest.raises(EngineError, match="names the model does not have"):
            eng.update_weights({"model.layers.0.mlp.experts.8.up_proj.weight": torch.zeros(32, 64)}, version=4)
    assert r1.output_versions == [1] * 6 and r3.output_versions == [3] * 6
    assert_matches_hf(other, r1)
    assert_matches_hf(other, r3)


def test_recorded_routes_are_hf_routers_top_k():
    """``record_routes``: each MoE layer's top-k ids per token of the last forward, the
    experts HF's router picks for the same tokens (prefill of one prompt)."""
    model = moe_model()
    p = prompt(9, seed=4)
    with PagedEngine(model, kv_block_size_tokens=4) as eng:
        eng.decoder.record_routes = True
        eng.generate([GenRequest("a", p, SamplingParams(temperature=0, max_new_tokens=1))])
        routes = eng.decoder.last_routes  # the prefill of the one prompt (its only forward)
    picked = {}
    hooks = [model.model.layers[i].mlp.gate.register_forward_hook(
        lambda mod, args, out, i=i: picked.__setitem__(i, out[2])) for i in (0, 2)]
    with torch.no_grad():
        model(input_ids=torch.tensor([p]))
    for h in hooks:
        h.remove()
    assert len(routes) == 2 and routes[0].shape == (9, 2) and routes[0].dtype == torch.int32
    for got, layer in zip(routes, (0, 2)):
        assert torch.equal(got.sort(-1).values.long(), picked[layer].sort(-1).values)


def test_torch_engine_runs_qwen3_moe_and_loads_per_expert_names():
    model = moe_model()
    other = moe_model(seed=7)
    sd = {k: v for k, v in other.state_dict().items() if ".experts." not in k}
    sd.update({k: v.clone() for k, v in expert_aliases(other.state_dict()).items()})
    ref = moe_model(seed=7)  # TorchEngine switches its model's attention; score on a twin
    with TorchEngine(model, seed=2) as eng:
        eng.update_weights(sd, version=1)
        results = eng.generate(requests(3, new=5))
    for r in results:
        assert_matches_hf(ref, r)


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss", "mistral"])
def test_torch_engine_sliding_window_matches_hf_past_the_window(arch):
    """Sliding-window layers (Gemma 3, gpt-oss: alternating with full ones; Mistral: all
    layers) with sequences three times the window: the engine's masks hide what HF's do."""
    model = build_tiny_model(VOCAB, arch=arch, hidden_size=32, num_layers=2, intermediate_size=64,
                             num_experts=4, moe_intermediate_size=16, eos_token_id=None, pad_token_id=0).eval()
    if arch == "mistral":
        model.config.sliding_window = 8
    ref = build_tiny_model(VOCAB, arch=arch, hidden_size=32, num_layers=2, intermediate_size=64,
                           num_experts=4, moe_intermediate_size=16, eos_token_id=None, pad_token_id=0).eval()
    ref.config.sliding_window = model.config.sliding_window
    assert unsupported_reason(model) is not None  # TorchEngine is its in-process engine
    reqs = [GenRequest(f"r{i}", prompt(3 + 5 * i, seed=i), SamplingParams(temperature=1.0, max_new_tokens=12))
            for i in range(4)]
    with TorchEngine(model, seed=4, max_batch_size=2) as eng:  # rows join a running batch
        results = eng.generate(reqs)
    assert max(len(r.prompt_ids) + len(r.output_ids) for r in results) >= 3 * 8
    for r in results:
        assert_matches_hf(ref, r)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_linear_attention_families_fail_at_construction_naming_what_to_use(arch):
    model = build_tiny_model(VOCAB, arch=arch, hidden_size=32, num_layers=2, intermediate_size=64,
                             num_experts=4, moe_intermediate_size=16)
    with pytest.raises(EngineError, match=rf"'{arch}'.*rollout.engine=vllm"):
        TorchEngine(model)
    assert unsupported_reason(model) is not None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_matches_the_cpu_reference(dtype):
    """The Triton kernels in captured decode graphs (fp32: within TF32 rounding of the CPU
    reference; bf16: within bf16 rounding, as a check that routing and experts agree)."""
    cpu_model, model = moe_model(), moe_model().to("cuda", dtype)
    atol = 5e-3 if dtype == torch.float32 else 0.15
    reqs = [GenRequest(f"r{i}", prompt(3 + i, seed=40 + i), SamplingParams(temperature=0, max_new_tokens=16))
            for i in range(5)]  # 5 rows: a graph bucket of 8 (3 padding rows)
    for graphs in (False, True):
        with PagedEngine(model, device="cuda", cuda_graphs=graphs, kv_block_size_tokens=4) as eng:
            results = eng.generate(reqs)
            assert (eng.stats()["cuda_graphs"] > 0) == graphs
        for r in results:
            ref = hf_logprobs(cpu_model, r.prompt_ids, r.output_ids)
            torch.testing.assert_close(torch.tensor(r.output_logprobs), ref, atol=atol, rtol=0)
