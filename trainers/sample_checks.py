"""What the trainer refuses to train: checks of a ``SampleEvent`` at the trainer's edge,
where the facts are known (the model's vocabulary and context, the run's advantage
config, the trainer's own version).

Each check raises :class:`~tapioca.schemas.errors.BadEventError` with what is wrong and
what to do; the bus dead-letters the sample at once (no retry can fix it) and the
trainer counts its group as rejected (docs/design-choices.md, "What the trainer
dead-letters"). A sample that passes cannot crash a training step: every token id
indexes the embedding, every number stays finite in float32.
"""

from __future__ import annotations

from ..algorithms.limits import MAX_ABS_REWARD, MAX_BEHAV_LOGPROB, MIN_BEHAV_LOGPROB
from ..schemas.errors import BadEventError, TapiocaError
from ..schemas.events import SampleEvent


def check_made_for(event: SampleEvent, *, estimator: str, norm_spec: str,
                   reward_norm_spec: str) -> None:
    """Samples normalised for another advantage config would train silently wrong (e.g.
    gae samples carry advantage 0, left to the trainer's GAE; a group-level processor
    with a batch-level trainer normalises twice)."""
    if event.estimator != estimator:
        raise BadEventError(
            f"group {event.group_id} was made by an advantage processor with "
            f"advantage.estimator {event.estimator}, but this trainer's estimator is "
            f"{estimator}: the advantages mean something else here. Give the advantage "
            "processor and the trainer the same advantage section and restart them")
    if event.adv_norm and event.adv_norm != norm_spec:
        raise BadEventError(
            f"group {event.group_id} was normalised as '{event.adv_norm}' by the advantage "
            f"processor, but this trainer's advantage config gives '{norm_spec}' "
            "(advantage.adv_norm, or the estimator preset with advantage.eps / "
            "std_unbiased). Give both roles the same advantage section and restart them")
    if event.reward_norm and event.reward_norm != reward_norm_spec:
        raise BadEventError(
            f"group {event.group_id} had its rewards normalised as '{event.reward_norm}' "
            "by the advantage processor, but this trainer's advantage.reward_norm gives "
            f"'{reward_norm_spec}': its advantages (and GAE rewards) are on another "
            "scale. Give both roles the same advantage.reward_norm and restart them")


def check_trainable(event: SampleEvent, *, vocab_size: int, max_positions: int | None,
                    version: int, recorded_versions: bool = False) -> int:
    """Refuse a sample no training step could use safely; returns its staleness,
    ``version - min(output_versions)``, from its tokens (not from the field it declares,
    which must agree).

    ``recorded_versions``: the sample's versions were counted by another trainer (offline
    training from a log, trainers/offline.py), so a version ahead of ``version`` is the
    normal case, not a forged weights event; only their sign is checked then."""
    gid = event.group_id
    if not event.sequences or not any(s.output_ids for s in event.sequences):
        raise BadEventError(f"group {gid} has no output tokens to train; the advantage "
                            "processor emits such a group with dropped_reason set")
    _check_ids(gid, "prompt_ids", event.prompt_ids, vocab_size)
    v_min, v_max = None, None
    for s in event.sequences:
        where = f"sequence {s.traj_id}"
        _check_ids(gid, f"{where} output_ids", s.output_ids, vocab_size)
        if max_positions is not None and len(event.prompt_ids) + len(s.output_ids) > max_positions:
            raise BadEventError(
                f"group {gid}: {where} has {len(event.prompt_ids)} prompt + "
                f"{len(s.output_ids)} output tokens, over the model's max_position_embeddings "
                f"{max_positions}")
        if s.output_versions:
            lo, hi = min(s.output_versions), max(s.output_versions)
            v_min = lo if v_min is None else min(v_min, lo)
            v_max = hi if v_max is None else max(v_max, hi)
        if s.behav_logprobs and not (MIN_BEHAV_LOGPROB <= min(s.behav_logprobs)
                                     and max(s.behav_logprobs) <= MAX_BEHAV_LOGPROB):
            raise BadEventError(
                f"group {gid}: {where} has behaviour logprobs in [{min(s.behav_logprobs):g}, "
                f"{max(s.behav_logprobs):g}]; a sampled token's logprob lies in "
                f"[{MIN_BEHAV_LOGPROB:g}, 0] (the engine that made it is broken)")
        for name in ("reward", "advantage", "norm_reward"):
            value = getattr(s, name)
            if value is not None and abs(value) > MAX_ABS_REWARD:
                raise BadEventError(
                    f"group {gid}: {where} has {name} {value:g}, beyond +-{MAX_ABS_REWARD:g}; "
                    "scale the reward in the reward function")
        if any(not 0 <= b <= len(s.output_ids) for b in s.turn_boundaries):
            raise BadEventError(f"group {gid}: {where} has turn_boundaries outside its "
                                f"{len(s.output_ids)} output tokens")
    if v_min is None:
        v_min = v_max = 0
    if v_min != event.min_version:
        raise BadEventError(
            f"group {gid} declares min_version {event.min_version} but its tokens' oldest "
            f"version is {v_min}")
    if v_min < 0 or (v_min > version and not recorded_versions):
        raise BadEventError(
            f"group {gid} was made by policy versions {v_min}..{v_max}, but the trainer is at "
            f"version {version}: its staleness would be {version - v_min}. Versions come only "
            "from this trainer's weights events; was a foreign or forged weights event loaded?")
    return version - v_min


def _check_ids(gid: str, what: str, ids: list[int], vocab_size: int) -> None:
    if ids and not (0 <= min(ids) and max(ids) < vocab_size):
        raise BadEventError(
            f"group {gid}: {what} has token ids in [{min(ids)}, {max(ids)}], outside the "
            f"model's vocabulary [0, {vocab_size}); the tokenizer or model of its producer "
            "does not match the trainer's")


def check_routes(event: SampleEvent, *, moe_shape: tuple[int, int, int], missing: str,
                 store=None) -> int:
    """Routing replay R3: the rollout's routes of every sequence must fit the model
    (``moe_shape``: MoE layers, top_k, experts per layer) and cover its tokens. A
    sequence without routes (none recorded, or a blob the store does not hold) is
    refused with ``missing`` ``reject``, else routed live by the trainer: the count of
    those is returned. A blob's bytes are read here and put on the event, so the step
    reads no file. Raises BadEventError for routes that are wrong."""
    from ..schemas.errors import SchemaError
    from ..schemas.routes import decode_routes, inline

    gid = event.group_id
    n_layers, top_k, n_experts = moe_shape
    n_missing = 0
    for s in event.sequences:
        where = f"group {gid}: sequence {s.traj_id}"
        r = s.routed_experts
        gone = r is not None and r.blob_sha256 and (store is None or not store.has(r.blob_sha256))
        if r is None or gone:
            if missing == "reject":
                why = (f"its routes are in blob {r.blob_sha256}, which the run's blob store does not "
                       "hold" if gone else "it carries no routed experts")
                raise BadEventError(
                    f"{where}: actor.moe.router_replay is R3 but {why}; record them (the paged engine, or "
                    "a vLLM / SGLang server with --enable-return-routed-experts, and "
                    "rollout.return_routed_experts), or set actor.moe.router_replay_missing=live to "
                    "route such sequences with the trainer's router")
            n_missing += 1
            s.routed_experts = None
            continue
        want = len(event.prompt_ids) + len(s.output_ids) - 1
        if r.num_tokens != want:
            raise BadEventError(f"{where}: its routed experts cover {r.num_tokens} tokens; its "
                                f"{len(event.prompt_ids)} prompt + {len(s.output_ids)} output tokens "
                                f"need {want} (all but the last); the engine that recorded them is broken")
        if (r.num_layers, r.top_k) != (n_layers, top_k):
            raise BadEventError(
                f"{where}: its routed experts are for {r.num_layers} MoE layers x top-{r.top_k}, the "
                f"trainer's model has {n_layers} x top-{top_k}: they were recorded with another model")
        try:
            ids = decode_routes(r, store)
            s.routed_experts = inline(r, store)
        except (SchemaError, TapiocaError) as exc:
            raise BadEventError(f"{where}: its routed experts cannot be read: {exc}") from exc
        if ids.size and int(ids.max()) >= n_experts:
            raise BadEventError(
                f"{where}: its routed experts name expert {int(ids.max())}, but the trainer's model "
                f"has {n_experts} experts per layer: they were recorded with another model")
    return n_missing
