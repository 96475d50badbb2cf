"""What ``benchmarks/trainer_step.py`` measures: model shapes, batches, and one training
step per system (the plain HF step, PPOActor with any ActorConfig), plus the packed-vs-
padded correctness check. Consumes nothing; every function builds what it needs."""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass
from typing import Callable

import torch

from tapioca.config.schema import ActorConfig
from tapioca.models.factory import build_tiny_model
from tapioca.models.forward import autocast_context
from tapioca.trainers.batching import SeqItem
from tapioca.trainers.ppo_actor import PPOActor

LR = 1e-6
MAX_GRAD_NORM = 1.0
VOCAB = 151936
# Published shapes (random weights, the real transformers config classes); tied embeddings.
SHAPES = {
    "qwen2-0.5b": dict(arch="qwen2", vocab_size=VOCAB, hidden_size=896, intermediate_size=4864,
                       num_layers=24, num_heads=14, num_kv_heads=2),
    "qwen2.5-1.5b": dict(arch="qwen2", vocab_size=VOCAB, hidden_size=1536, intermediate_size=8960,
                         num_layers=28, num_heads=12, num_kv_heads=2),
    "qwen2.5-3b": dict(arch="qwen2", vocab_size=VOCAB, hidden_size=2048, intermediate_size=11008,
                       num_layers=36, num_heads=16, num_kv_heads=2),
    "qwen3-1.7b": dict(arch="qwen3", vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144,
                       num_layers=28, num_heads=16, num_kv_heads=8),
}
TINY = dict(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=256, num_layers=2,
            num_heads=4, num_kv_heads=2)


def build(shape: str, tiny: bool, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """Random-weight model of ``shape`` created directly on ``device``, sdpa attention."""
    kw = dict(TINY if tiny else SHAPES[shape])
    vocab = kw.pop("vocab_size")
    model = build_tiny_model(vocab, seed=0, dtype=dtype, device=device, max_position_embeddings=32768, **kw)
    model.set_attn_implementation("sdpa")  # no flash-attn package on the GPU box
    return model


def param_counts(model: torch.nn.Module) -> dict:
    total = sum(p.numel() for p in model.parameters())  # a tied weight is counted once
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    return {"total": total, "non_embedding": total - embed, "matmul": total - embed + head}


# ------------------------------------------------------------------------- batches

@dataclass
class Batch:
    """Sequences of one step: token ids, prompt lengths, advantages (+1 / -1)."""

    name: str
    ids: list[list[int]]
    prompt_lens: list[int]
    advantages: list[float]

    @property
    def real_tokens(self) -> int:
        return sum(len(r) for r in self.ids)

    @property
    def fixed(self) -> bool:
        return len({len(r) for r in self.ids}) == 1

    def items(self, vocab: int) -> list[SeqItem]:
        out = []
        for b, (row, p) in enumerate(zip(self.ids, self.prompt_lens)):
            n = len(row) - p
            # A random model is near uniform: behaviour logprobs of -log(V) keep the
            # pi_prox / pi_behav weights near 1, as in an on-policy step.
            out.append(SeqItem(group_id=f"g{b // 8}", input_ids=row, prompt_len=p,
                               behav_logprobs=[-math.log(vocab)] * n, versions=[0] * n,
                               loss_mask=[1] * n, advantage=self.advantages[b], reward=0.0))
        return out


def fixed_batch(n_seqs: int, seq_len: int, prompt_len: int, vocab: int, seed: int) -> Batch:
    rng = random.Random(seed)
    ids = [[rng.randrange(vocab) for _ in range(seq_len)] for _ in range(n_seqs)]
    return Batch(f"{n_seqs}x{seq_len}", ids, [prompt_len] * n_seqs,
                 [rng.choice((-1.0, 1.0)) for _ in range(n_seqs)])


def heavy_tailed_batch(n_seqs: int, median: int, sigma: float, cap: int, vocab: int, seed: int,
                       min_len: int = 32) -> Batch:
    """Lengths ~ lognormal(log median, sigma), clipped to [min_len, cap]; the prompt is a
    quarter of each sequence, at most 256 tokens."""
    rng = random.Random(seed)
    lengths = [min(cap, max(min_len, round(math.exp(rng.gauss(math.log(median), sigma)))))
               for _ in range(n_seqs)]
    ids = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    return Batch(f"lognormal({median},{sigma})<={cap} x{n_seqs}", ids,
                 [max(1, min(256, n // 4)) for n in lengths],
                 [rng.choice((-1.0, 1.0)) for _ in range(n_seqs)])


# ------------------------------------------------------------------------- systems

def hf_plain_step(model, batch: Batch, device: str, *, checkpointing: bool = False,
                  compiled: bool = False) -> Callable[[], int]:
    """The plain HF step (issue 16's anchor): fp32 weights, bf16 autocast, full logits,
    fp32 log-softmax + gather (cross-entropy of the sampled tokens) times the advantage,
    token mean over the trained tokens, backward, clip, fused AdamW. Fixed lengths."""
    if not batch.fixed:
        raise ValueError("the plain HF step takes fixed-length batches")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compiled:
        for layer in model.get_decoder().layers:
            layer.compile()
    cuda = device.startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True if cuda else None)
    ids_BT = torch.tensor(batch.ids, device=device)
    adv_B = torch.tensor(batch.advantages, device=device)
    mask_BT = torch.zeros(ids_BT.shape[0], ids_BT.shape[1] - 1, device=device)
    for b, p in enumerate(batch.prompt_lens):
        mask_BT[b, p - 1:] = 1.0
    ones_BT = torch.ones_like(ids_BT)
    autocast = "bfloat16" if cuda else ""

    def run() -> int:
        model.train()
        with autocast_context(device, autocast):
            logits_BTV = model(input_ids=ids_BT, attention_mask=ones_BT, use_cache=False).logits
        logp_BTV = logits_BTV[:, :-1].float().log_softmax(-1)
        logp_BT = logp_BTV.gather(-1, ids_BT[:, 1:, None]).squeeze(-1)
        loss = -(logp_BT * adv_B[:, None] * mask_BT).sum() / mask_BT.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return batch.real_tokens
    return run


def actor_config(device: str, **overrides) -> ActorConfig:
    from tapioca.config.optimizer import OptimizerConfig

    opt = dict(lr=overrides.pop("lr", LR), gradient_clipping=overrides.pop("max_grad_norm", MAX_GRAD_NORM))
    kw = dict(optimizer=OptimizerConfig(**opt), device=device)
    kw.update(overrides)
    return ActorConfig(**kw)


def actor_step(model, batch: Batch, cfg: ActorConfig, device: str) -> tuple[Callable[[], int], PPOActor]:
    actor = PPOActor(model, cfg, temperature=1.0, pad_token_id=0, device=device)
    items = batch.items(model.config.vocab_size)
    n_out = sum(len(r) - p for r, p in zip(batch.ids, batch.prompt_lens))

    def run() -> int:
        result = actor.train_step(items, policy_version=0)
        if result.n_tokens != n_out:
            raise RuntimeError(f"PPOActor trained {result.n_tokens} tokens, expected {n_out}")
        return batch.real_tokens
    return run, actor


# ------------------------------------------------------------- correctness (packed)

def _grads_after_step(model, batch: Batch, device: str, **cfg) -> tuple[float, list[torch.Tensor]]:
    """Loss and gradients of one actor step at the model's weights (lr ~ 0, no clip)."""
    actor = PPOActor(model, actor_config(device, lr=1e-30, max_grad_norm=1e30, **cfg), temperature=1.0,
                     pad_token_id=0, device=device)
    loss = actor.train_step(batch.items(model.config.vocab_size), policy_version=0).metrics["actor/loss"]
    grads = [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
             for p in model.parameters()]
    return loss, grads


def compare(loss: float, grads: list[torch.Tensor], ref_loss: float, ref: list[torch.Tensor]) -> dict:
    flat, flat_ref = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref])
    per_param = [float((g - r).norm() / r.norm().clamp_min(1e-30)) for g, r in zip(grads, ref)]
    cos = [float(torch.nn.functional.cosine_similarity(g.flatten(), r.flatten(), dim=0)) for g, r in zip(grads, ref)]
    return {"loss_rel_diff": abs(loss - ref_loss) / max(abs(ref_loss), 1e-30),
            "grad_rel_l2": float((flat - flat_ref).norm() / flat_ref.norm()),
            "grad_rel_l2_worst_param": max(per_param), "grad_cosine_min": min(cos)}


def packed_vs_padded(shape: str, tiny: bool, batch: Batch, device: str, liger: bool) -> dict:
    """Same weights, same batch: the fp32 padded step is the reference; report the fp32
    packed step against it (packing alone), and the bf16-autocast padded (today) and
    packed (fast kernels) steps against it and against each other."""
    base = build(shape, tiny, torch.float32, device)
    cuda = device.startswith("cuda")
    variants = {
        "padded_fp32": dict(packed_sequences=False, logprob_kernel="torch"),
        "packed_fp32": dict(packed_sequences=True, attention_backend="sdpa"),
        "padded_bf16_autocast": dict(packed_sequences=False, autocast_dtype="bfloat16" if cuda else "",
                                     logprob_kernel="torch"),
        "packed_bf16_autocast": dict(packed_sequences=True, autocast_dtype="bfloat16" if cuda else "",
                                     liger_kernels=liger),
        "packed_bf16_weights": dict(packed_sequences=True, param_dtype="bfloat16", liger_kernels=liger),
    }
    out: dict[str, dict] = {}
    results = {}
    for name, cfg in variants.items():
        model = copy.deepcopy(base)
        if cfg.get("param_dtype") == "bfloat16":
            model = model.to(torch.bfloat16)
        results[name] = _grads_after_step(model, batch, device, mb_max_tokens=1 << 20, **cfg)
        del model
    ref_loss, ref = results["padded_fp32"]
    for name, (loss, grads) in results.items():
        if name != "padded_fp32":
            out[f"{name}_vs_padded_fp32"] = compare(loss, grads, ref_loss, ref)
    out["packed_vs_padded_bf16_autocast"] = compare(*results["packed_bf16_autocast"], *results["padded_bf16_autocast"])
    del base, results
    return out
