"""One policy-gradient training step on a causal LM (single process, CPU or one GPU).

Consumes a step's :class:`SeqItem` list (and the trainer's ``policy_version``);
emits updated weights (in place) and a :class:`StepResult` of ``actor/*`` metrics.

Where pi_prox (the policy before this update) comes from, with
``actor.recompute_logprob: true``:

* micro-batches of the **first minibatch** (all of them with the default
  ``ppo_n_minibatches: 1``): their training forward runs before any optimizer step
  of this ``train_step``, so its detached log-probs *are* pi_prox, exactly and for
  free, under every ``prox_logp_method``;
* micro-batches of **later minibatches** see weights already moved by earlier
  minibatches: ``prox_logp_method: recompute`` (and ``metrics``) runs a no-grad
  forward for them before the first optimizer step; ``loglinear`` approximates
  pi_prox from their training forward (:mod:`tapioca.algorithms.prox_logp`).
* With ``m2_threshold`` under ``recompute`` / ``metrics``, M2PO's mask covers the
  whole step, which needs pi_prox of every micro-batch before the first backward:
  the no-grad forward then runs for all micro-batches (under ``loglinear`` the mask
  is per micro-batch instead).

With ``recompute_logprob: false`` the behaviour log-probs are pi_prox (coupled PPO;
the config refuses the pi_prox/pi_behav filters then, since they could never fire).
``actor/entropy`` is the entropy of the pre-update policy where known (no-grad
forward or first minibatch), else of the training forward.

Logprobs come from hidden states in chunks, never from the full-vocabulary fp32 logits
of a whole batch: with ``actor.packed_sequences`` (default) from the packed forward
(:class:`tapioca.models.packed.PackedCausalLM`: sequences concatenated without padding,
block-diagonal attention, the LM head only on the rows that score an output token),
else from the right-padded HF forward
(:func:`tapioca.models.forward.causal_token_logprobs`).

Structure (an FSDP2 trainer wraps the same pieces): :func:`build_train_modules` makes
the packed forward module and the optimizer from the model and the config;
:meth:`PPOActor.micro_batches` packs a step's items; :meth:`PPOActor.train_micro_batches`
is the step on already-built micro-batches. The loss is
:func:`tapioca.algorithms.policy_losses.policy_loss` (PPO, GSPO, SAPO, CISPO, M2PO,
rejection sampling, entropy bonus, selected by :class:`ActorConfig`).

Vision-language policies (Qwen2.5-VL, Qwen3-VL; docs/vlm.md): ``images`` (an
:class:`~tapioca.models.vision.ImageLoader`) recomputes each micro-batch's pixels from
the bytes (trainers/vision_batch.py), packed or padded alike; ``freeze_vision_encoder``
keeps the vision tower out of the optimizer (its weights are still published).

Gradients accumulate over token-balanced micro-batches (whole sequences) of each of
``ppo_n_minibatches`` minibatches (one optimizer step each). Each micro-batch's loss
is scaled by its share of the minibatch's aggregation units (trained tokens for
``token-mean``, non-empty sequences for the ``seq-mean-*`` modes; see
:func:`tapioca.algorithms.aggregation.agg_units`), so the accumulated gradient is
exactly the gradient of the minibatch's aggregated loss.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable

import torch

from ..algorithms.aggregation import agg_units
from ..algorithms.errors import AlgorithmInputError
from ..algorithms.policy_losses import policy_loss_device_stats
from ..algorithms.prox_logp import loglinear_prox_logprobs
from ..algorithms.rejection_sampling import m2po_keep_flat
from ..config.policy import PolicySpec
from ..config.schema import ActorConfig
from ..models.forward import autocast_context, causal_token_logprobs, packed_token_logprobs
from ..models.packed import ROUTER_LOSS_NAMES
from ..models.prefix_attention import TreeSeqs
from ..schemas.errors import ConfigError
from .batching import SeqItem, TensorBatch
from .micro_batching import micro_batch_builder
from .optim import build_optimizer, clip_grad_norm_, lr_factor, set_lr
from .packing import PackedBatch
from .prefix_packing import check_packed_tree_backend

log = logging.getLogger(__name__)

# Switches that act on the packed forward only (config/schema.py refuses them with
# packed_sequences false; a family the packed forward does not run refuses them here).
_PACKED_ONLY = ("liger_kernels", "compile_layers", "gradient_checkpointing", "recompute_swiglu",
                "moe.aux_loss_coeff", "moe.z_loss_coeff", "enable_tree_training")


@dataclass
class StepResult:
    metrics: dict[str, float]
    n_tokens: int
    # Minibatches whose loss or gradient norm was not finite: their optimizer step was
    # skipped (nothing applied), and the groups they held.
    skipped_minibatches: int = 0
    applied_minibatches: int = 0
    skipped_group_ids: set[str] = field(default_factory=set)
    # Minibatches with no trained token (every token masked, e.g. stale-token masking):
    # their optimizer step changes nothing (no gradient); AReaL's stale_empty_minibatch_fraction.
    empty_minibatches: int = 0


def build_train_modules(model: torch.nn.Module, cfg: ActorConfig, device: str | torch.device,
                        *, shard: Callable[[list[torch.nn.Module]], None] | None = None,
                        parallel=None):
    """``(packed, optimizer)`` for training ``model`` (already on ``device``):
    the packed forward module (None with ``packed_sequences: false``) and the optimizer.
    ``shard`` (the FSDP2 actor, trainers/fsdp_actor.py) wraps the modules whose forward
    runs per layer -- the packed layers, or the HF decoder layers -- before the optimizer
    is built over the (then sharded) parameters. ``parallel`` (a
    :class:`~tapioca.models.parallel.MeshDims`): the tensor / context-parallel forward,
    which splits the weights over the mesh first."""
    from ..models.moe import router_parameters
    from ..models.packed import PackedCausalLM, unsupported_reason

    packed = None
    family = getattr(model.config, "model_type", "?")
    reason = unsupported_reason(model) if cfg.packed_sequences else "actor.packed_sequences is off"
    if cfg.packed_sequences and reason is not None:
        on = [f"actor.{name}" for name in _PACKED_ONLY if attrgetter(name)(cfg)]
        if on:
            raise ConfigError(f"model family {family!r}: {reason}, so it trains with the padded HF "
                              f"forward, where {', '.join(on)} do not apply: unset them")
        log.warning("model family %r trains with the padded HF forward: %s", family, reason)
    elif cfg.packed_sequences:
        liger = cfg.liger_kernels
        if liger is None:  # null: on where it runs (issue 37: the fast path by default)
            from ..models.fused_ops import liger_by_default

            liger = liger_by_default(device, model, parallel=parallel is not None,
                                     compile_layers=cfg.compile_layers)
        kwargs = dict(
            attention_backend=cfg.attention_backend, liger=liger,
            compile_layers=cfg.compile_layers,
            checkpoint_every_n_layers=cfg.gradient_checkpointing_every_n_layers if cfg.gradient_checkpointing else 0,
            recompute_swiglu=cfg.recompute_swiglu, autocast_dtype=cfg.autocast_dtype,
            moe_router_dtype=cfg.moe.router_dtype)
        if parallel is None:
            packed = PackedCausalLM(model, **kwargs)
        else:
            from ..models.parallel import ParallelPackedCausalLM

            packed = ParallelPackedCausalLM(model, parallel, torch.device(device), **kwargs)
        if cfg.enable_tree_training:
            check_packed_tree_backend(packed)
        # A dense model is refused at start (config/features.py's moe_router_losses_x_dense_model);
        # this also catches an MoE family whose layers the packed forward does not route.
        if (cfg.moe.aux_loss_coeff or cfg.moe.z_loss_coeff) and not packed.moe_layers:
            raise ConfigError(f"actor.moe.aux_loss_coeff / z_loss_coeff are set but model family "
                              f"{family!r} has no MoE layer: set them to 0")
    if cfg.moe.router_replay != "disabled" and cfg.enable_tree_training:  # defence: the table's row
        raise ConfigError(f"actor.moe.router_replay={cfg.moe.router_replay} replays per-sequence routes, which "
                          "actor.enable_tree_training does not map onto its shared prefixes: set one off "
                          "(feature table: router_replay_x_tree_training)")
    # A dense model is refused at start (config/features.py's router_replay_x_dense_model);
    # this also catches an MoE family the packed forward cannot route.
    if cfg.moe.router_replay != "disabled" and (packed is None or not packed.moe_layers):
        why = reason if packed is None else "it has no MoE layer the packed forward routes"
        raise ConfigError(f"actor.moe.router_replay={cfg.moe.router_replay} replays the routes of the packed "
                          f"forward's MoE layers, but model family {family!r} cannot ({why}): set "
                          "actor.moe.router_replay=disabled")
    if cfg.moe.freeze_router:  # a dense model is refused at start (freeze_router_x_dense_model)
        routers = router_parameters(model)
        if not routers:
            raise ConfigError(f"actor.moe.freeze_router is set but model family {family!r} has no "
                              "MoE router (no mlp.gate / mlp.router weights): unset it")
        for p in routers:
            p.requires_grad_(False)
    if shard is not None:
        shard(list(packed.layers) if packed is not None else list(model.get_decoder().layers))
    return packed, build_optimizer(model, cfg, device)


class PPOActor:
    #: True: the first minibatch takes pi_prox from its own training forward (exact).
    #: False: a separate no-grad forward for every micro-batch (``loglinear``: the
    #: approximation for every micro-batch), the slower path; tests check both agree.
    prox_from_training_forward: bool = True

    def __init__(self, model: torch.nn.Module, cfg: ActorConfig, *, temperature: float,
                 pad_token_id: int, device: str = "cpu", total_train_steps: int = 0,
                 shard: Callable[[list[torch.nn.Module]], None] | None = None, parallel=None,
                 place_model: bool = True, images=None, freeze_vision_encoder: bool = False,
                 policy: PolicySpec | None = None, lora_seed: int = 0) -> None:
        """``total_train_steps``: the run's (the lr schedule's length, ``actor.optimizer``);
        0: ``lr`` as it is, no schedule (refused by a train step when one is configured).
        ``place_model=False`` (the sharded trainer): the weights stay where they are loaded
        (the host) and only each rank's shards move to ``device``. ``images``: a
        vision-language policy's image loader (models/vision.py ``ImageLoader``).
        ``policy`` (config/policy.py; None: a full-weights policy): with an adapter, train a
        LoRA adapter on the frozen ``model`` (models/lora.py): its layers are injected before
        the optimizer is built, so only the adapter is optimised, checkpointed and published;
        its initial A is drawn from ``lora_seed`` (the run's seed)."""
        from ..models.vision import vision_spec, vision_tower

        self.model = model.to(device) if place_model else model
        self.lora = lora = policy.adapter if policy is not None else None
        # The wrapped modules' short names (q_proj, ...), what weight events name.
        self.lora_targets: list[str] = []
        if lora is not None:
            from ..models.lora import apply_lora

            self.lora_targets = apply_lora(self.model, rank=lora.rank, alpha=lora.alpha,
                                           target_modules=lora.target_modules, seed=lora_seed)
        self.cfg = cfg
        self.total_train_steps = total_train_steps
        self.temperature = temperature
        self.pad_token_id = pad_token_id
        self.device = torch.device(device)
        self.vision = vision_spec(model.config)
        self.images = images if self.vision is not None else None
        if self.vision is not None and (cfg.enable_tree_training or parallel is not None):
            # Both would build micro-batches without the images (refused at start by
            # config/features.py's rows vlm_x_tree_training and vlm_x_tensor_context_parallel);
            # said here for direct callers.
            raise ConfigError("a vision-language policy trains without "
                              + ("actor.enable_tree_training" if cfg.enable_tree_training
                                 else "tensor / context parallelism")
                              + " for now (docs/vlm.md): turn it off")
        if freeze_vision_encoder and self.vision is not None:
            vision_tower(self.model).requires_grad_(False)
        self.packed, self.optimizer = build_train_modules(self.model, cfg, self.device, shard=shard,
                                                          parallel=parallel)
        # How a step's items become micro-batches, chosen once (trainers/micro_batching.py).
        self.build_micro_batches = micro_batch_builder(cfg, packed=self.packed, pad_token_id=pad_token_id,
                                                       device=self.device, images=self.images,
                                                       vision=self.vision)

    @property
    def forward_module(self) -> torch.nn.Module:
        """The module whose forward runs once per micro-batch forward pass."""
        return self.packed if self.packed is not None else self.model.get_decoder()

    def micro_batches(self, items: list[SeqItem]) -> list[TensorBatch]:
        """The step's micro-batches of at most ``mb_max_tokens`` tokens: packed (real
        tokens; prefix trees with ``enable_tree_training``, each shared prefix counted
        once) or right-padded (count x longest), per ``packed_sequences``; with
        ``router_replay`` R3 packed with the items' routes (config refuses R3 with trees);
        with their images for a vision-language policy. The builder was chosen with the
        actor (:attr:`build_micro_batches`, trainers/micro_batching.py)."""
        return self.build_micro_batches(items)

    def check_images(self, event) -> None:
        """Raise BadEventError for a sample whose images cannot be trained on here
        (trainers/vision_batch.py ``check_images``)."""
        from .vision_batch import check_images

        check_images(event, self.images, self.vision)

    # The weights as the trainer role sees them (publishing, rollback, checkpoints);
    # the sharded actor (trainers/fsdp_actor.py) gathers and scatters them across ranks.

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight of the model, whole (what a weights file holds)."""
        return self.model.state_dict()

    def load_full_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy whole weights in (tied weights were saved once; copying one sets both)."""
        own = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in tensors.items():
                own[name].copy_(tensor)

    def publish_state_dict(self) -> dict[str, torch.Tensor]:
        """What a version publishes: the adapter (PEFT file names) in a LoRA run, else every
        weight (:meth:`full_state_dict`)."""
        if self.lora is None:
            return self.full_state_dict()
        from ..models.lora import adapter_state_dict

        return adapter_state_dict(self.model)

    def load_publish_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy in what :meth:`publish_state_dict` gives (a rollback's version)."""
        if self.lora is None:
            self.load_full_state_dict(tensors)
            return
        from ..models.lora import load_adapter_state_dict

        load_adapter_state_dict(self.model, tensors)

    def save_checkpoint(self, path, progress) -> None:
        from .checkpoint import save_checkpoint

        save_checkpoint(path, self.model, self.optimizer, progress, trainable_only=self.lora is not None)

    def load_checkpoint(self, path):
        """The checkpoint's TrainerProgress (weights and optimizer loaded), or None."""
        from .checkpoint import load_checkpoint

        return load_checkpoint(path, self.model, self.optimizer, trainable_only=self.lora is not None)

    def logprobs(self, batch: TensorBatch, *, entropy: bool = False):
        """Per-token logprobs (and entropy) of ``labels_BT`` under the current weights,
        ``[B, T-1]`` for a padded or a packed batch alike."""
        cfg = self.cfg
        with autocast_context(self.device, cfg.autocast_dtype):
            if isinstance(batch, PackedBatch):
                if self.packed is None:
                    raise AlgorithmInputError("PPOActor.logprobs: a PackedBatch needs "
                                              "actor.packed_sequences=true")
                lp_M, ent_M = packed_token_logprobs(
                    self.packed, batch.input_ids_N, batch.position_ids_N, batch.seqs, batch.rows_M,
                    batch.labels_M, temperature=self.temperature, chunk_tokens=cfg.logprob_chunk_tokens,
                    compute_entropy=entropy, kernel=cfg.logprob_kernel,
                    keep_logits=cfg.logprob_keep_logits, replay_topk_LNK=batch.replay_topk_LNK,
                    images=batch.images)
                return batch.to_padded(lp_M), (batch.to_padded(ent_M) if entropy else None)
            return causal_token_logprobs(
                self.model, batch.input_ids_BT, batch.attention_mask_BT, batch.labels_BT,
                temperature=self.temperature, chunk_tokens=cfg.logprob_chunk_tokens,
                compute_entropy=entropy, kernel=cfg.logprob_kernel, images=batch.images)

    def _loss_kwargs(self) -> dict:
        cfg = self.cfg
        return dict(
            eps_clip=cfg.eps_clip, eps_clip_higher=cfg.eps_clip_higher, c_clip=cfg.c_clip,
            importance_sampling_level=cfg.importance_sampling_level,
            use_sapo_loss=cfg.use_sapo_loss, sapo_tau_pos=cfg.sapo_tau_pos,
            sapo_tau_neg=cfg.sapo_tau_neg, use_cispo_loss=cfg.use_cispo_loss,
            behav_imp_weight_cap=cfg.behav_imp_weight_cap,
            rejection_sampling=cfg.rejection_sampling, entropy_coeff=cfg.entropy_coeff,
            agg_mode=cfg.loss_agg_mode, max_tokens=cfg.loss_agg_max_tokens)

    def _prox_forward_ids(self, minibatches: list[list[int]], n_mbs: int) -> list[int]:
        """Micro-batches whose pi_prox needs a no-grad forward before training."""
        cfg = self.cfg
        if not cfg.recompute_logprob or cfg.prox_logp_method == "loglinear":
            return []
        if not self.prox_from_training_forward or cfg.m2_threshold is not None:
            return list(range(n_mbs))  # step-wide M2PO mask: every pi_prox up front
        return sorted(i for mb_ids in minibatches[1:] for i in mb_ids)

    def _route_pass_ids(self, minibatches: list[list[int]], prox_ids: list[int]) -> list[int]:
        """R2: micro-batches whose first pass must be a no-grad forward that records their
        routes (every one whose training forward follows an optimizer step of this
        train_step), beyond the pi_prox forwards (which record them anyway)."""
        if self.cfg.moe.router_replay != "R2":
            return []
        later = {i for mb_ids in minibatches[1:] for i in mb_ids}
        if not self.prox_from_training_forward:
            later |= {i for i in minibatches[0]}
        return sorted(later - set(prox_ids))

    def train_step(self, items: list[SeqItem], *, policy_version: int | None = None) -> StepResult:
        """Train on ``items``; ``policy_version`` = optimizer steps applied so far (the
        version of the weights before this update), needed by ``prox_logp_method``
        ``loglinear`` and ``metrics``."""
        t0 = time.perf_counter()
        result = self.train_micro_batches(self.micro_batches(items), policy_version=policy_version)
        elapsed = time.perf_counter() - t0
        result.metrics["actor/step_time_s"] = elapsed
        n_all = sum(it.length for it in items)
        result.metrics["actor/tokens_per_s"] = n_all / elapsed if elapsed > 0 else 0.0
        return result

    def train_micro_batches(self, mbs: list[TensorBatch], *,
                            policy_version: int | None = None) -> StepResult:
        """One ``train_step`` on already-built micro-batches (:meth:`micro_batches`)."""
        cfg = self.cfg
        method = cfg.prox_logp_method if cfg.recompute_logprob else "recompute"
        if method != "recompute" and policy_version is None:
            raise AlgorithmInputError(
                f"PPOActor.train_step: actor.prox_logp_method={method} needs "
                "policy_version= (the version of the weights before this update).")
        lr = self._scheduled_lr(policy_version)
        self.model.train()
        # Real tokens per micro-batch, read once (one host sync for all of them; the
        # property syncs on every read).
        n_tok = [int(n) for n in torch.stack([mb.mask_BT.sum() for mb in mbs]).tolist()] if mbs else []
        total_tokens = sum(n_tok)
        # Every token of a micro-batch (prompt too): what the router losses average over.
        n_all = [mb.seqs.n_tokens if isinstance(mb, PackedBatch) else int(mb.input_ids_BT.numel()) for mb in mbs]
        # token-mean averages over the real tokens just read; the other modes count
        # sequences (a host read each).
        units = (list(n_tok) if cfg.loss_agg_mode == "token-mean"
                 else [agg_units(mb.mask_BT, cfg.loss_agg_mode) for mb in mbs])
        minibatches = _split(list(range(len(mbs))), cfg.ppo_n_minibatches)
        # pi_prox per micro-batch: a tensor when known before training (behaviour
        # logprobs, or the no-grad forward below); None = from the training forward
        # (exact in the first minibatch, loglinear in later ones).
        prox: list[torch.Tensor | None] = [None] * len(mbs)
        if not cfg.recompute_logprob:
            prox = [mb.behav_logprobs_BT for mb in mbs]
        entropy_known = [False] * len(mbs)
        # Sums kept on the device and read with each minibatch's gradient norm (the one
        # host sync of a minibatch): a read per micro-batch would stall the host until
        # its backward is done, with nothing queued behind it.
        entropy_sum = _DeviceSum()
        replay = RouteStats(self.packed, cfg.moe.router_replay)
        prox_ids = self._prox_forward_ids(minibatches, len(mbs))
        with torch.no_grad():
            for i in prox_ids:
                lp, ent = self.logprobs(mbs[i], entropy=True)
                prox[i] = lp
                entropy_known[i] = True
                entropy_sum.add((ent * mbs[i].mask_BT).sum())
                replay.first_pass(mbs[i], lp, record=True, count=self._aux_weight(mbs[i]) > 0)
            route_ids = self._route_pass_ids(minibatches, prox_ids)
            for i in route_ids:
                self.logprobs(mbs[i])  # R2: the first pass, for its routes only
                replay.first_pass(mbs[i], None, record=True, count=self._aux_weight(mbs[i]) > 0)
        first_done = set(prox_ids) | set(route_ids)
        keeps = self._m2po_keeps(mbs, prox)
        kwargs = self._loss_kwargs()
        sums: dict[str, float] = {}
        skipped: list[int] = []
        empty = sum(1 for mb_ids in minibatches if not any(n_tok[i] for i in mb_ids))
        for mb_index, mb_ids in enumerate(minibatches):
            # The minibatch's sums, on the device until its one read (merged into sums only
            # if its step is applied).
            mb_dev: dict[str | tuple[str, ...], _DeviceSum] = {}
            mb_tokens = sum(n_tok[i] for i in mb_ids) or 1
            mb_units = sum(units[i] for i in mb_ids) or 1
            mb_all = sum(n_all[i] for i in mb_ids) or 1
            # No optimizer step yet in this train_step: the training forward is pi_prox.
            exact_forward = mb_index == 0 and self.prox_from_training_forward
            self.optimizer.zero_grad(set_to_none=True)
            for i in mb_ids:
                mb = mbs[i]
                if n_tok[i] == 0:
                    continue
                logp, ent = self.logprobs(
                    mb, entropy=cfg.entropy_coeff > 0 or not entropy_known[i])
                prox_i = prox[i]
                if prox_i is None:
                    prox_i = logp.detach() if exact_forward else loglinear_prox_logprobs(
                        mb.behav_logprobs_BT, logp.detach(), mb.versions_BT, policy_version)
                if exact_forward and i not in first_done:  # this forward is its first pass
                    replay.first_pass(mb, logp.detach(), record=False, count=self._aux_weight(mb) > 0)
                if method == "metrics":
                    approx = loglinear_prox_logprobs(mb.behav_logprobs_BT, logp.detach(),
                                                     mb.versions_BT, policy_version)
                    err = torch.where(mb.mask_BT, (approx - prox_i).abs(), 0.0).sum()
                    mb_dev.setdefault("prox_loglinear_abs_err", _DeviceSum()).add(err)
                if not entropy_known[i]:
                    entropy_sum.add((ent.detach() * mb.mask_BT).sum())
                loss, names, stats = policy_loss_device_stats(
                    logp, prox_i, mb.behav_logprobs_BT, mb.advantages_BT, mb.mask_BT,
                    keep_BT=keeps[i],
                    # No step-wide mask (loglinear): M2PO over this micro-batch.
                    m2_threshold=cfg.m2_threshold if keeps[i] is None else None,
                    entropy_BT=ent if cfg.entropy_coeff > 0 else None, **kwargs)
                total = loss * (units[i] / mb_units)
                router_loss = self._router_loss()
                if router_loss is not None:
                    # A mean over the micro-batch's routed tokens: weighted by its share of the
                    # minibatch's tokens, so the minibatch's router loss is a token mean.
                    total = total + router_loss * (self._aux_weight(mb) * n_all[i] / mb_all)
                total.backward()
                router_values = self._router_values()
                if router_values is not None:
                    mb_dev.setdefault(ROUTER_LOSS_NAMES, _DeviceSum()).add(router_values, n_tok[i])
                mb_dev.setdefault(names, _DeviceSum()).add(stats, n_tok[i])
                # The minibatch's aggregated loss, summed over minibatches (token-mean:
                # the token-weighted mean of micro-batch losses, as before).
                # (mb_tokens / mb_units is exactly 1.0 for token-mean: loss * n_tokens as before)
                weight = units[i] * (mb_tokens / mb_units)
                mb_dev.setdefault("loss", _DeviceSum()).add(loss, weight)
            self._before_clip()
            grad_norm = clip_grad_norm_(self.optimizer, self.model, cfg.optimizer.gradient_clipping)
            # The one host sync of the minibatch: its gradient norm, losses and statistics.
            if hasattr(grad_norm, "full_tensor"):  # a DTensor (FSDP2 / tp): its global value
                grad_norm = grad_norm.full_tensor()
            mb_dev.setdefault("grad_norm", _DeviceSum()).add(torch.as_tensor(grad_norm), mb_tokens)
            mb_sums = _read_sums(mb_dev)
            if not self._finite(list(mb_sums.values())):
                # A non-finite loss or gradient norm (e.g. behaviour logprobs of -1e30):
                # applying it would ruin the weights for good. Skip this optimizer step;
                # the caller dead-letters the minibatch's groups.
                self.optimizer.zero_grad(set_to_none=True)
                skipped.append(mb_index)
                continue
            for k, v in mb_sums.items():
                sums[k] = sums.get(k, 0.0) + v
            self.optimizer.step()
        self.model.eval()
        denom = max(total_tokens, 1)
        metrics = {f"actor/{k}": v / denom for k, v in sums.items()}
        for k in ("importance_weight_max",):
            if f"actor/{k}" in metrics:  # a max does not average; report the mean of maxima
                metrics[f"actor/{k}_mean"] = metrics.pop(f"actor/{k}")
        metrics["actor/entropy"] = entropy_sum.read() / denom
        # The lr this step used (scheduled, or the optimizer's own without a version).
        metrics["actor/lr"] = lr if lr is not None else float(self.optimizer.param_groups[0]["lr"])
        metrics["actor/trained_tokens"] = float(total_tokens)
        metrics["actor/micro_batches"] = float(len(mbs))
        trees = [mb.seqs for mb in mbs if isinstance(getattr(mb, "seqs", None), TreeSeqs)]
        if trees:  # tree training: the tokens the forward computed, over those of the sequences
            metrics["actor/tree_tokens_frac"] = sum(t.n_tokens for t in trees) / sum(t.n_flat_tokens for t in trees)
        metrics["actor/skipped_minibatches"] = float(len(skipped))
        if self.packed is not None:
            metrics.update(self.packed.take_router_metrics(self._sum_over_ranks))  # one host read (MoE)
        metrics.update(replay.metrics())  # one host read
        bad = {g for m in skipped for i in minibatches[m] for g in mbs[i].group_ids}
        return StepResult(metrics, total_tokens, skipped_minibatches=len(skipped),
                          applied_minibatches=len(minibatches) - len(skipped),
                          skipped_group_ids=bad, empty_minibatches=empty)

    def _router_loss(self) -> torch.Tensor | None:
        """The last training forward's router losses times their coefficients (None: off)."""
        if self.packed is None:
            return None
        return self.packed.router_loss(self.cfg.moe.aux_loss_coeff, self.cfg.moe.z_loss_coeff)

    def _router_values(self) -> torch.Tensor | None:
        """The last forward's unscaled router losses (mean over MoE layers) for metrics,
        on the device (read with the minibatch's other sums)."""
        return None if self.packed is None else self.packed.router_loss_values()

    _sum_over_ranks = None  # the sharded actor's: a tensor summed over its ranks

    def _before_clip(self) -> None:
        """After a minibatch's backward passes (the sharded actor reduces the gradients
        FSDP2 does not: expert-parallel experts)."""

    def _aux_weight(self, batch: TensorBatch) -> float:
        """1, or 0 for a micro-batch whose gradient must not count (the sharded actor's
        dummies)."""
        return 1.0

    def _scheduled_lr(self, policy_version: int | None) -> float | None:
        """Set the learning rate of the step after ``policy_version`` steps (the schedule of
        ``actor.optimizer``, trainers/optim.py); None when the version is not known (a
        direct ``train_step`` call: the optimizer keeps its lr)."""
        opt = self.cfg.optimizer
        scheduled = opt.lr_scheduler_type != "constant" or opt.warmup_steps_proportion > 0
        if policy_version is None:
            return None
        if scheduled and self.total_train_steps < 1:
            raise AlgorithmInputError(
                f"PPOActor: actor.optimizer.lr_scheduler_type={opt.lr_scheduler_type} (warm-up "
                f"{opt.warmup_steps_proportion}) needs total_train_steps= (the schedule's length)")
        lr = opt.lr * (lr_factor(policy_version, self.total_train_steps, opt) if scheduled else 1.0)
        set_lr(self.optimizer, lr)
        return lr

    def _finite(self, values: list[float]) -> bool:
        """Whether a minibatch's loss, stats and gradient norm are finite: its optimizer
        step is applied only then (the sharded actor decides this for all ranks)."""
        return all(math.isfinite(v) for v in values)

    def _m2po_keeps(self, mbs: list[TensorBatch], prox: list[torch.Tensor | None]):
        """M2PO keep masks over all trained tokens of the step (None: M2PO off, or
        pi_prox only known during training, loglinear)."""
        if self.cfg.m2_threshold is None or any(p is None for p in prox):
            return [None] * len(mbs)
        with torch.no_grad():
            flat = [(p - mb.behav_logprobs_BT)[mb.mask_BT].square() for p, mb in zip(prox, mbs)]
            keep_flat = m2po_keep_flat(torch.cat(flat), self.cfg.m2_threshold)
            keeps, start = [], 0
            for f, mb in zip(flat, mbs):
                keep = torch.zeros_like(mb.mask_BT)
                keep[mb.mask_BT] = keep_flat[start:start + f.numel()]
                start += f.numel()
                keeps.append(keep)
        return keeps


class RouteStats:
    """What a step's first passes (forwards with the pre-update weights: the pi_prox
    forwards and the first minibatch's training forwards) say about rollout vs training.

    * Every policy: ``actor/rollout_train_k3_kl``, the mean over trained tokens of
      ``exp(d) - 1 - d``, ``d = log pi_train - log pi_behav`` (Schulman's k3; AReaL's
      R3 metric; 0 when the trainer reproduces the rollout's logprobs), and
      ``actor/rollout_train_abs_logprob_diff_mean`` / ``_max``, the mean and max of
      ``|d|`` over the same tokens (with eta > 0, ``d`` holds the policy's change since
      the behaviour version too, not only the engines' numerical mismatch).
    * R3: ``actor/router_replay_agreement``, the share of replayed tokens whose
      trainer router picks the rollout's experts (as a set) in every MoE layer, and
      ``actor/router_replay_tokens``, the tokens routed by recorded routes (prompt and
      output; a sequence without routes routes live).
    * R2: a first pass records its routes on the micro-batch
      (``replay_topk_LNK``); the training forwards that follow replay them.

    Counts stay on the device; :meth:`metrics` reads them once."""

    def __init__(self, packed, mode: str) -> None:
        self.packed = packed
        self.mode = mode
        self._sums: torch.Tensor | None = None  # [k3 sum, trained tokens, replayed, agreeing, |d| sum]
        self._max_abs: torch.Tensor | None = None  # max |d| over the trained tokens seen

    def first_pass(self, batch: TensorBatch, logp_BT: torch.Tensor | None, *, record: bool,
                   count: bool = True) -> None:
        """After a first pass over ``batch`` (its logprobs, None when not scored); with R2
        and ``record`` (a no-grad pass before the training forward) its routes are kept
        for that forward. ``count``: false for a batch that must not count (the sharded
        actor's dummies)."""
        if record and self.mode == "R2" and self.packed is not None and self.packed.moe_layers:
            batch.replay_topk_LNK = self.packed.recorded_routes()
        if not count:
            return
        parts = []
        zero = torch.zeros((), dtype=torch.float64, device=batch.mask_BT.device)
        abs_sum = zero
        if logp_BT is not None:
            d = torch.where(batch.mask_BT, logp_BT.detach().float() - batch.behav_logprobs_BT.float(), 0.0)
            parts += [(torch.expm1(d) - d).double().sum(), batch.mask_BT.sum().double()]
            abs_d = d.abs()  # 0 off the mask
            abs_sum = abs_d.double().sum()
            top = abs_d.max().double() if abs_d.numel() else zero
            self._max_abs = top if self._max_abs is None else torch.maximum(self._max_abs, top)
        else:
            parts += [zero] * 2
        agree = self.packed.route_agreement() if self.packed is not None and self.mode == "R3" else None
        parts += list(agree.double()) if agree is not None else [zero] * 2
        sums = torch.stack(parts + [abs_sum])
        self._sums = sums if self._sums is None else self._sums + sums

    def metrics(self) -> dict[str, float]:
        if self._sums is None:
            return {}
        top = self._max_abs if self._max_abs is not None else self._sums.new_zeros(())
        k3, tokens, replayed, agreeing, abs_sum, max_abs = torch.cat([self._sums, top.view(1)]).tolist()
        out = {"actor/rollout_train_k3_kl": k3 / tokens,
               "actor/rollout_train_abs_logprob_diff_mean": abs_sum / tokens,
               "actor/rollout_train_abs_logprob_diff_max": max_abs} if tokens else {}
        if self.mode == "R3":
            out["actor/router_replay_tokens"] = replayed
            out["actor/router_replay_agreement"] = agreeing / replayed if replayed else 0.0
        return out


def _split(ids: list[int], n: int) -> list[list[int]]:
    n = max(1, min(n, len(ids)))
    return [ids[i::n] for i in range(n)]


class _DeviceSum:
    """A running sum of float64 tensors (a scalar, or one vector of statistics) that
    stays on their device until read."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def add(self, t: torch.Tensor, weight: float = 1.0) -> None:
        # float64 before the weight, as the host's float arithmetic did (a bf16 norm times
        # 8192 tokens would round, a huge fp32 one overflow).
        t = t.detach().to(torch.float64) * weight
        self.value = t if self.value is None else self.value + t

    def read(self) -> float:
        return 0.0 if self.value is None else float(self.value)


def _read_sums(sums: dict) -> dict[str, float]:
    """Every sum of a minibatch as host floats, in one device->host copy. A key is a
    name (a scalar sum) or a tuple of names (a vector of statistics)."""
    keys = [k for k, v in sums.items() if v.value is not None]
    if not keys:
        return {}
    flat = torch.cat([sums[k].value.reshape(-1).to(sums[keys[0]].value.device) for k in keys]).tolist()
    out: dict[str, float] = {}
    at = 0
    for k in keys:
        for name in (k if isinstance(k, tuple) else (k,)):
            out[name] = out.get(name, 0.0) + flat[at]
            at += 1
    return out
