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
DEPRECATED_FIELDS: dict[str, dict[str, str]] = {
    "weights": {
        "step": "Deprecated: always equal to version; read version. Still written (filled "
                "in from version when a writer leaves it out or sends 0) for readers of "
                "older schemas.",
    },
}

FIELD_DESCRIPTIONS: dict[str, dict[str, str]] = {
    "trajectory": {**ENVELOPE, **TRAJECTORY},
    "reward": {**ENVELOPE, **REWARD},
}


def field_descriptions(type_name: str) -> dict[str, str]:
    """Descriptions of an event type's fields by name; empty for an undescribed type."""
    return {**FIELD_DESCRIPTIONS.get(type_name, {}), **DEPRECATED_FIELDS.get(type_name, {})}


def deprecated_fields(type_name: str) -> set[str]:
    return set(DEPRECATED_FIELDS.get(type_name, {}))
