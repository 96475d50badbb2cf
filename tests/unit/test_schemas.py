"""Events, their validation, the topic registry and the JSON Schema export (no broker)."""

from __future__ import annotations

import copy
import dataclasses
import json

import jsonschema
import orjson
import pytest

from tapioca.schemas import (
    TOPICS,
    ControlAckEvent,
    ControlEvent,
    DlqRecord,
    EventTooLargeError,
    FleetEvent,
    MetricsEvent,
    ProgressEvent,
    PromptEvent,
    RewardEvent,
    SampleEvent,
    SampleSequence,
    SchemaError,
    TrajectoryEvent,
    UnknownEventTypeError,
    UnsupportedSchemaVersionError,
    WeightsEvent,
    decode_event,
    encode_event,
    event_types,
    topic,
    topic_for,
)
from tapioca.schemas.descriptions import FIELD_DESCRIPTIONS
from tapioca.schemas.jsonschema import (
    JSON_DIR,
    all_schemas,
    compatibility_problems,
    load_exported,
)

# ---------------------------------------------------------------------------
# One valid instance of every event type, with non-default values in most fields.


def _sequence(**kw) -> SampleSequence:
    base = dict(traj_id="t0", output_ids=[5, 6, 7], behav_logprobs=[-0.5, -1.25, 0.0],
                output_versions=[3, 3, 4], reward=1.0, advantage=-0.5, loss_mask=[1, 1, 0],
                finish_reason="length")
    base.update(kw)
    return SampleSequence(**base)


def _trajectory(**kw) -> TrajectoryEvent:
    base = dict(traj_id="t0", group_id="g0", prompt_id="p0", sample_index=1, group_size=4,
                prompt_ids=[1, 2, 3], output_ids=[5, 6, 7], output_logprobs=[-0.5, -1.25, 0.0],
                output_versions=[3, 3, 4], loss_mask=[1, 1, 0], turn_boundaries=[0, 2],
                finish_reason="length", output_text="hi", task="gsm8k",
                task_data={"answer": "42", "nested": [1, {"x": 2.5}]}, group_index=7,
                timings={"generate_s": 0.25}, run_id="run-a", producer_id="w1")
    base.update(kw)
    return TrajectoryEvent(**base)


def _sample(**kw) -> SampleEvent:
    base = dict(group_id="g0", prompt_id="p0", prompt_ids=[1, 2],
                sequences=[_sequence(), _sequence(traj_id="t1", loss_mask=[])],
                group_index=7, min_version=3, max_version=4, estimator="rloo", task="gsm8k")
    base.update(kw)
    return SampleEvent(**base)


FACTORIES = {
    "prompt": lambda: PromptEvent(
        group_id="g0", prompt_id="p0", group_index=7, n_samples=4, prompt_ids=[1, 2, 3],
        prompt_text="2+2?", epoch=1, dataset_position=9, task="gsm8k",
        task_data={"answer": "4"}, sampling={"temperature": 0.7}, admitted_at_version=2),
    "trajectory": _trajectory,
    "reward": lambda: RewardEvent(traj_id="t0", group_id="g0", reward=0.75, scorer="exact",
                                  details={"parsed": "4"}),
    "sample": _sample,
    "weights": lambda: WeightsEvent(version=5, path="/ckpt/v5.safetensors", sha256="ab" * 32,
                                    num_bytes=1234, step=10, rollback_of=4, run_id="run-a"),
    "progress": lambda: ProgressEvent(version=5, group_ids=["g0", "g1"], groups_rejected=2,
                                      rejected_group_ids=["g9"], rollbacks=1, base_steps=3,
                                      base_rejected=1, run_id="run-a"),
    "control": lambda: ControlEvent(command_id="c1", command="pause", target="rollout",
                                    args={"drain": True}),
    "control_ack": lambda: ControlAckEvent(command_id="c1", target="rollout", member_id="m1",
                                           ok=False, message="busy"),
    "fleet": lambda: FleetEvent(member_id="m1", role="rollout", status="paused", host="h",
                                pid=42, policy_version=3, rates={"tok_per_s": 10.5},
                                lag={"prompts": 3}, detail={"gpu": "h200"}),
    "metrics": lambda: MetricsEvent(source="trainer", step=3, metrics={"loss": 0.5, "n": 2},
                                    policy_version=3),
    "dlq": lambda: DlqRecord(source_topic="tapioca.prompts.v1", source_partition=2,
                             source_offset=17, error="bad", error_type="SchemaError",
                             consumer_group="g", source_key="g0", payload_b64="AAE=",
                             payload_truncated=True, attempts=3),
}


def valid_event(type_name: str):
    return FACTORIES[type_name]()


def test_factories_cover_every_event_type():
    assert set(FACTORIES) == set(event_types()), "add a factory for every new event type"


@pytest.mark.parametrize("type_name", sorted(FACTORIES))
def test_round_trip_every_event_type(type_name):
    event = valid_event(type_name)
    raw = encode_event(event)
    back = decode_event(raw, allowed_types=topic_for(event).value_types)
    assert type(back) is type(event)
    assert back == event
    assert back.type == type_name
    assert back.schema_version == type(event).SCHEMA_VERSION
    # All fields sit at the top level of one JSON object.
    data = orjson.loads(raw)
    assert data["type"] == type_name
    assert set(data) == {f.name for f in dataclasses.fields(event)}


def test_nested_sequences_decode_as_dataclasses():
    back = decode_event(encode_event(_sample()))
    assert all(isinstance(s, SampleSequence) for s in back.sequences)
    assert back.sequences[1].traj_id == "t1"


# ---------------------------------------------------------------------------
# Validation.


def _raw(type_name: str, **changes) -> bytes:
    data = orjson.loads(encode_event(valid_event(type_name)))
    for k, v in changes.items():
        if v is _DELETE:
            del data[k]
        else:
            data[k] = v
    return orjson.dumps(data)


_DELETE = object()


def test_wrong_type_str_where_int():
    with pytest.raises(SchemaError, match="n_samples"):
        encode_event(dataclasses.replace(valid_event("prompt"), n_samples="4"))
    with pytest.raises(SchemaError, match="n_samples"):
        decode_event(_raw("prompt", n_samples="4"))


def test_bool_where_int_is_rejected():
    with pytest.raises(SchemaError, match="group_index"):
        encode_event(dataclasses.replace(valid_event("prompt"), group_index=True))
    with pytest.raises(SchemaError, match="group_index"):
        decode_event(_raw("prompt", group_index=True))
    with pytest.raises(SchemaError, match=r"prompt_ids\[1\]"):
        decode_event(_raw("prompt", prompt_ids=[1, False]))


def test_float_where_int_is_rejected():
    with pytest.raises(SchemaError, match="sample_index"):
        decode_event(_raw("trajectory", sample_index=1.0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_float_field_rejected_on_encode(bad):
    with pytest.raises(SchemaError, match="reward"):
        encode_event(RewardEvent(traj_id="t", group_id="g", reward=bad))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_in_float_list_rejected_on_encode(bad):
    with pytest.raises(SchemaError, match=r"output_logprobs\[1\]"):
        encode_event(_trajectory(output_logprobs=[-0.5, bad, 0.0]))
    seq = _sequence(behav_logprobs=[-0.5, bad, 0.0])
    with pytest.raises(SchemaError, match=r"behav_logprobs\[1\]"):
        encode_event(_sample(sequences=[seq]))


def test_non_finite_in_float_dict_and_free_form_fields_rejected_on_encode():
    with pytest.raises(SchemaError, match="metrics"):
        encode_event(MetricsEvent(source="s", step=1, metrics={"loss": float("nan")}))
    # orjson would silently write a nested NaN as null; validation must catch it first.
    with pytest.raises(SchemaError, match="task_data"):
        encode_event(_trajectory(task_data={"scores": [1.0, float("nan")]}))
    with pytest.raises(SchemaError, match="details"):
        encode_event(RewardEvent(traj_id="t", group_id="g", reward=1.0,
                                 details={"a": {"b": float("inf")}}))


def test_orjson_writes_nan_as_null_which_decode_rejects():
    # Why encode-side rejection matters: this is what a NaN would become on the wire.
    assert orjson.dumps({"reward": float("nan")}) == b'{"reward":null}'
    with pytest.raises(SchemaError, match="reward"):
        decode_event(_raw("reward", reward=None))
    with pytest.raises(SchemaError, match=r"output_logprobs\[1\]"):
        decode_event(_raw("trajectory", output_logprobs=[-0.5, None, 0.0]))


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_hand_written_non_finite_json_rejected_on_decode(literal):
    good = _raw("reward")
    data = orjson.loads(good)
    bad = good.replace(b'"reward":' + orjson.dumps(data["reward"]), b'"reward":' + literal)
    assert bad != good
    with pytest.raises(SchemaError):
        decode_event(bad)
    in_list = _raw("trajectory").replace(b'"output_logprobs":[-0.5,',
                                         b'"output_logprobs":[' + literal + b",")
    assert b"[" + literal in in_list
    with pytest.raises(SchemaError):
        decode_event(in_list)


def test_unequal_lengths_in_trajectory():
    with pytest.raises(SchemaError, match="equal lengths"):
        encode_event(_trajectory(output_logprobs=[-0.5, -1.0]))
    with pytest.raises(SchemaError, match="equal lengths"):
        encode_event(_trajectory(output_versions=[1, 1, 1, 1]))
    with pytest.raises(SchemaError, match="equal lengths"):
        encode_event(_trajectory(loss_mask=[1]))
    with pytest.raises(SchemaError, match="equal lengths"):
        decode_event(_raw("trajectory", output_ids=[5, 6]))
    # An empty loss_mask means "all ones" and is exempt.
    encode_event(_trajectory(loss_mask=[]))


def test_unequal_lengths_in_sample_sequence():
    bad = _sequence(output_versions=[3, 3])
    with pytest.raises(SchemaError, match="equal lengths"):
        encode_event(_sample(sequences=[_sequence(), bad]))
    data = orjson.loads(encode_event(_sample()))
    data["sequences"][1]["behav_logprobs"] = [-0.5]
    with pytest.raises(SchemaError, match="equal lengths"):
        decode_event(orjson.dumps(data))


def test_missing_required_field():
    with pytest.raises(SchemaError, match="traj_id"):
        decode_event(_raw("trajectory", traj_id=_DELETE))
    data = orjson.loads(encode_event(_sample()))
    del data["sequences"][0]["advantage"]
    with pytest.raises(SchemaError, match="advantage"):
        decode_event(orjson.dumps(data))


def test_missing_event_id_is_an_error_not_a_fresh_id():
    # A fresh id per decode would defeat de-duplication by event_id.
    with pytest.raises(SchemaError, match="event_id"):
        decode_event(_raw("reward", event_id=_DELETE))
    with pytest.raises(SchemaError, match="event_id"):
        decode_event(_raw("reward", event_id=""))


def test_missing_optional_field_takes_default():
    back = decode_event(_raw("trajectory", loss_mask=_DELETE, finish_reason=_DELETE))
    assert back.loss_mask == [] and back.finish_reason == "stop"


def test_literal_field_rejects_unknown_value():
    with pytest.raises(SchemaError, match="finish_reason"):
        decode_event(_raw("trajectory", finish_reason="exploded"))


@pytest.mark.parametrize("type_value", ["nope", None, 3, _DELETE])
def test_unknown_type(type_value):
    with pytest.raises(UnknownEventTypeError):
        decode_event(_raw("reward", type=type_value))


@pytest.mark.parametrize("version", [0, 99, "1", 1.0, True, None, _DELETE])
def test_unsupported_schema_version(version):
    with pytest.raises(UnsupportedSchemaVersionError, match="schema_version"):
        decode_event(_raw("reward", schema_version=version))


def test_supported_schema_version_decodes():
    assert decode_event(_raw("reward", schema_version=1)).schema_version == 1


def test_oversized_event_on_encode_and_decode():
    big = _trajectory(output_text="x" * 5000)
    with pytest.raises(EventTooLargeError, match="over the limit"):
        encode_event(big, max_bytes=2048)
    raw = encode_event(big)
    assert len(raw) > 2048
    with pytest.raises(EventTooLargeError, match="over the limit"):
        decode_event(raw, max_bytes=2048)
    assert decode_event(raw, max_bytes=len(raw)) == big


def test_unencodable_value_is_a_schema_error():
    with pytest.raises(SchemaError, match="64-bit"):
        encode_event(dataclasses.replace(valid_event("prompt"), group_index=2**70))
    with pytest.raises(SchemaError):
        encode_event(dataclasses.replace(valid_event("prompt"), task_data={"s": {1, 2}}))


@pytest.mark.parametrize("raw", [b"", b"\xff\x00garbage", b"{", b'{"type": "reward",}'])
def test_not_json(raw):
    with pytest.raises(SchemaError, match="not valid JSON"):
        decode_event(raw)


def test_tombstone_is_an_error():
    with pytest.raises(SchemaError, match="tombstone"):
        decode_event(None)


@pytest.mark.parametrize("raw", [b"[]", b'[{"type": "reward"}]', b'"reward"', b"3", b"null"])
def test_json_that_is_not_an_object(raw):
    with pytest.raises(SchemaError, match="JSON object"):
        decode_event(raw)


def test_event_of_the_wrong_type_for_a_topic():
    raw = encode_event(valid_event("reward"))
    with pytest.raises(SchemaError, match="does not belong on this topic"):
        decode_event(raw, allowed_types=topic("trajectories").value_types)
    # ...and the right topic accepts it.
    decode_event(raw, allowed_types=topic("rewards").value_types)
    control = topic("control").value_types
    decode_event(encode_event(valid_event("control_ack")), allowed_types=control)


def test_unknown_extra_fields_are_ignored():
    event = valid_event("reward")
    data = orjson.loads(encode_event(event))
    data.update(added_by_newer_producer={"x": [1, 2]}, another=None)
    assert decode_event(orjson.dumps(data)) == event
    sample = _sample()
    data = orjson.loads(encode_event(sample))
    data["sequences"][0]["future_field"] = 1
    assert decode_event(orjson.dumps(data)) == sample


def test_only_typed_events_encode():
    with pytest.raises(SchemaError):
        encode_event(_sequence())


# ---------------------------------------------------------------------------
# The topic registry.


def test_every_event_type_maps_to_exactly_one_topic():
    for name, cls in event_types().items():
        carriers = [t for t in TOPICS if cls in t.value_types]
        assert len(carriers) == 1, f"{name} is carried by {[t.name for t in carriers]}"
        assert topic_for(cls) is carriers[0]
        assert topic_for(valid_event(name)) is carriers[0]


def test_every_topic_key_field_is_a_field_of_its_value_types():
    assert len({t.name for t in TOPICS}) == len(TOPICS)
    for spec in TOPICS:
        assert spec.value_types
        for cls in spec.value_types:
            assert spec.key_field in {f.name for f in dataclasses.fields(cls)}, (spec.name, cls)


def test_key_of_reads_the_key_field():
    event = valid_event("trajectory")
    assert topic_for(event).key_of(event) == "g0"
    assert topic("weights").key_of(valid_event("weights")) == "run-a"


def test_topic_lookup_by_base_and_full_name():
    assert topic("tapioca.prompts.v1") is topic("prompts")
    assert topic("prompts").full_name() == "tapioca.prompts.v1"
    assert topic("prompts").full_name("t123") == "t123.prompts.v1"
    assert topic("my.team.rewards.v1") is topic("rewards")


@pytest.mark.parametrize("name", ["nope", "tapioca.nope.v1", ""])
def test_unknown_topic_errors(name):
    with pytest.raises(SchemaError, match="unknown topic"):
        topic(name)


def test_topic_for_unregistered_class_errors():
    with pytest.raises(SchemaError):
        topic_for(SampleSequence)


# ---------------------------------------------------------------------------
# JSON Schema export and the compatibility check.


def test_exported_json_schemas_are_up_to_date():
    current = json.loads(json.dumps(all_schemas()))
    committed = load_exported()
    assert set(committed) == set(current), "run `tapioca schemas export` (files missing/extra)"
    for name in current:
        assert committed[name] == current[name], (
            f"schemas/json/{name}.schema.json is stale: run `tapioca schemas export`")


def test_current_schemas_are_compatible_with_committed():
    current = json.loads(json.dumps(all_schemas()))
    for name, old in load_exported().items():
        assert compatibility_problems(old, current[name]) == [], name


def _committed(name: str) -> dict:
    return json.loads((JSON_DIR / f"{name}.schema.json").read_text())


def test_checker_catches_removed_field():
    old = _committed("trajectory")
    new = copy.deepcopy(old)
    del new["properties"]["traj_id"]
    new["required"].remove("traj_id")
    assert any("traj_id" in p and "removed" in p for p in compatibility_problems(old, new))


def test_checker_catches_changed_type():
    old = _committed("reward")
    new = copy.deepcopy(old)
    new["properties"]["reward"] = {"type": "string"}
    assert any(p.startswith("reward:") and "type" in p for p in compatibility_problems(old, new))
    # ...also inside arrays and inside a nested definition reached by $ref.
    old = _committed("sample")
    new = copy.deepcopy(old)
    new["$defs"]["SampleSequence"]["properties"]["output_ids"]["items"] = {"type": "number"}
    problems = compatibility_problems(old, new)
    assert any("sequences[].output_ids[]" in p for p in problems), problems


def test_checker_catches_new_required_field():
    old = _committed("prompt")
    new = copy.deepcopy(old)
    new["properties"]["priority"] = {"type": "integer"}
    new["required"].append("priority")
    assert any("priority" in p and "required" in p for p in compatibility_problems(old, new))


def test_checker_catches_removed_enum_value():
    old = _committed("trajectory")
    new = copy.deepcopy(old)
    new["properties"]["finish_reason"]["enum"].remove("abort")
    problems = compatibility_problems(old, new)
    assert any("finish_reason" in p and "abort" in p for p in problems), problems


def test_checker_accepts_new_field_with_default():
    old = _committed("prompt")
    new = copy.deepcopy(old)
    new["properties"]["priority"] = {"type": "integer"}  # not required: it has a default
    new["properties"]["finish_reason_hint"] = {"enum": ["a", "b"]}
    assert compatibility_problems(old, new) == []
    # Adding an enum value is compatible too.
    old = _committed("trajectory")
    new = copy.deepcopy(old)
    new["properties"]["finish_reason"]["enum"].append("cancelled")
    assert compatibility_problems(old, new) == []


@pytest.mark.parametrize("type_name", sorted(FACTORIES))
def test_encoded_event_validates_against_exported_schema(type_name):
    schema = load_exported()[type_name]
    validator = jsonschema.Draft202012Validator(schema)
    validator.check_schema(schema)
    data = orjson.loads(encode_event(valid_event(type_name)))
    validator.validate(data)
    # The schema has teeth: a wrong type and a wrong version are rejected.
    assert not validator.is_valid(dict(data, run_id=7))
    assert not validator.is_valid(dict(data, schema_version=99))
    assert not validator.is_valid({k: v for k, v in data.items() if k != "event_id"})


def test_described_events_describe_every_field_and_only_their_fields():
    assert {"reward", "trajectory"} <= set(FIELD_DESCRIPTIONS)
    for name, table in FIELD_DESCRIPTIONS.items():
        fields = {f.name for f in dataclasses.fields(event_types()[name])}
        assert set(table) == fields, (name, set(table) ^ fields)
        assert all(text.strip() for text in table.values()), name


def test_exported_reward_and_trajectory_schemas_carry_the_descriptions():
    for name in ("reward", "trajectory"):
        props = load_exported()[name]["properties"]
        assert {k: p.get("description") for k, p in props.items()} == FIELD_DESCRIPTIONS[name]
    # The run_id rule an outside writer needs is in the schema itself.
    assert "dead-letters" in load_exported()["reward"]["properties"]["run_id"]["description"]


def test_weights_step_is_deprecated_but_still_written_and_read():
    # Writers may leave it out: it is filled in from version, for readers of old schemas.
    new = WeightsEvent(version=7, path="/w/v7", sha256="00" * 32)
    assert new.step == 7 and orjson.loads(encode_event(new))["step"] == 7
    # A value on the wire is read as it is (an older writer's), and 0 reads as version.
    raw = orjson.loads(encode_event(new))
    assert decode_event(orjson.dumps(dict(raw, step=6))).step == 6
    assert decode_event(orjson.dumps(dict(raw, step=0))).step == 7
    assert decode_event(orjson.dumps({k: v for k, v in raw.items() if k != "step"})).step == 7
    prop = load_exported()["weights"]["properties"]["step"]
    assert prop["deprecated"] is True and "read version" in prop["description"]
    assert "step" not in load_exported()["weights"]["required"]


def test_exported_schema_names_topic_and_key():
    for name, schema in load_exported().items():
        spec = topic_for(event_types()[name])
        assert schema["x-topic"] == spec.full_name()
        assert schema["x-key"] == spec.key_field


def test_progress_topic_is_ordered_signed_and_keyed_by_run():
    spec = topic_for(ProgressEvent)
    assert (spec.full_name(), spec.key_field, spec.partitions, spec.signed) == \
        ("tapioca.progress.v1", "run_id", 1, True)
    assert spec.key_of(valid_event("progress")) == "run-a"


def test_weights_verdict_fields_are_deprecated_but_still_read():
    """An event written before progress.v1 carries the trainer's verdicts on the weights
    event: they decode as they were, and the exported schema marks them deprecated."""
    old = {"type": "weights", "schema_version": 1, "event_id": "e1", "run_id": "r",
           "version": 4, "path": "/w/v4", "sha256": "ab" * 32, "group_ids": ["g6", "g7"],
           "groups_rejected": 2, "rejected_group_ids": ["g3"], "rollbacks": 1,
           "base_steps": 0, "base_rejected": 0}
    back = decode_event(orjson.dumps(old))
    assert (back.group_ids, back.groups_rejected, back.rejected_group_ids, back.rollbacks) == \
        (["g6", "g7"], 2, ["g3"], 1)
    exported = load_exported()
    for name in ("group_ids", "groups_rejected", "rejected_group_ids", "rollbacks",
                 "base_steps", "base_rejected"):
        prop = exported["weights"]["properties"][name]
        assert prop["deprecated"] is True and "progress.v1" in prop["description"], name
        assert name not in exported["weights"]["required"]
    assert exported["prompt"]["properties"]["weights_offset"]["deprecated"] is True
    prompt = decode_event(orjson.dumps({"type": "prompt", "schema_version": 1, "event_id": "p",
                                        "group_id": "g0", "prompt_id": "p0", "group_index": 0,
                                        "n_samples": 2, "prompt_ids": [1], "weights_offset": 5}))
    assert (prompt.weights_offset, prompt.progress_offset) == (5, -1)
