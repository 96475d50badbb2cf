"""Proxy sessions: discounted rewards, the concat chain, group publishing, the head
gate's counter, limits and expiry (pure bookkeeping; the HTTP side is in
tests/integration/test_proxy.py)."""

from __future__ import annotations

import pytest

from tapioca.producers.proxy.gate import HeadGate
from tapioca.producers.proxy.openai_errors import ApiError
from tapioca.producers.proxy.sessions import (
    Completion,
    SessionStore,
    build_concat,
    common_prefix_len,
    concat_chain,
    discounted_returns,
)
from tapioca.schemas.events import RewardEvent, TrajectoryEvent


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def comp(call: str, prompt, out, version=0, index=0):
    return Completion(call, index, list(prompt), list(out), [-0.5] * len(out), [version] * len(out), "stop")


def store(clock=None, **kw) -> SessionStore:
    args = dict(ttl_s=10.0, max_sessions=100, max_tokens_per_session=1000, run_tag="r",
                decode=lambda ids: ",".join(map(str, ids)))
    args.update(kw)
    return SessionStore(clock=clock or Clock(), **args)


def test_discounted_returns_follow_arealrule():
    # AReaL: reward[i] += reward[i+1] * turn_discount, unset rewards are 0.
    assert discounted_returns([None, None, 1.0], 0.9) == pytest.approx([0.81, 0.9, 1.0])
    assert discounted_returns([1.0, None, 2.0], 0.5) == pytest.approx([1.5, 1.0, 2.0])
    assert discounted_returns([0.3], 0.0) == [0.3]


def test_concat_chain_and_masks():
    a = comp("a", [1, 2], [10, 11], version=0)
    side = comp("s", [1, 2], [12], version=0)  # a sibling that was not continued
    b = comp("b", [1, 2, 10, 11, 5, 6], [13, 2], version=1)
    chain = concat_chain([a, side, b], b)
    assert chain == [a, b]
    built = build_concat(chain)
    assert built["prompt_ids"] == [1, 2]
    assert built["output_ids"] == [10, 11, 5, 6, 13, 2]
    assert built["loss_mask"] == [1, 1, 0, 0, 1, 1]
    assert built["output_logprobs"] == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert built["output_versions"] == [0, 0, 0, 0, 1, 1]  # fill: the model token before
    assert built["turn_boundaries"] == [0, 4]
    # A conversation the client re-rendered differently breaks the chain there.
    c = comp("c", [1, 2, 10, 99, 5], [7])
    assert concat_chain([a, c], c) == [c]
    assert common_prefix_len([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2


def test_group_publishes_when_every_session_is_over():
    gate = HeadGate(eta=0, prompts_per_step=4)
    gate.ready.set()
    st = store()
    s0 = st.start(group_id=None, group_size=2, sample_index=None, task="t", task_data={"answer": "1"},
                  policy_version=0, admit=gate.try_admit)
    s1 = st.start(group_id=s0.group.group_id, group_size=2, sample_index=None, task="t", task_data={},
                  policy_version=0, admit=gate.try_admit)
    assert (s0.sample_index, s1.sample_index, gate.admitted) == (0, 1, 1)
    with pytest.raises(ApiError) as err:  # the group is full
        st.start(group_id=s0.group.group_id, group_size=2, sample_index=None, task="t", task_data={},
                 policy_version=0, admit=gate.try_admit)
    assert err.value.status == 409
    # Session 0: two turns with a different first prompt suffix than session 1.
    st.record(s0, [comp("a", [1, 2, 3], [10, 2])], ["x"], ["x"], [[]])
    st.record(s0, [comp("b", [1, 2, 3, 10, 2, 7], [11, 2])], ["y"], ["y"], [[]])
    assert st.set_reward(s0, 1.0, None) == ["b:0"]
    ids, rewards, events, _, abandoned, _ = st.end(s0, "concat", 0.5)
    assert ids == [f"{s0.group.group_id}:0"] and rewards == [0.5] and events == [] and not abandoned
    st.record(s1, [comp("c", [1, 2, 4], [12, 2])], ["z"], ["z"], [[]])
    st.set_reward(s1, 0.25, "c")
    ids, rewards, events, group, abandoned, _ = st.end(s1, "per_completion", None)
    assert not abandoned
    assert rewards == [0.25]
    trajs = [e for e in events if isinstance(e, TrajectoryEvent)]
    rews = [e for e in events if isinstance(e, RewardEvent)]
    assert len(trajs) == 2 and len(rews) == 2
    # The shared prompt is the common prefix; the rest moved into the output, masked.
    assert [t.prompt_ids for t in trajs] == [[1, 2], [1, 2]]
    assert trajs[0].output_ids == [3, 10, 2, 7, 11, 2] and trajs[0].loss_mask == [0, 1, 1, 0, 1, 1]
    assert trajs[0].turn_boundaries == [1, 4]
    assert trajs[1].output_ids == [4, 12, 2] and trajs[1].loss_mask == [0, 1, 1]
    assert [t.group_size for t in trajs] == [2, 2] and [t.sample_index for t in trajs] == [0, 1]
    assert trajs[0].task_data == {"answer": "1"} and trajs[0].group_index == 0
    assert {r.scorer for r in rews} == {"session"} and [r.reward for r in rews] == [0.5, 0.25]
    for t in trajs:
        t.validate()
    with pytest.raises(ApiError) as err:  # the finished group takes no one else
        st.start(group_id=group.group_id, group_size=2, sample_index=None, task="t", task_data={},
                 policy_version=0, admit=gate.try_admit)
    assert err.value.status == 409


def test_keys_expire_and_tokens_are_limited():
    clock = Clock()
    st = store(clock, max_tokens_per_session=10)
    admit = iter(range(100)).__next__
    s = st.start(group_id=None, group_size=1, sample_index=None, task="", task_data={}, policy_version=0,
                 admit=admit)
    assert st.by_api_key(s.api_key) is s
    st.begin_call(s, 8)
    st.end_call(s, 2)  # 6 used
    with pytest.raises(ApiError) as err:
        st.begin_call(s, 5)
    assert err.value.code == "session_token_limit" and s.in_flight == 0
    with pytest.raises(ApiError) as err:
        st.by_api_key("tpk-unknown")
    assert err.value.status == 401
    clock.t = 11.0
    with pytest.raises(ApiError) as err:
        st.by_api_key(s.api_key)
    assert err.value.status == 401 and "expired" in err.value.message
    # The group of an expired session finishes empty: the gate's slot is given back.
    events, empty = st.reap()
    assert events == [] and empty == 1


def test_head_gate_counts_rejected_and_abandoned_groups():
    gate = HeadGate(eta=1, prompts_per_step=2)
    assert gate.try_admit() is None  # not ready before the latest weights are known
    gate.ready.set()
    assert [gate.try_admit() for _ in range(5)] == [0, 1, 2, 3, None]  # (1 + 0 + 1) * 2
    gate.update(version=0, rejected=1)
    assert gate.try_admit() == 4 and gate.try_admit() is None
    gate.abandon()
    assert gate.try_admit() == 5
    gate.update(version=1, rejected=1)
    assert gate.capacity() == 2
    # A rollback's version (rollbacks=1) is not a trained step: no new slots.
    gate.update(version=2, rejected=1, rollbacks=1)
    assert gate.capacity() == 2


def test_a_session_with_a_call_in_flight_is_not_expired():
    clock = Clock()
    st = store(clock)
    admit = iter(range(100)).__next__
    s = st.start(group_id=None, group_size=1, sample_index=None, task="", task_data={}, policy_version=0,
                 admit=admit)
    st.begin_call(s, 5)
    clock.t = 50.0  # generating for longer than the TTL
    assert st.reap() == ([], 0) and s.state == "open"
    assert st.by_api_key(s.api_key) is s
    st.end_call(s, 0)  # the idle time restarts when the call is over
    clock.t = 55.0
    st.record(s, [comp("a", [1], [2])], ["x"], ["x"], [[]])
    clock.t = 66.0
    events, empty = st.reap()
    assert s.state == "expired" and events == [] and empty == 1


def test_ended_sessions_refuse_late_replies_and_rewards():
    st = store()
    admit = iter(range(100)).__next__
    s = st.start(group_id=None, group_size=2, sample_index=None, task="", task_data={}, policy_version=0,
                 admit=admit)
    st.record(s, [comp("a", [1], [2])], ["x"], ["x"], [[]])
    st.begin_call(s, 5)  # a second call is generating when the harness ends the session
    st.end(s, "concat", None)
    st.end_call(s, 0)
    with pytest.raises(ApiError) as err:
        st.record(s, [comp("b", [1, 2], [3])], ["y"], ["y"], [[]])
    assert err.value.status == 409 and len(s.completions) == 1
    with pytest.raises(ApiError) as err:
        st.set_reward(s, 1.0, None)
    assert err.value.status == 409 and err.value.code == "session_closed"


def test_an_empty_group_is_abandoned_exactly_once():
    clock = Clock()
    st = store(clock)
    admit = iter(range(100)).__next__
    # Ended with no completion, alone in its group: this end() abandons it.
    s = st.start(group_id=None, group_size=1, sample_index=None, task="", task_data={}, policy_version=0,
                 admit=admit)
    assert st.end(s, None, None).abandoned
    assert st.reap() == ([], 0)
    # Two sessions, no completions: the second one expires and the reaper finishes the
    # group; an end() of the first one afterwards must not count it again.
    a = st.start(group_id=None, group_size=2, sample_index=None, task="", task_data={}, policy_version=0,
                 admit=admit)
    b = st.start(group_id=a.group.group_id, group_size=2, sample_index=None, task="", task_data={},
                 policy_version=0, admit=admit)
    first = st.end(a, None, None)
    assert not first.abandoned and first.events == []
    clock.t = 20.0
    events, empty = st.reap()
    assert b.state == "expired" and events == [] and empty == 1


def test_a_group_whose_completions_share_no_prompt_token_is_published():
    """Issue 22's bug: one session (group_size 1) makes a chat call with tools, a tool-result
    turn, then a raw /v1/completions call, and ends per_completion. The chat template's
    prompts and the raw prompt share no first token; the group was dropped with a warning
    (``published: false``) and a run waiting for it never finished. It is published with
    an empty shared prompt, each completion's context in its output with loss mask 0."""
    gate = HeadGate(eta=0, prompts_per_step=4)
    gate.ready.set()
    st = store()
    s = st.start(group_id=None, group_size=1, sample_index=None, task="t", task_data={},
                 policy_version=0, admit=gate.try_admit)
    chat1 = comp("c1", [1, 2, 3], [10, 11])  # <|im_start|>... with the tools block
    chat2 = comp("c2", [1, 2, 3, 10, 11, 4, 5], [12])  # + the tool result turn
    raw = comp("r", [7, 8], [13, 14])  # the raw completions prompt
    for c in (chat1, chat2, raw):
        st.record(s, [c], ["x"], ["x"], [[]])
    st.set_reward(s, 1.0, None)
    ended = st.end(s, "per_completion", 1.0)
    assert not ended.abandoned
    trajs = [e for e in ended.events if isinstance(e, TrajectoryEvent)]
    rews = [e for e in ended.events if isinstance(e, RewardEvent)]
    assert len(trajs) == 3 and len(rews) == 3 and st.published_groups == 1
    assert st.unshared_groups == 1
    assert [t.prompt_ids for t in trajs] == [[], [], []]
    assert trajs[0].output_ids == [1, 2, 3, 10, 11] and trajs[0].loss_mask == [0, 0, 0, 1, 1]
    assert trajs[1].output_ids == [1, 2, 3, 10, 11, 4, 5, 12]
    assert trajs[1].loss_mask == [0] * 7 + [1]
    assert trajs[2].output_ids == [7, 8, 13, 14] and trajs[2].loss_mask == [0, 0, 1, 1]
    assert trajs[2].output_logprobs == [0.0, 0.0, -0.5, -0.5]
    assert [t.turn_boundaries for t in trajs] == [[3], [7], [2]]
    assert [t.group_size for t in trajs] == [3, 3, 3]
    for t in trajs:
        t.validate()
    # A group that shares one token is still published, with that token as its prompt.
    c = st.start(group_id=None, group_size=2, sample_index=None, task="t", task_data={},
                 policy_version=0, admit=gate.try_admit)
    d = st.start(group_id=c.group.group_id, group_size=2, sample_index=None, task="t",
                 task_data={}, policy_version=0, admit=gate.try_admit)
    st.record(c, [comp("z", [1, 2], [10])], ["z"], ["z"], [[]])
    st.record(d, [comp("w", [1, 5], [11])], ["w"], ["w"], [[]])
    st.end(c, None, None)
    events = st.end(d, None, None).events
    assert [t.prompt_ids for t in events if isinstance(t, TrajectoryEvent)] == [[1], [1]]


def test_proxy_weights_follower_versions_only_go_forward():
    from tapioca.bus.role import Source
    from tapioca.producers.proxy.gate import WeightsFollower
    from tapioca.schemas.errors import BadEventError
    from tapioca.schemas.events import ProgressEvent, WeightsEvent

    gate = HeadGate(eta=0, prompts_per_step=4)
    loaded: list[int] = []
    follower = WeightsFollower(gate, lambda e: loaded.append(e.version),
                               lambda: loaded[-1] if loaded else 0)
    state = follower.init_state()
    replay = WeightsEvent(version=1, path="/w1", sha256="00" * 32)
    history = [WeightsEvent(version=v, path=f"/w{v}", sha256="00" * 32) for v in (1, 2, 3)]
    replay.produced_at = history[-1].produced_at + 1  # re-published after version 3
    progress = [ProgressEvent(version=v) for v in (1, 2, 3)]
    follower.recover(state, history + progress + [replay])
    assert loaded == [3] and gate.version == 3 and gate.ready.is_set()
    src = Source(topic="t.weights.v1", partition=0, offset=9, broadcast=True)
    psrc = Source(topic="t.progress.v1", partition=0, offset=9, broadcast=True)
    state.skip_until = state.progress_skip_until = ""
    with pytest.raises(BadEventError, match="weights version 2 is older than version 3"):
        follower.handle(WeightsEvent(version=2, path="/w2", sha256="00" * 32), state, src)
    assert loaded == [3] and gate.version == 3
    follower.handle(WeightsEvent(version=3, path="/w3", sha256="00" * 32), state, src)
    follower.handle(ProgressEvent(version=3, groups_rejected=1), state, psrc)
    assert loaded == [3] and gate.rejected == 1  # the loaded version's progress: the counts move
    follower.handle(WeightsEvent(version=4, path="/w1", sha256="00" * 32, rollback_of=1), state, src)
    follower.handle(ProgressEvent(version=4, groups_rejected=1, rollbacks=1), state, psrc)
    assert loaded == [3] and gate.version == 3  # loaded on the tick, then the gate moves
    follower.on_tick(state, 0.0)
    assert loaded == [3, 4] and (gate.version, gate.rollbacks) == (4, 1)
    # An older progress event (re-published) moves nothing back.
    follower.handle(ProgressEvent(version=2), state, psrc)
    assert (gate.version, gate.rollbacks, gate.rejected) == (4, 1, 1)


def test_proxy_weights_follower_refuses_conflicts_and_moves_the_gate_only_once_loaded():
    """The rollout workers' rule (weights/follow.py): a load that fails keeps the
    gate and, once dead-lettered, lets the next claim of the version load; another claim
    of the loaded version is refused; a version a fast transport no longer holds is dropped."""
    from tapioca.bus.role import Source
    from tapioca.producers.proxy.gate import WeightsFollower
    from tapioca.schemas.errors import BadEventError
    from tapioca.schemas.events import ProgressEvent, WeightsEvent
    from tapioca.weights.files import WeightsUnavailableError

    gate = HeadGate(eta=0, prompts_per_step=4)
    loaded: list[str] = []

    def load(event):
        if "missing" in event.path:
            raise FileNotFoundError(event.path)
        if event.transport != "file":
            raise WeightsUnavailableError("the trainer's buffer holds a newer version")
        loaded.append(event.path)

    follower = WeightsFollower(gate, load, lambda: 0)
    state = follower.init_state()
    follower.recover(state, [])
    src = Source(topic="t.weights.v1", partition=0, offset=0, broadcast=True)
    forged, genuine = (WeightsEvent(version=1, path=p, sha256=c * 64) for p, c in (("/missing", "a"), ("/w1", "b")))
    follower.handle(forged, state, src)
    # The trainer's progress of version 1: the gate waits for the version to load.
    follower.handle(ProgressEvent(version=1), state, Source("t.progress.v1", 0, 0, broadcast=True))
    with pytest.raises(BadEventError, match="cannot be loaded.*the agent proxy stays on version 0") as info:
        follower.on_tick(state, 0.0)
    assert info.value.retryable and gate.version == 0 and loaded == []
    follower.handle(genuine, state, src)  # a fallback while the forged one is retried
    follower.on_dead_letter(state, forged, info.value)
    follower.on_tick(state, 0.0)
    assert loaded == ["/w1"] and gate.version == 1
    with pytest.raises(BadEventError, match="conflicts with the loaded weights"):
        follower.handle(WeightsEvent(version=1, path="/w1c", sha256="c" * 64), state, src)
    follower.handle(WeightsEvent(version=2, path="", sha256="", transport="ipc", bucket_checksums=["d" * 64]),
                    state, src)
    assert list(follower.on_tick(state, 0.0)) == [] and state.head is None  # dropped
    assert gate.version == 1 and follower.describe(state)["weights_dead_lettered"] == 1


def test_online_sessions_defer_rewards_and_take_one_after_the_end():
    """Online mode (defer_unset_rewards): a session ended without a reward publishes its
    trajectories without one; a reward after the end lands on its last completion, x
    turn_discount ** (completions after each trajectory's), with the group if it is still
    open; a second one, or one for an expired session, is refused."""
    clock = Clock()
    st = store(clock, defer_unset_rewards=True)
    admit = iter(range(100)).__next__
    a = st.start(group_id=None, group_size=2, sample_index=None, task="", task_data={},
                 policy_version=0, admit=admit)
    b = st.start(group_id=a.group.group_id, group_size=2, sample_index=None, task="",
                 task_data={}, policy_version=0, admit=admit)
    st.record(a, [comp("x", [1, 2], [3])], ["x"], ["x"], [[]])
    st.record(a, [comp("y", [1, 2, 3, 4], [5])], ["y"], ["y"], [[]])
    ended = st.end(a, "per_completion", 0.5)
    assert ended.rewards == [None, None] and ended.events == []
    session, traj_ids = st.reward_ended(a.session_id, 2.0)
    assert session is a and [p.reward for p in a.pieces] == [1.0, 2.0]  # 2 x 0.5, 2 x 1
    with pytest.raises(ApiError) as err:
        st.reward_ended(a.session_id, 1.0)
    assert (err.value.status, err.value.code) == (409, "already_rewarded")
    st.record(b, [comp("z", [1, 2], [6])], ["z"], ["z"], [[]])
    events = st.end(b, None, None).events
    trajs = [e for e in events if isinstance(e, TrajectoryEvent)]
    rewards = {e.traj_id: e.reward for e in events if isinstance(e, RewardEvent)}
    assert rewards == dict(zip(traj_ids, [1.0, 2.0]))  # b's reward may still come
    assert [t.delayed_reward_factor for t in trajs] == [0.5, 1.0, 1.0]
    assert [t.session_id for t in trajs] == [a.session_id] * 2 + [b.session_id]
    assert st.reward_ended(b.session_id, 1.0) is None  # published: the index's job now
    # An expired session took its completions out of its group: 410.
    c = st.start(group_id=None, group_size=2, sample_index=None, task="", task_data={},
                 policy_version=0, admit=admit)
    d = st.start(group_id=c.group.group_id, group_size=2, sample_index=None, task="",
                 task_data={}, policy_version=0, admit=admit)
    clock.t = 9.0
    st.by_api_key(d.api_key)  # d is active, so the group stays open
    clock.t = 11.0
    st.reap()
    assert c.state == "expired" and d.state == "open"
    with pytest.raises(ApiError) as err:
        st.reward_ended(c.session_id, 1.0)
    assert (err.value.status, err.value.code) == (410, "session_expired")


def test_a_fixed_key_ends_its_previous_episode_and_untrained_groups_hold_no_slot():
    gate = HeadGate(eta=0, prompts_per_step=1)
    gate.ready.set()
    st = store(defer_unset_rewards=True)
    key = "user-bob-0123456789"
    first = st.start(group_id=None, group_size=1, sample_index=None, task="", task_data={},
                     policy_version=0, admit=gate.try_admit, api_key=key)
    assert st.by_api_key(key) is first and first.fixed_key
    st.record(first, [comp("x", [1], [2])], ["x"], ["x"], [[]])
    st.begin_call(first, 5)  # a call generating: a second client on the key
    with pytest.raises(ApiError) as err:
        st.end_previous(key)
    assert (err.value.status, err.value.code) == (409, "key_in_use")
    st.end_call(first, 5)
    session, ended = st.end_previous(key)
    assert session is first and len(ended.events) == 1 and ended.rewards == [None]
    assert st.end_previous(key) is None
    # The gate is full (eta 0, B 1): a new group is served untrained, outside the gate.
    assert st.start(group_id=None, group_size=1, sample_index=None, task="", task_data={},
                    policy_version=0, admit=gate.try_admit, api_key=key) is None
    second = st.start(group_id=None, group_size=1, sample_index=None, task="", task_data={},
                      policy_version=0, admit=gate.try_admit, api_key=key,
                      untrained="served past the staleness bound")
    assert st.by_api_key(key) is second and gate.admitted == 1
    st.record(second, [comp("y", [1], [3])], ["y"], ["y"], [[]])
    done = st.end(second, None, None)
    assert done.events == [] and not done.abandoned
    assert done.reason == "not for training: served past the staleness bound"


def test_before_the_end_the_last_reward_wins_and_says_what_it_replaced():
    """AReaL's rule (its InteractionCache.set_reward overwrites): a second reward before
    the end replaces the first, and the result reports the replaced value; the trajectory
    carries the last one. After the end: 409 (test_keys_expire_and_tokens_are_limited)."""
    st = store()
    admit = iter(range(100)).__next__
    s = st.start(group_id=None, group_size=1, sample_index=None, task="", task_data={}, policy_version=0,
                 admit=admit)
    st.record(s, [comp("a", [1], [2])], ["x"], ["x"], [[]])
    st.record(s, [comp("b", [1, 2, 5], [3, 4], index=0), comp("b", [1, 2, 5], [6], index=1)], ["y", "z"],
              ["y", "z"], [[], []])
    first = st.set_reward(s, 0.25, "b:1")
    assert first == ["b:1"] and first.replaced == {}
    again = st.set_reward(s, 1.0, "b")  # every choice of the call: b:1 had 0.25
    assert again == ["b:0", "b:1"] and again.replaced == {"b:1": 0.25}
    assert st.set_reward(s, 0.5, "a").replaced == {}
    ended = st.end(s, "per_completion", 0.0)  # discount 0: each completion keeps its own reward
    assert ended.rewards == [0.5, 1.0, 1.0]
