"""Packed micro-batches (no padding) and the trainer's speed / memory switches, on CPU.

The packed forward (models/packed.py) must compute what the right-padded HF forward
computes: same logprobs, same loss, same gradients (fp64 / fp32 here; the bf16 figure
comes from benchmarks/trainer_step.py on the GPU). Each switch must leave the numbers
unchanged (activation checkpointing, recomputed SwiGLU) or do what it says (fp32
master weights are updated and copied into the bf16 weights).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from tapioca.config.optimizer import OptimizerConfig
from tapioca.config.schema import ActorConfig
from tapioca.models.attention import packed_seqs, position_ids, sdpa_attention
from tapioca.models.factory import build_tiny_model
from tapioca.models.forward import autocast_context, causal_token_logprobs
from tapioca.models.packed import PackedCausalLM
from tapioca.schemas.errors import ConfigError
from tapioca.trainers.batching import SeqItem, pack, to_tensors
from tapioca.trainers.optim import MasterAdamW, build_optimizer
from tapioca.trainers.packing import to_packed
from tapioca.trainers.ppo_actor import PPOActor

VOCAB = 40


def _items(seed: int = 0, n: int = 7) -> list[SeqItem]:
    """Sequences of very different lengths (3..40 tokens), a masked token, one item whose
    output is a single token."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        prompt_len = rng.randint(1, 6)
        out_len = 1 if i == 3 else rng.randint(2, 34)
        ids = [rng.randrange(1, VOCAB) for _ in range(prompt_len + out_len)]
        mask = [1] * out_len
        if out_len > 2:
            mask[1] = 0
        items.append(SeqItem(
            group_id=f"g{i // 2}", input_ids=ids, prompt_len=prompt_len,
            behav_logprobs=[-rng.uniform(2.0, 4.0) for _ in range(out_len)],
            versions=[0] * out_len, loss_mask=mask, advantage=rng.uniform(-1, 1), reward=0.0))
    return items


def _model(arch: str = "qwen2", dtype=torch.float64, **kw):
    kw = dict(dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                   max_position_embeddings=64, seed=0), **kw)
    return build_tiny_model(VOCAB, arch=arch, **kw).to(dtype)


def _actor(model=None, *, lr: float = 5e-4, max_grad_norm: float = 1e9, **cfg) -> PPOActor:
    # max_grad_norm 1e9: no clipping, compare raw gradients
    cfg["optimizer"] = OptimizerConfig(lr=lr, gradient_clipping=max_grad_norm)
    return PPOActor(model if model is not None else _model(), ActorConfig(**cfg), temperature=0.9,
                    pad_token_id=0)


def _grads(actor: PPOActor) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in actor.model.parameters()]


# ------------------------------------------------------------------ packing itself

def test_pack_budget_counts_real_tokens():
    lengths = [9, 3, 7, 1, 12, 5, 5, 2]
    batches = pack(lengths, 12, padded=False)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 12 for b in batches)
    # Padded budgeting (count x longest) needs more micro-batches for the same lengths.
    assert len(pack(lengths, 12)) > len(batches)
    assert pack([30, 4], 16, padded=False) == [[0], [1]]  # too long: a micro-batch of its own


def test_position_ids_restart_per_sequence_and_rows_predict_the_next_token():
    items = _items()
    batch = to_packed(items, "cpu")
    lengths = [it.length for it in items]
    assert batch.position_ids_N.tolist() == [t for n in lengths for t in range(n)]
    assert torch.equal(batch.position_ids_N, position_ids(lengths))
    assert batch.seqs.cu_seqlens_S1.tolist() == [0] + [sum(lengths[:i + 1]) for i in range(len(lengths))]
    assert batch.seqs.max_len == max(lengths)
    assert batch.input_ids_N.tolist() == [t for it in items for t in it.input_ids]
    # Each scored row predicts the next token of its own sequence: an output token.
    assert torch.equal(batch.input_ids_N[batch.rows_M + 1], batch.labels_M)
    assert batch.labels_M.numel() == sum(it.length - it.prompt_len for it in items)
    # The per-token tensors are to_tensors' own.
    padded = to_tensors(items, 0, "cpu")
    for name in ("labels_BT", "mask_BT", "behav_logprobs_BT", "advantages_BT", "versions_BT"):
        assert torch.equal(getattr(batch, name), getattr(padded, name)), name
    assert torch.equal(batch.to_padded(batch.labels_M.double()),
                       torch.where(padded.labels_BT == -100, 0, padded.labels_BT).double())


def test_sdpa_attention_is_block_diagonal_causal():
    lengths = [5, 1, 9, 3]
    seqs = packed_seqs(lengths, "cpu")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths), 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths), 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    out = sdpa_attention(q, k, v, seqs, scale=0.3)
    start = 0
    for n in lengths:  # each sequence alone, causal, K/V heads repeated
        sl = slice(start, start + n)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].repeat_interleave(2, 1).transpose(0, 1),
            v[sl].repeat_interleave(2, 1).transpose(0, 1), is_causal=True, scale=0.3).transpose(0, 1)
        assert torch.allclose(out[sl], ref, atol=1e-12)
        start += n


# ------------------------------------------------------- packed == padded, per arch

@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_packed_forward_matches_padded_hf_forward(arch):
    """Logprobs and entropy of every scored token, and the gradients of a loss on them,
    through the packed forward equal the padded HF forward's (fp64)."""
    model = _model(arch)
    items = _items(seed=1)
    packed = PackedCausalLM(model)
    assert packed.attention_backend == "sdpa"  # CPU
    batch = to_packed(items, "cpu")
    padded = to_tensors(items, 0, "cpu")
    from tapioca.models.forward import packed_token_logprobs

    lp_M, ent_M = packed_token_logprobs(packed, batch.input_ids_N, batch.position_ids_N, batch.seqs,
                                        batch.rows_M, batch.labels_M, temperature=0.9, chunk_tokens=16,
                                        compute_entropy=True)
    lp_pk, ent_pk = batch.to_padded(lp_M), batch.to_padded(ent_M)
    coef = torch.linspace(-1, 1, lp_pk.numel(), dtype=torch.float64).view_as(lp_pk)
    g_pk = torch.autograd.grad(((lp_pk + 0.1 * ent_pk) * coef).sum(), list(model.parameters()))
    lp_pd, ent_pd = causal_token_logprobs(model, padded.input_ids_BT, padded.attention_mask_BT,
                                          padded.labels_BT, temperature=0.9, chunk_tokens=16,
                                          compute_entropy=True)
    scored = padded.labels_BT != -100
    ent_pd = torch.where(scored, ent_pd, 0.0)
    g_pd = torch.autograd.grad(((lp_pd + 0.1 * ent_pd) * coef).sum(), list(model.parameters()))
    assert torch.allclose(lp_pk, lp_pd, atol=1e-10)
    assert torch.allclose(ent_pk, ent_pd, atol=1e-10)
    for a, b in zip(g_pk, g_pd, strict=True):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-9), (torch.float32, 2e-4)])
def test_packed_and_padded_train_step_agree(dtype, rtol):
    """The same PPO step through packed and padded micro-batches: same loss, same
    gradients (micro-batches split differently: padded count x longest vs real tokens)."""
    kw = dict(mb_max_tokens=48, loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01)
    pk = _actor(_model(dtype=dtype), **kw)
    pd = _actor(_model(dtype=dtype), packed_sequences=False, **kw)
    r_pk, r_pd = pk.train_step(_items()), pd.train_step(_items())
    assert r_pk.metrics["actor/micro_batches"] < r_pd.metrics["actor/micro_batches"]
    assert r_pk.metrics["actor/loss"] == pytest.approx(r_pd.metrics["actor/loss"], rel=rtol)
    assert r_pk.metrics["actor/entropy"] == pytest.approx(r_pd.metrics["actor/entropy"], rel=rtol)
    atol = 1e-12 if dtype == torch.float64 else 1e-6
    for a, b in zip(_grads(pk), _grads(pd), strict=True):
        assert torch.allclose(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_a_step_reads_its_losses_and_statistics_once_per_minibatch(loss_agg_mode, count_host_reads):
    """The loss, entropy and statistics stay on the device until the minibatch's one read
    (with its gradient norm): a read per micro-batch would stall the host on a GPU."""
    def reads(mb_max_tokens: int) -> tuple[int, float]:
        actor = _actor(mb_max_tokens=mb_max_tokens, loss_agg_mode=loss_agg_mode)
        mbs = actor.micro_batches(_items(n=12))
        with count_host_reads() as count:
            actor.train_micro_batches(mbs)
        return count.reads, len(mbs)

    few, n_few = reads(400)
    many, n_many = reads(40)
    assert n_many >= n_few + 4
    # seq-mean counts each micro-batch's sequences once, before the first forward.
    assert many - few == (0 if loss_agg_mode == "token-mean" else n_many - n_few)


# --------------------------------------------------------------------- the switches

@pytest.mark.parametrize("switch", [
    dict(gradient_checkpointing=True),
    dict(gradient_checkpointing=True, gradient_checkpointing_every_n_layers=2),
    dict(recompute_swiglu=True),
])
def test_memory_switches_give_equal_gradients(switch):
    base, other = _actor(mb_max_tokens=48), _actor(mb_max_tokens=48, **switch)
    r_base, r_other = base.train_step(_items()), other.train_step(_items())
    assert r_base.metrics["actor/loss"] == pytest.approx(r_other.metrics["actor/loss"], rel=1e-12)
    for a, b in zip(_grads(base), _grads(other), strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-13)


def test_gradient_checkpointing_recomputes_layers():
    actor = _actor(gradient_checkpointing=True, gradient_checkpointing_every_n_layers=2)
    calls = [0]
    for layer in actor.packed.layers:
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    actor.train_step(_items(n=2))
    # 2 layers, layer 0 checkpointed: 2 forwards + 1 recompute per micro-batch.
    assert calls[0] == 3


def test_bf16_params_step_fp32_masters():
    """param_dtype bfloat16: AdamW runs on fp32 masters; the bf16 weights are their
    rounding. An update far below bf16's resolution moves the masters (not lost)."""
    model = _model(dtype=torch.bfloat16)
    before = [p.detach().float().clone() for p in model.parameters()]
    actor = _actor(model, lr=1e-5, param_dtype="bfloat16", mb_max_tokens=256)
    assert isinstance(actor.optimizer, MasterAdamW)
    actor.train_step(_items())
    opt = actor.optimizer
    moved = [(m - b).abs().max().item() for m, b in zip(opt.masters, before)]
    assert all(0 < d < 2e-5 for d in moved)  # Adam's first step: |update| <= lr
    for p, m in zip(opt.params, opt.masters):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(p.detach(), m.to(torch.bfloat16))
    assert len(opt.state) == len(opt.params)
    # The same step as torch's AdamW on fp32 weights with the same gradients.
    ref = [b.clone().requires_grad_() for b in before]
    ref_opt = torch.optim.AdamW(ref, lr=1e-5, weight_decay=0.0)
    actor2 = _actor(_model(dtype=torch.bfloat16), lr=1e-5, param_dtype="bfloat16", mb_max_tokens=256)
    actor2.optimizer.step = lambda: None  # keep the bf16 gradients, apply them to ref
    actor2.train_step(_items())
    for r, p in zip(ref, actor2.optimizer.params):
        r.grad = p.grad.float()
    ref_opt.step()
    for r, m in zip(ref, opt.masters):
        assert torch.allclose(r.detach(), m, rtol=0, atol=1e-9)


def test_master_weights_follow_a_rollback_and_round_trip_a_checkpoint():
    model = _model(dtype=torch.bfloat16)
    opt = build_optimizer(model, ActorConfig(optimizer=OptimizerConfig(lr=1e-2), param_dtype="bfloat16"), "cpu")
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = torch.ones_like(p)
        opt.clip_grad_norm_(1.0)
        opt.step()

    step()
    saved = opt.state_dict()
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "master"}
    # A rollback copies weights in place: the masters must follow, not overwrite them.
    with torch.no_grad():
        params[0].copy_(torch.full_like(params[0], 0.5))
    step()
    assert (params[0].float() - 0.5).abs().max() < 0.02
    # Load the saved state into a fresh optimizer: masters and moments come back.
    opt2 = build_optimizer(_model(dtype=torch.bfloat16),
                           ActorConfig(optimizer=OptimizerConfig(lr=1e-2), param_dtype="bfloat16"), "cpu")
    opt2.load_state_dict(saved)
    for m, s in zip(opt2.masters, (saved["state"][i]["master"] for i in range(len(opt2.masters)))):
        assert torch.equal(m, s)
    assert torch.equal(opt2.state[opt2.params[0]]["exp_avg"], saved["state"][0]["exp_avg"])
    opt2.state.clear()
    assert len(opt2.state) == 0


def test_master_weights_survive_a_trainer_checkpoint(tmp_path):
    from tapioca.trainers.checkpoint import TrainerProgress, load_checkpoint, save_checkpoint

    cfg = ActorConfig(optimizer=OptimizerConfig(lr=1e-2), param_dtype="bfloat16")
    model = _model(dtype=torch.bfloat16)
    opt = build_optimizer(model, cfg, "cpu")
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.3)
    opt.step()
    save_checkpoint(tmp_path / "ckpt", model, opt, TrainerProgress(version=1))
    model2 = _model(dtype=torch.bfloat16, seed=1)
    opt2 = build_optimizer(model2, cfg, "cpu")
    assert load_checkpoint(tmp_path / "ckpt", model2, opt2).version == 1
    for m1, m2, p1, p2 in zip(opt.masters, opt2.masters, model.parameters(), model2.parameters()):
        assert torch.equal(m1, m2) and torch.equal(p1, p2)
    assert torch.equal(opt2.state[opt2.params[0]]["exp_avg_sq"], opt.state[opt.params[0]]["exp_avg_sq"])


def test_offload_optimizer_steps_like_the_device_one():
    a = _actor(_model(dtype=torch.bfloat16), lr=1e-3, param_dtype="bfloat16")
    b = _actor(_model(dtype=torch.bfloat16), lr=1e-3, param_dtype="bfloat16", offload_optimizer=True)
    assert b.optimizer.offload and all(m.device.type == "cpu" for m in b.optimizer.masters)
    a.train_step(_items())
    b.train_step(_items())
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)


def test_packed_actor_learns():
    """A few steps on one batch raise the advantage-weighted logprob (the loss falls)."""
    items = _items(n=4)
    for it in items:
        it.advantage = 1.0
    actor = _actor(_model(dtype=torch.float32, num_layers=1), lr=3e-2, max_grad_norm=1.0, mb_max_tokens=64)
    losses = [actor.train_step(items).metrics["actor/loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.parametrize("cfg, message", [
    (dict(attention_backend="flash"), "attention_backend"),
    (dict(logprob_kernel="cuda"), "logprob_kernel"),
    (dict(liger_kernels=True, compile_layers=True), "exclude each other"),
    (dict(packed_sequences=False, gradient_checkpointing=True), "packed_sequences=true"),
    (dict(offload_optimizer=True), "param_dtype=bfloat16"),
    (dict(gradient_checkpointing_every_n_layers=0), ">= 1"),
])
def test_switch_validation(cfg, message):
    with pytest.raises(ConfigError, match=message):
        ActorConfig(**cfg)


def test_unsupported_model_is_refused_with_the_way_out():
    model = _model()
    model.config.hidden_act = "gelu"
    with pytest.raises(ConfigError, match="packed_sequences=false"):
        PackedCausalLM(model)


def test_varlen_backend_refused_on_cpu():
    with pytest.raises(ConfigError, match="attention_backend=sdpa"):
        PackedCausalLM(_model(), attention_backend="varlen")


def test_autocast_packed_forward_runs_on_cpu():
    """fp32 weights under bf16 autocast (the GPU recipe) on the CPU sdpa path."""
    model = _model(dtype=torch.float32)
    actor = _actor(model, autocast_dtype="bfloat16")
    with autocast_context("cpu", "bfloat16"):
        m = actor.train_step(_items()).metrics
    assert torch.isfinite(torch.tensor(m["actor/loss"]))


# ------------------------------------------------- Triton kernels, interpreted on CPU

def _run_interpreted(code: str) -> str:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_triton_logprob_kernel_matches_torch_path():
    out = _run_interpreted("""
        import torch
        from tapioca.algorithms.logprobs import gather_logprobs_entropy
        torch.manual_seed(0)
        N, H, V = 13, 8, 300
        h = torch.randn(N, H, requires_grad=True); w = torch.randn(V, H, requires_grad=True)
        y = torch.randint(0, V, (N,)); y[3] = -100
        for ent in (True, False):
            res = {}
            for k, keep in (("torch", False), ("triton", False), ("triton", True)):
                lp, e = gather_logprobs_entropy(h, w, y, chunk_tokens=5, compute_entropy=ent,
                                                kernel=k, temperature=0.7, keep_logits=keep)
                loss = (lp * torch.linspace(-1, 1, N)).sum()
                if ent:
                    loss = loss + (e * torch.linspace(1, 2, N)).sum()
                res[k, keep] = [lp, e, *torch.autograd.grad(loss, (h, w))]
            for key in (("triton", False), ("triton", True)):
                for a, b in zip(res["torch", False], res[key]):
                    if a is not None:
                        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (key, (a - b).abs().max())
            assert res["triton", False][0][3] == 0  # ignored label
        print("ok")
    """)
    assert out.strip() == "ok"


def test_liger_rope_matches_torch_rope():
    pytest.importorskip("liger_kernel")
    out = _run_interpreted("""
        import torch
        from tapioca.models.fused_ops import LigerOps, TorchOps
        torch.manual_seed(0)
        q = torch.randn(10, 4, 16, requires_grad=True); k = torch.randn(10, 2, 16, requires_grad=True)
        freqs = torch.arange(10).float()[:, None] / 10000 ** (torch.arange(0, 16, 2).float() / 16)
        emb = torch.cat([freqs, freqs], -1)
        outs = [ops.rope(q * 1, k * 1, emb.cos(), emb.sin()) for ops in (LigerOps(), TorchOps())]
        gq, gk = torch.randn(10, 4, 16), torch.randn(10, 2, 16)
        grads = [torch.autograd.grad((a * gq).sum() + (b * gk).sum(), (q, k)) for a, b in outs]
        for a, b in zip([*outs[0], *grads[0]], [*outs[1], *grads[1]]):
            assert torch.allclose(a, b, atol=1e-6)
        print("ok")
    """)
    assert out.strip() == "ok"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="liger's kernels need CUDA")
def test_liger_packed_forward_matches_torch_on_cuda():
    pytest.importorskip("liger_kernel")
    model = _model(dtype=torch.float32).cuda()
    batch = to_packed(_items(), "cuda")
    outs = []
    for liger in (False, True):
        packed = PackedCausalLM(model, liger=liger, attention_backend="sdpa")
        h = packed(batch.input_ids_N, batch.position_ids_N, batch.seqs)
        outs.append((h, torch.autograd.grad(h.square().sum(), list(model.parameters()))))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-4)
    for a, b in zip(outs[0][1], outs[1][1]):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-4)
