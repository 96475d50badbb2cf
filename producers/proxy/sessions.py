"""Agent sessions, their GRPO groups, and the trajectories they become.

Consumes what the proxy's HTTP handlers record (one :class:`Completion` per generated
choice: prompt ids, output ids, behaviour logprobs, per-token versions) plus rewards
and session ends; emits ``TrajectoryEvent`` + ``RewardEvent`` (scorer ``"session"``),
keyed by ``group_id``, once every session of a group has ended or expired. Pure
bookkeeping: no HTTP, no Kafka (the server publishes what :meth:`SessionStore.end`
and :meth:`SessionStore.reap` return).

Why a group is published as a whole: a training sample shares one prompt across the
group (``SampleEvent.prompt_ids``) and the advantage processor completes a group at
``group_size`` trajectories. Both are only known when every session is over: the
shared prompt is the longest common prefix of the sessions' first prompts (normally
the whole first prompt; any remainder moves into the output with loss mask 0), and
``group_size`` is the number of trajectories actually produced (sessions that expired
or never started are left out, so the group still completes). Sessions whose prompts
share no first token (a per_completion session that mixed chat calls and raw
``/v1/completions`` calls, whose prompts start differently) are published with an empty
shared prompt: every sequence's whole context moves into its output with loss mask 0
(counted as ``unshared_groups``); the trainer, the advantage processor, the archive and
replay take such groups (``SampleEvent.prompt_ids == []``).

Trajectory shapes (``mode`` of ``end``):
    concat: one trajectory per session. The chain is built backwards from the leaf
        (the completion the last reward was set on, else the last completion): an
        earlier completion joins when its prompt + output is a token prefix of the
        current one's prompt. Output = every token after the first prompt; loss mask
        1 on model tokens, 0 on the tokens between turns (tool results, user turns,
        template tokens), whose logprob is 0 and version that of the nearest model
        token (the one before; the first one for a leading remainder);
        ``turn_boundaries`` = output offsets where each model turn starts.
    per_completion: one trajectory per completion (prompt = its own prompt).

Rewards (AReaL's ``apply_reward_discount``): over the session's completions in
creation order, unset rewards count 0 and ``G[i] = r[i] + discount * G[i+1]``, so a
reward set on completion j reaches completion i < j as ``r_j * discount**(j - i)``.
per_completion trajectories get ``G[i]``; a concat trajectory gets ``G`` of its first
chain completion (with one reward on the last of m turns: ``r * discount**(m-1)``,
AReaL's multi-turn ``turn_discount``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NamedTuple

from ...bus.dedup import SeenSet
from ...schemas.envelope import Event
from ...schemas.events import RewardEvent, TrajectoryEvent
from .openai_errors import ApiError, bad_request

Mode = Literal["concat", "per_completion"]

log = logging.getLogger(__name__)


@dataclass
class Completion:
    """One generated choice of one call."""

    call_id: str
    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str
    reward: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # The prompt's images (ImageRef, placeholder order; producers/proxy/images.py).
    images: list = field(default_factory=list)

    @property
    def completion_id(self) -> str:
        return f"{self.call_id}:{self.index}"


@dataclass
class _Piece:
    """A trajectory before the group's shared prompt is known."""

    traj_id: str
    session_order: int
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    loss_mask: list[int]
    turn_boundaries: list[int]
    finish_reason: str
    # None: no reward yet (online mode: one may come after the end).
    reward: float | None
    details: dict[str, Any]
    timings: dict[str, float]
    images: list = field(default_factory=list)
    # What a session reward given after the end is multiplied by for this trajectory.
    reward_factor: float = 1.0


@dataclass
class Session:
    session_id: str
    api_key: str
    group: "Group"
    sample_index: int
    policy_version: int
    last_active: float
    completions: list[Completion] = field(default_factory=list)
    tokens_used: int = 0
    state: Literal["open", "ended", "expired"] = "open"
    reward_leaf: Completion | None = None
    # Raw generated text by tool-call id / by returned content (tool_calls.prepare_messages).
    raw_by_tool_call_id: dict[str, str] = field(default_factory=dict)
    raw_by_content: dict[str, str] = field(default_factory=dict)
    pieces: list[_Piece] = field(default_factory=list)
    calls: int = 0
    # Calls generating now: a session with one is never expired (its reply must not be
    # answered 200 and then dropped from the group).
    in_flight: int = 0
    # A key the client chose (a fixed key across episodes, AReaL's OpenClaw): starting a
    # session with it again ends this one.
    fixed_key: bool = False


@dataclass
class Group:
    group_id: str
    group_index: int
    group_size: int
    task: str
    task_data: dict[str, Any]
    last_active: float
    sessions: dict[int, Session] = field(default_factory=dict)
    next_index: int = 0
    # "" unless the group is not for training (proxy.admission serve_untrained: served
    # past the staleness bound): then why; nothing of it is published.
    untrained: str = ""

    def done(self, now: float, ttl_s: float) -> bool:
        """Every session over, and either all group_size started or no one joined for ttl."""
        if any(s.state == "open" for s in self.sessions.values()):
            return False
        return len(self.sessions) >= self.group_size or now - self.last_active > ttl_s


class Ended(NamedTuple):
    """What :meth:`SessionStore.end` returns. ``abandoned``: this end finished the
    session's group without a single trajectory (computed under the store's lock, so
    the gate slot is freed exactly once, by this caller or by the reaper). ``rewards``:
    None for a trajectory whose reward may still come (online mode). ``reason``: why
    nothing of the session will train ("" when it will, or may once rewarded)."""

    traj_ids: list[str]
    rewards: list[float | None]
    events: list[Event]
    group: "Group"
    abandoned: bool
    reason: str = ""


def discounted_returns(rewards: list[float | None], discount: float) -> list[float]:
    """``G[i] = r[i] + discount * G[i+1]`` with unset rewards as 0 (AReaL's rule)."""
    out = [0.0] * len(rewards)
    acc = 0.0
    for i in range(len(rewards) - 1, -1, -1):
        acc = float(rewards[i] or 0.0) + discount * acc
        out[i] = acc
    return out


def _is_prefix(prefix: list[int], seq: list[int]) -> bool:
    return len(prefix) <= len(seq) and seq[:len(prefix)] == prefix


def concat_chain(completions: list[Completion], leaf: Completion) -> list[Completion]:
    """The completions the conversation ending at ``leaf`` actually went through."""
    chain = [leaf]
    current = leaf.prompt_ids
    images = leaf.images
    for c in reversed(completions[:completions.index(leaf)]):
        # The same tokens with other images are another conversation (placeholders are
        # the same token whatever the image).
        if _is_prefix(c.prompt_ids + c.output_ids, current) and c.images == images[:len(c.images)]:
            chain.append(c)
            current = c.prompt_ids
    return chain[::-1]


def build_concat(chain: list[Completion]) -> dict[str, Any]:
    """Prompt + one output spanning every turn of ``chain`` (see module docstring)."""
    prompt = list(chain[0].prompt_ids)
    seq = list(prompt)
    out, lps, vers, mask, bounds = [], [], [], [], []
    for c in chain:
        extra = c.prompt_ids[len(seq):]
        fill = vers[-1] if vers else (c.output_versions[0] if c.output_versions else 0)
        out += extra
        lps += [0.0] * len(extra)
        vers += [fill] * len(extra)
        mask += [0] * len(extra)
        bounds.append(len(out))
        out += c.output_ids
        lps += [float(x) for x in c.output_logprobs]
        vers += list(c.output_versions)
        mask += [1] * len(c.output_ids)
        seq = c.prompt_ids + c.output_ids
    return {"prompt_ids": prompt, "output_ids": out, "output_logprobs": lps,
            "output_versions": vers, "loss_mask": mask, "turn_boundaries": bounds}


def common_prefix_len(seqs: list[list[int]]) -> int:
    if not seqs:
        return 0
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for i in range(n):
        if any(s[i] != first[i] for s in seqs[1:]):
            return i
    return n


def _move_prompt_tail(piece: _Piece, keep: int) -> None:
    """Keep ``prompt_ids[:keep]`` as the prompt; the rest joins the output, masked."""
    tail = piece.prompt_ids[keep:]
    if not tail:
        return
    first_version = next((v for v, m in zip(piece.output_versions, piece.loss_mask) if m), 0)
    piece.prompt_ids = piece.prompt_ids[:keep]
    piece.output_ids = tail + piece.output_ids
    piece.output_logprobs = [0.0] * len(tail) + piece.output_logprobs
    piece.output_versions = [first_version] * len(tail) + piece.output_versions
    piece.loss_mask = [0] * len(tail) + piece.loss_mask
    piece.turn_boundaries = [b + len(tail) for b in piece.turn_boundaries]


class RewardSet(list):
    """The completion ids a reward before the end was set on; ``replaced``: completion
    id -> the reward it replaced (the last reward before the end wins)."""

    def __init__(self, ids=()) -> None:
        super().__init__(ids)
        self.replaced: dict[str, float] = {}


class SessionStore:
    """Sessions and groups of one proxy; every method is thread-safe.

    ``admit`` is called (under the store's lock) when a session starts a new group; it
    returns the group index k or None while the head gate is closed. ``abandon`` is
    called for an admitted group that ends with no trajectory (it frees its gate slot).
    ``decode`` turns output ids into ``output_text``.
    """

    def __init__(self, *, ttl_s: float, max_sessions: int, max_tokens_per_session: int,
                 run_tag: str, decode: Callable[[list[int]], str],
                 default_mode: Mode = "concat", default_discount: float = 1.0,
                 defer_unset_rewards: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        # Online mode: a session ended without a reward publishes its trajectories with
        # none (they wait on the log for one) instead of counting unset rewards as 0.
        self.defer_unset_rewards = defer_unset_rewards
        self.max_sessions = max_sessions
        self.max_tokens_per_session = max_tokens_per_session
        self.run_tag = run_tag
        self.decode = decode
        self.default_mode = default_mode
        self.default_discount = default_discount
        self.clock = clock
        self._lock = threading.RLock()
        self.sessions: dict[str, Session] = {}
        self.by_key: dict[str, str] = {}
        self.groups: dict[str, Group] = {}
        self.finished_groups = SeenSet(1_000_000)
        # key -> why it no longer works (bounded: oldest forgotten first)
        self.dead_keys: dict[str, str] = {}
        self.published_groups = 0
        self.unshared_groups = 0  # finished groups whose sessions shared no prompt token
        self.started = 0
        self.untrained_sessions = 0

    # ------------------------------------------------------------------ sessions

    def start(self, *, group_id: str | None, group_size: int, sample_index: int | None,
              task: str, task_data: dict[str, Any], policy_version: int,
              admit: Callable[[], int | None], api_key: str | None = None,
              untrained: str = "") -> Session | None:
        """A new session, or None while the head gate keeps its new group out.
        ``api_key``: the client's own key (else a random one); ``untrained``: why a new
        group is served without the gate and not trained (its sessions publish nothing)."""
        with self._lock:
            if sum(1 for s in self.sessions.values() if s.state == "open") >= self.max_sessions:
                raise ApiError(429, f"{self.max_sessions} sessions are open (proxy.max_sessions); "
                               "end some or raise the limit", code="too_many_sessions")
            if group_id is not None and group_id in self.finished_groups:
                raise ApiError(409, f"group {group_id!r} is already finished and published; "
                               "start a new group", param="group_id", code="group_finished")
            if api_key is not None and api_key in self.by_key:
                raise _key_in_use(api_key)
            group = self.groups.get(group_id) if group_id is not None else None
            now = self.clock()
            if group is None:
                if untrained:
                    k, gid = -1, group_id or f"{self.run_tag}-proxy-untrained-{secrets.token_hex(6)}"
                else:
                    k = admit()
                    if k is None:
                        return None
                    gid = group_id if group_id is not None else f"{self.run_tag}-proxy-g{k:08d}"
                group = Group(gid, k, group_size, task, dict(task_data), now, untrained=untrained)
                self.groups[gid] = group
            elif group.group_size != group_size:
                raise bad_request(f"group {group.group_id!r} has group_size {group.group_size}, "
                                  f"not {group_size}", "group_size")
            if len(group.sessions) >= group.group_size:
                raise ApiError(409, f"group {group.group_id!r} already has its {group.group_size} "
                               "sessions", param="group_id", code="group_full")
            if sample_index is None:
                while group.next_index in group.sessions:
                    group.next_index += 1
                sample_index = group.next_index
            if not 0 <= sample_index < group.group_size or sample_index in group.sessions:
                raise bad_request(f"sample_index {sample_index} is taken or outside "
                                  f"[0, {group.group_size}) in group {group.group_id!r}", "sample_index")
            session = Session(f"sess-{secrets.token_hex(8)}",
                              api_key if api_key is not None else f"tpk-{secrets.token_urlsafe(24)}",
                              group, sample_index, policy_version, now,
                              fixed_key=api_key is not None)
            group.sessions[sample_index] = session
            group.last_active = now
            self.sessions[session.session_id] = session
            self.by_key[session.api_key] = session.session_id
            self.dead_keys.pop(session.api_key, None)
            self.started += 1
            self.untrained_sessions += bool(group.untrained)
            return session

    def end_previous(self, api_key: str) -> tuple[Session, Ended] | None:
        """A fixed key starts its next episode: the open session holding ``api_key`` (if
        any) is ended as ``end`` with the defaults would. 409 while one of its calls is
        generating (two clients on one key at once: ending it would drop that reply)."""
        with self._lock:
            sid = self.by_key.get(api_key)
            session = self.sessions.get(sid) if sid else None
            if session is None or session.state != "open":
                return None
            if session.in_flight:
                raise _key_in_use(api_key)
            return session, self.end(session, None, None)

    def by_api_key(self, key: str) -> Session:
        """The open session of ``key``; 401 for an unknown, expired or ended key."""
        with self._lock:
            sid = self.by_key.get(key)
            session = self.sessions.get(sid) if sid else None
            if session is None:
                why = self.dead_keys.get(key)
                raise ApiError(401, f"API key {why}; start a new session" if why else
                               "unknown API key; start a session with POST /v1/sessions "
                               "and use the api_key it returns", code="invalid_api_key")
            if session.in_flight == 0 and self.clock() - session.last_active > self.ttl_s:
                self._expire(session)
                raise ApiError(401, "API key expired (session idle longer than proxy.session_ttl_s); "
                               "start a new session", code="expired_api_key")
            session.last_active = self.clock()
            return session

    def open_session(self, session_id: str) -> Session | None:
        with self._lock:
            session = self.sessions.get(session_id)
            return session if session is not None and session.state == "open" else None

    def get(self, session_id: str) -> Session:
        with self._lock:
            session = self.sessions.get(session_id)
            if session is None:
                raise ApiError(404, f"no open session {session_id!r}", code="session_not_found")
            return session

    def begin_call(self, session: Session, tokens: int) -> None:
        """A call of ``session`` starts and may use ``tokens`` (its prompt + n x
        max_tokens) of ``proxy.max_tokens_per_session``; pair with :meth:`end_call`."""
        with self._lock:
            if session.state != "open":
                raise ApiError(401, f"API key belongs to an {session.state} session; start a new session",
                               code="invalid_api_key")
            if session.tokens_used + tokens > self.max_tokens_per_session:
                raise bad_request(
                    f"this request may use {tokens} tokens (prompt + n x max_tokens) but the session "
                    f"has {self.max_tokens_per_session - session.tokens_used} left of "
                    f"proxy.max_tokens_per_session={self.max_tokens_per_session} (prompt + generated "
                    "tokens over all its calls); end the session or lower max_tokens / n",
                    "max_tokens", code="session_token_limit")
            session.tokens_used += tokens
            session.in_flight += 1

    def end_call(self, session: Session, unused: int) -> None:
        """The call is over: give back the ``unused`` part of its reservation; the
        session's idle time starts again now."""
        with self._lock:
            session.tokens_used -= unused
            session.in_flight -= 1
            session.last_active = self.clock()

    def record(self, session: Session, completions: list[Completion],
               raw_texts: list[str], contents: list[str | None],
               tool_call_ids: list[list[str]]) -> None:
        with self._lock:
            if session.state != "open":
                # Ended (by its harness) while this call was generating: the reply is not
                # part of any trajectory, so the client must not get it as a success.
                raise ApiError(409, f"session {session.session_id} was {session.state} while this "
                               "call was generating; its reply is not recorded", code="session_closed")
            session.completions.extend(completions)
            session.calls += 1
            session.last_active = session.group.last_active = self.clock()
            for raw, content, ids in zip(raw_texts, contents, tool_call_ids):
                for tid in ids:
                    session.raw_by_tool_call_id[tid] = raw
                if not ids and content is not None:
                    session.raw_by_content[content] = raw

    def set_reward(self, session: Session, reward: float, completion_id: str | None) -> "RewardSet":
        """Set ``reward`` on one completion (``call_id:index``), every choice of one call
        (``call_id``), or the last completion (None). Returns the completion ids set.

        Before the end the last reward wins (AReaL's ``set_reward`` overwrites too): a
        second reward for a completion replaces the first, and the result's ``replaced``
        (completion id -> the reward replaced) says so. After the end a session takes one
        reward (409 ``already_rewarded``, producers/proxy/delayed_rewards.py)."""
        with self._lock:
            if session.state != "open":
                raise ApiError(409, f"session {session.session_id} is already {session.state}; set "
                               "rewards before ending it", code="session_closed")
            session.last_active = self.clock()
            if not session.completions and completion_id is None:
                # Nothing to reward (an agent that failed before its first call): accepted,
                # so the harness can end the session the same way as any other.
                return RewardSet()
            if completion_id is None:
                targets = [session.completions[-1]]
            else:
                targets = [c for c in session.completions
                           if completion_id in (c.completion_id, c.call_id)]
                if not targets:
                    raise ApiError(404, f"no completion {completion_id!r} in this session",
                                   param="completion_id", code="completion_not_found")
            out = RewardSet(c.completion_id for c in targets)
            for c in targets:
                if c.reward is not None:
                    out.replaced[c.completion_id] = c.reward
                c.reward = float(reward)
            session.reward_leaf = targets[-1]
            session.last_active = self.clock()
            return out

    # ------------------------------------------------------------------ ending

    def end(self, session: Session, mode: Mode | None, discount: float | None) -> Ended:
        """End ``session``: its trajectory ids and rewards, and the events to publish
        now (the whole group's, if this was its last open session; else none)."""
        mode = mode or self.default_mode
        discount = self.default_discount if discount is None else discount
        with self._lock:
            if session.state != "open":
                raise ApiError(409, f"session {session.session_id} already {session.state}",
                               code="session_closed")
            self._build_pieces(session, mode, discount)
            session.state = "ended"
            self._retire_key(session, "belongs to an ended session")
            group = session.group
            finished_before = group.group_id in self.finished_groups
            events = self._maybe_publish(group)
            finished = not finished_before and group.group_id in self.finished_groups
            abandoned = finished and not events and not group.untrained
            reason = (f"not for training: {group.untrained}" if group.untrained
                      else "the session made no completion with output tokens"
                      if not session.pieces else "")
            return Ended([p.traj_id for p in session.pieces], [p.reward for p in session.pieces],
                         events, group, abandoned, reason)

    def reward_ended(self, session_id: str, reward: float,
                     key: str | None = None) -> tuple[Session, list[str]] | None:
        """A session reward for an ended session whose group is not published yet (other
        sessions of it are open): it goes out with the group (``reward`` x each
        trajectory's factor). None when this store no longer holds the session (its
        group was published: the reward is then an event of its own)."""
        with self._lock:
            session = self.sessions.get(session_id)
            if session is None or session.state == "open":
                return None
            if key is not None and key != session.api_key:
                raise ApiError(403, "this API key belongs to another session", code="wrong_session")
            if session.state == "expired":
                raise ApiError(410, f"session {session_id} expired (idle longer than "
                               "proxy.session_ttl_s) before it ended: its completions left its "
                               "group, so there is nothing to reward", code="session_expired")
            if session.group.untrained:
                raise _not_for_training(session_id, session.group.untrained)
            if not session.pieces:
                raise ApiError(409, f"session {session_id} made no completion to reward",
                               code="nothing_to_reward")
            if any(p.reward is not None for p in session.pieces):
                raise _already_rewarded(session_id)
            for p in session.pieces:
                p.reward = reward * p.reward_factor
            return session, [p.traj_id for p in session.pieces]

    def _build_pieces(self, session: Session, mode: Mode, discount: float) -> None:
        comps = [c for c in session.completions if c.output_ids]
        if not comps:
            return
        returns = dict(zip(map(id, comps), discounted_returns([c.reward for c in comps], discount)))
        # A reward given to the session after it ends lands on its last completion (AReaL's
        # rule): completion i gets it x discount ** (completions after i).
        factors = {id(c): discount ** (len(comps) - 1 - i) for i, c in enumerate(comps)}
        pending = self.defer_unset_rewards and all(c.reward is None for c in comps)
        base = f"{session.group.group_id}:{session.sample_index}"
        details = {"mode": mode, "discount": discount, "session_id": session.session_id,
                   "raw_rewards": [c.reward for c in comps]}
        if mode == "concat":
            leaf = session.reward_leaf if session.reward_leaf in comps else comps[-1]
            chain = concat_chain(comps, leaf)
            built = build_concat(chain)
            timings = {"generate_s": sum(c.timings.get("generate_s", 0.0) for c in chain),
                       "queued_s": sum(c.timings.get("queued_s", 0.0) for c in chain)}
            session.pieces = [_Piece(base, 0, finish_reason=leaf.finish_reason,
                                     reward=None if pending else returns[id(chain[0])],
                                     timings=timings, reward_factor=factors[id(chain[0])],
                                     details={**details, "turns": len(chain),
                                              "completion_ids": [c.completion_id for c in chain]},
                                     images=list(leaf.images), **built)]
        elif mode == "per_completion":
            session.pieces = [
                _Piece(f"{base}:{c.completion_id}", i, list(c.prompt_ids), list(c.output_ids),
                       [float(x) for x in c.output_logprobs], list(c.output_versions),
                       [1] * len(c.output_ids), [0], c.finish_reason,
                       None if pending else returns[id(c)],
                       {**details, "completion_ids": [c.completion_id]}, dict(c.timings),
                       list(c.images), reward_factor=factors[id(c)])
                for i, c in enumerate(comps)]
        else:
            raise bad_request(f"mode {mode!r}: use concat or per_completion", "mode")

    def _maybe_publish(self, group: Group) -> list[Event]:
        if group.group_id in self.finished_groups or not group.done(self.clock(), self.ttl_s):
            return []
        self.finished_groups.first(group.group_id)
        self.groups.pop(group.group_id, None)
        for s in group.sessions.values():
            self.sessions.pop(s.session_id, None)
        if group.untrained:  # served past the staleness bound: never published
            return []
        owner = {id(p): s for s in group.sessions.values() for p in s.pieces}
        pieces = [p for idx in sorted(group.sessions) for p in group.sessions[idx].pieces]
        if not pieces:
            return []
        keep = common_prefix_len([p.prompt_ids for p in pieces])
        # No common token (a chat call and a raw completions call of one per_completion
        # session): published with an empty shared prompt, each context in its output
        # with loss mask 0 (the trainer's flatten_groups takes the first context token
        # as the prompt), as AReaL's individual export trains them.
        self.unshared_groups += keep == 0
        events: list[Event] = []
        for i, p in enumerate(pieces):
            _move_prompt_tail(p, keep)
            events.append(TrajectoryEvent(
                traj_id=p.traj_id, group_id=group.group_id,
                prompt_id=str(group.task_data.get("prompt_id", group.group_id)),
                sample_index=i, group_size=len(pieces), prompt_ids=p.prompt_ids,
                output_ids=p.output_ids, output_logprobs=p.output_logprobs,
                output_versions=p.output_versions, loss_mask=p.loss_mask,
                turn_boundaries=p.turn_boundaries,
                finish_reason=(p.finish_reason if p.finish_reason in ("stop", "length", "abort", "tool_calls")
                               else "stop"),
                output_text=self.decode(p.output_ids), task=group.task, task_data=group.task_data,
                group_index=group.group_index, timings=p.timings,
                session_id=owner[id(p)].session_id, delayed_reward_factor=p.reward_factor,
                images=list(p.images)))
        for p in pieces:
            if p.reward is not None:  # else it waits on the log for a reward (online mode)
                events.append(RewardEvent(traj_id=p.traj_id, group_id=group.group_id,
                                          reward=p.reward, scorer="session", details=p.details))
        self.published_groups += 1
        return events

    # ------------------------------------------------------------------ expiry

    def _retire_key(self, session: Session, why: str) -> None:
        self.by_key.pop(session.api_key, None)
        self.dead_keys[session.api_key] = why
        while len(self.dead_keys) > 100_000:
            self.dead_keys.pop(next(iter(self.dead_keys)))

    def _expire(self, session: Session) -> None:
        if session.state == "open":
            session.state = "expired"
            session.pieces = []
            self._retire_key(session, "expired (session idle longer than proxy.session_ttl_s)")

    def reap(self) -> tuple[list[Event], int]:
        """Expire idle sessions; (events of groups now complete, groups given up empty)."""
        now = self.clock()
        events: list[Event] = []
        empty = 0
        with self._lock:
            for s in list(self.sessions.values()):
                if s.state == "open" and s.in_flight == 0 and now - s.last_active > self.ttl_s:
                    self._expire(s)
            for g in list(self.groups.values()):
                if g.done(now, self.ttl_s):
                    out = self._maybe_publish(g)
                    events += out
                    empty += not out and not g.untrained  # an untrained group holds no slot
        return events, empty


def _key_in_use(api_key: str) -> ApiError:
    return ApiError(409, "this key's open session is in use (a call is generating, or another "
                    "client just started it): two clients on one key at once would mix two "
                    "conversations into one episode; wait for the call to finish, or give each "
                    "client its own key", param="api_key", code="key_in_use")


def _already_rewarded(session_id: str) -> ApiError:
    return ApiError(409, f"session {session_id} already has its reward (a second one would not "
                    "change what trains: the first reward of a trajectory wins)",
                    code="already_rewarded")


def _not_for_training(session_id: str, why: str) -> ApiError:
    return ApiError(409, f"session {session_id} is not for training ({why}): it takes no reward",
                    code="not_for_training")
