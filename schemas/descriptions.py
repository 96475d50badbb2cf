"""Field descriptions of the exported JSON Schemas (``schemas/json/``), by event type.

An event's table goes into its schema's ``properties.<field>.description`` when
:mod:`tapioca.schemas.jsonschema` exports it. The events a service outside Tapioca
reads or writes (trajectory in, reward out) are described; another event adopts the
scheme by adding its own table to :data:`FIELD_DESCRIPTIONS` (and re-exporting with
``tapioca schemas export``). tests/unit/test_schemas.py checks that a described event
describes every one of its fields and no field it does not have, so a table cannot
drift from its class. The tables live here rather than on the classes so that adding
fields to an event and describing another event never touch the same lines.

Descriptions say what a writer must put there and what a reader may rely on, including
what Tapioca does with a missing value (so "optional" in the schema is never a silent
drop).
"""

from __future__ import annotations

# The envelope (schemas/envelope.py), shared by every described event.
ENVELOPE: dict[str, str] = {
    "event_id": "Unique id of this fact (a UUID hex in Tapioca). Readers de-duplicate by it "
                "(and by the payload's own ids), so a republished event must keep its id.",
    "type": "Wire name of the event class; selects the schema.",
    "schema_version": "Version of this event's schema the writer used. Readers accept "
                      "1..maximum and dead-letter anything newer.",
    "run_id": "The run (`experiment_name.trial_name`) this event belongs to; copy it from "
              "the event this one answers. Readers of a run skip events with another "
              "run's id. `default` (or no run_id) names no run: in a run with an id the "
              "advantage processor dead-letters such a trajectory or reward "
              "(UnattributedEventError) and other readers skip it.",
    "produced_at": "Wall-clock time the event was produced, seconds since the Unix epoch.",
    "producer_id": "Who produced it (role member or service instance), for auditing.",
}

TRAJECTORY: dict[str, str] = {
    "traj_id": "Unique id of this completion (Tapioca's: `<group_id>:<sample_index>`). "
               "Rewards name it; every sink de-duplicates by it.",
    "group_id": "The group (one prompt x its group_size completions) this completion "
                "belongs to; the Kafka key of trajectories, rewards and samples.",
    "prompt_id": "Id of the prompt (dataset item) this completion answers.",
    "sample_index": "Index of this completion in its group, 0..group_size-1.",
    "group_size": "Number of trajectories in the group; the advantage processor completes "
                  "a group when it has this many (and their rewards).",
    "prompt_ids": "Token ids of the prompt, chat template applied.",
    "output_ids": "Token ids after the prompt: the model's output and, in multi-turn "
                  "episodes, the tool and user tokens between turns (loss_mask 0).",
    "output_logprobs": "Behaviour log-probability of each output token under the policy "
                       "that sampled it (softmax(logits / temperature) over the full "
                       "vocabulary); 0 for tokens the model did not generate. Same "
                       "length as output_ids.",
    "output_versions": "Policy version that generated each output token (a sequence may "
                       "span versions); staleness is measured from the smallest. Same "
                       "length as output_ids.",
    "loss_mask": "1 for tokens to train on (the model's), 0 for the rest (tool and user "
                 "tokens). Empty means all ones; otherwise the length of output_ids.",
    "turn_boundaries": "Offsets into output_ids where turns start (multi-turn); empty for "
                       "one turn.",
    "finish_reason": "Why generation stopped: `stop` (end of sequence or a stop string), "
                     "`length` (token limit), `abort`, `tool_calls`.",
    "output_text": "The output decoded to text, for reading and for text-based scorers; "
                   "may be empty (score output_ids then).",
    "task": "Name of the task the prompt came from (e.g. `synthetic`, `gsm8k`); the "
            "built-in scorer with reward.scorer=auto picks its reward function by it.",
    "task_data": "What a reward needs, free-form JSON from the dataset (e.g. "
                 "`{\"answer\": \"42\"}`).",
    "group_index": "The prompt feeder's sequence number of the group (its head gate's "
                   "count); 0 when not from the feeder.",
    "timings": "Wall-clock facts of the rollout in seconds (queued_s, generate_s, ...), for "
               "auditing.",
    "images": "The images of prompt_ids + output_ids in the order of their placeholder "
              "tokens (empty for text). Each is {sha256, mime, width, height, data_b64}: "
              "sha256 (hex) of the image's encoded bytes, which the run's image store "
              "holds under that name (a directory `<sha256[:2]>/<sha256>`, or the object "
              "store of vlm.image_store); data_b64 carries the same bytes in base64 when "
              "they are at most vlm.inline_image_max_bytes (default 4096), else is empty. "
              "A reader checks the SHA-256 of the bytes it got (docs/reward-services.md).",
    "session_id": "The agent proxy's session this completion came from (empty otherwise). "
                  "A service rewarding sessions (online mode) finds a session's "
                  "trajectories by it.",
    "delayed_reward_factor": "What a reward given to the whole session after it ended is "
                             "multiplied by for this trajectory (AReaL's turn discount, "
                             "discount ** completions after it; 1 without one).",
    "routed_experts": "MoE models: the experts the engine routed each token to in each MoE "
                      "layer (rollout routing replay): num_tokens = len(prompt_ids) + "
                      "len(output_ids) - 1 (every token but the last sampled one), num_layers "
                      "(MoE layers), top_k, dtype (uint8 up to 256 experts, else uint16), and "
                      "the ids as one little-endian token-major array [num_tokens, num_layers, "
                      "top_k]: base64 in data_b64, or named by its SHA-256 in blob_sha256 (the "
                      "run's blob store, <run dir>/blobs). null: not recorded; a trainer with "
                      "actor.moe.router_replay R3 then routes the sequence live or rejects it "
                      "(actor.moe.router_replay_missing).",
    "sampling_seed": "The sampling seed of the one generation request that produced "
                     "output_ids (0 <= seed < 2**63): the paged engine keys every draw by "
                     "(seed, position of the token sampled), so `tapioca regenerate` can "
                     "replay the trajectory from its prompt, this seed and the logged "
                     "versions' weights (docs/provenance.md). null: not recorded (an engine "
                     "without per-request seeds, a proxy trajectory of several requests, an "
                     "event written before the field).",
}

REWARD: dict[str, str] = {
    "run_id": "Copy the trajectory's run_id. A run with its own run_id dead-letters a "
              "reward stamped `default` or without run_id (so a service that forgets it "
              "sees its rewards on dlq.v1), and skips a reward with another run's id.",
    "traj_id": "The scored trajectory's traj_id.",
    "group_id": "The scored trajectory's group_id; also the Kafka key (murmur2 "
                "partitioner), so the reward lands on its trajectories' partition number.",
    "reward": "The reward, a finite number (NaN and infinities are dead-lettered).",
    "scorer": "Name of the scorer, the key of advantage.reward_weights. Without weights "
              "the first reward per trajectory from any scorer is used; with weights, "
              "rewards from scorers not listed (`default` when absent) are ignored and "
              "counted (advantage/ignored_rewards).",
    "details": "Anything JSON about how the reward was computed, for auditing.",
}

# Fields kept only for readers of older schemas: exported with ``"deprecated": true``
# and this description, whether or not the event has a FIELD_DESCRIPTIONS table.
_ON_PROGRESS = ("Deprecated: on progress.v1 now (the progress event's field of this name); "
                "no longer written (left at its default), still decoded so that an archive "
                "written before is read as it was.")

DEPRECATED_FIELDS: dict[str, dict[str, str]] = {
    "weights": {
        "step": "Deprecated: always equal to version; read version. Still written (filled "
                "in from version when a writer leaves it out or sends 0) for readers of "
                "older schemas.",
        **{name: _ON_PROGRESS for name in ("group_ids", "groups_rejected", "rejected_group_ids",
                                           "rollbacks", "base_steps", "base_rejected")},
    },
    "prompt": {
        "weights_offset": "Deprecated: the weights.v1 offset a feeder before progress.v1 had "
                          "counted rejections through; read progress_offset. No longer "
                          "written (-1).",
    },
}

# The trainer's verdicts on the groups it read: what a dashboard or an outside admission
# controller reads (producers/feeder.py is Tapioca's).
PROGRESS: dict[str, str] = {
    "version": "The trainer's policy version (optimizer steps and rollbacks so far); only "
               "goes forward within a run.",
    "group_ids": "The groups trained to make this version; every progress event of the "
                 "version names them again (empty for a rollback's version).",
    "groups_rejected": "Groups the trainer has rejected so far in this run (over-stale, "
                       "filtered, dead-lettered). A total for display: the feeder frees "
                       "head-gate slots by the names in rejected_group_ids.",
    "rejected_group_ids": "The groups rejected since the trainer's previous progress event; "
                          "a restarted trainer names its last ones again, so readers "
                          "de-duplicate by id.",
    "rollbacks": "Versions so far, this one included, that were rollbacks rather than "
                 "training steps: the head gate counts version - rollbacks trained steps.",
    "base_steps": "Trained steps of this run made before this run id's log began (a run "
                  "resumed on a broker that lost its log): not counted by the head gate.",
    "base_rejected": "Rejected groups of this run from before this run id's log began: not "
                     "counted by the head gate.",
}

FIELD_DESCRIPTIONS: dict[str, dict[str, str]] = {
    "trajectory": {**ENVELOPE, **TRAJECTORY},
    "reward": {**ENVELOPE, **REWARD},
    "progress": {**ENVELOPE, **PROGRESS},
}


def field_descriptions(type_name: str) -> dict[str, str]:
    """Descriptions of an event type's fields by name; empty for an undescribed type."""
    return {**FIELD_DESCRIPTIONS.get(type_name, {}), **DEPRECATED_FIELDS.get(type_name, {})}


def deprecated_fields(type_name: str) -> set[str]:
    return set(DEPRECATED_FIELDS.get(type_name, {}))
