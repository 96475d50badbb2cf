"""The agent runner: plays agent episodes against the OpenAI-compatible proxy, one GRPO
group per dataset prompt.

Consumes dataset records (the run's ``train_dataset``, cycled epoch after epoch) and
the proxy's HTTP API; emits nothing on Kafka itself: the proxy publishes each ended
session as trajectories + rewards (``trajectories.v1`` / ``rewards.v1``, keyed by
``group_id``). Per prompt it opens ``gconfig.n_samples`` sessions that share one
``group_id`` (``{run_id}-{runner tag}-a{k}``: unique across runner restarts, since a
redone group id would be de-duplicated away downstream), plays one episode in each
concurrently, posts the episode's rewards and ends the session. ``POST /v1/sessions``
blocks while the proxy's head gate is closed, so the runner slows down to the
trainer's pace on its own; ``agent.max_concurrent_groups`` only bounds how many groups
wait at once.

Chat traffic goes through the official ``openai`` SDK (one ``AsyncOpenAI`` per session,
its ``api_key`` the session key, all sharing one connection pool); the session
endpoints are plain HTTP. ``max_retries=0``: a retried completion would be recorded
twice in the session.

An episode that fails (the proxy refused a request, a tool crashed the agent) still
ends its session, with reward 0, so its group completes instead of waiting for the
advantage processor's timeout; failures are counted and logged. After
``agent.max_consecutive_failures`` failed episodes in a row the runner stops with
:class:`AgentRunnerError` naming the last error (exit status 1), so a broken agent
fails the run instead of idling it forever.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import signal
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import openai

from ..schemas.errors import ConfigError, TapiocaError
from .episode import Agent, Episode, RewardFn


def _sdk_http_module() -> Any:
    """The HTTP library the installed ``openai`` SDK itself uses (``httpx``, or
    ``httpx2`` in newer releases): the runner's connection pool must be one the SDK
    accepts as ``http_client``, whatever else is installed."""
    for base in openai.DefaultAsyncHttpxClient.__mro__:
        if base.__name__ == "AsyncClient":
            return importlib.import_module(base.__module__.split(".")[0])
    raise ImportError("openai.DefaultAsyncHttpxClient is not an AsyncClient")  # pragma: no cover


httpx = _sdk_http_module()

log = logging.getLogger(__name__)


class ProxyRequestError(TapiocaError):
    """The proxy answered a session request with an error (the message is the proxy's)."""


class AgentRunnerError(TapiocaError):
    """Too many agent episodes failed in a row: the run cannot make progress."""


@dataclass
class RunnerStats:
    groups_started: int = 0
    groups_done: int = 0
    episodes: int = 0
    failed_episodes: int = 0
    turns: int = 0
    recent_rewards: deque = field(default_factory=lambda: deque(maxlen=512))
    started: float = field(default_factory=time.monotonic)

    def summary(self) -> dict[str, float]:
        r = list(self.recent_rewards)
        return {"agent/groups_done": float(self.groups_done),
                "agent/episodes": float(self.episodes),
                "agent/failed_episodes": float(self.failed_episodes),
                "agent/turns_per_episode": self.turns / max(1, self.episodes),
                "agent/reward_recent": sum(r) / len(r) if r else 0.0,
                "agent/elapsed_s": time.monotonic() - self.started}


class SessionClient:
    """The proxy's session endpoints over plain HTTP (``{base_url}/sessions...``)."""

    def __init__(self, http: Any, base_url: str, admin_key: str) -> None:
        self.http = http
        self.base_url = base_url.rstrip("/")
        self.admin_key = admin_key

    async def _post(self, path: str, key: str, body: dict[str, Any],
                    timeout: Any = None) -> dict[str, Any]:
        extra = {"timeout": timeout} if timeout is not None else {}
        resp = await self.http.post(f"{self.base_url}{path}", json=body,
                                    headers={"Authorization": f"Bearer {key}"}, **extra)
        if resp.status_code >= 400:
            try:
                message = resp.json()["error"]["message"]
            except Exception:
                message = resp.text[:500]
            raise ProxyRequestError(f"POST {path} -> {resp.status_code}: {message}")
        return resp.json()

    async def start(self, *, group_id: str, group_size: int, sample_index: int, task: str,
                    task_data: Mapping[str, Any]) -> dict[str, Any]:
        """Open a session. The proxy holds the request while the head gate is closed
        (as long as the trainer needs), so there is no read timeout, only a connect one."""
        return await self._post("/sessions", self.admin_key, {
            "group_id": group_id, "group_size": group_size, "sample_index": sample_index,
            "task": task, "task_data": dict(task_data)},
            timeout=httpx.Timeout(None, connect=30.0))

    async def reward(self, session_id: str, key: str, reward: float,
                     completion_id: str | None = None) -> dict[str, Any]:
        return await self._post(f"/sessions/{session_id}/reward", key,
                                {"reward": float(reward), "completion_id": completion_id})

    async def end(self, session_id: str, key: str, *, mode: str | None = None,
                  discount: float | None = None) -> dict[str, Any]:
        return await self._post(f"/sessions/{session_id}/end", key,
                                {"mode": mode, "discount": discount})

    async def wait_ready(self, timeout_s: float) -> list[str]:
        """Poll ``/models`` until the proxy answers; returns the served model ids."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                resp = await self.http.get(f"{self.base_url}/models",
                                           headers={"Authorization": f"Bearer {self.admin_key}"})
                if resp.status_code == 200:
                    return [m["id"] for m in resp.json().get("data", [])]
                last = ProxyRequestError(f"GET /models -> {resp.status_code}: {resp.text[:200]}")
            except httpx.TransportError as exc:
                last = exc
            await asyncio.sleep(0.5)
        raise ProxyRequestError(f"the proxy at {self.base_url} did not answer within "
                                f"{timeout_s:.0f} s ({last}); is `tapioca proxy` running there?")


def cycle_records(make_rows, *, max_epochs: int | None = None) -> Iterator[dict[str, Any]]:
    """Records epoch after epoch; ``make_rows(epoch)`` yields one epoch's rows."""
    epoch = 0
    while max_epochs is None or epoch < max_epochs:
        n = 0
        for row in make_rows(epoch):
            n += 1
            yield row
        if n == 0:
            raise ConfigError("the dataset has no records")
        epoch += 1


class AgentRunner:
    """Drives ``agent`` over ``records`` in groups of ``group_size`` sessions."""

    def __init__(self, agent: Agent, records: Iterable[Mapping[str, Any]], *, base_url: str,
                 admin_key: str, group_size: int, model: str | None = None,
                 run_tag: str = "agent", max_concurrent_groups: int = 16,
                 end_mode: str | None = "concat", discount: float | None = None,
                 request_timeout_s: float = 600.0, ready_timeout_s: float = 120.0,
                 log_every_s: float = 10.0, max_consecutive_failures: int = 16) -> None:
        if group_size < 1:
            raise ConfigError("group_size (gconfig.n_samples) must be >= 1")
        if max_concurrent_groups < 1:
            raise ConfigError("agent.max_concurrent_groups must be >= 1")
        self.agent = agent
        self.records = iter(records)
        self.base_url = base_url.rstrip("/")
        self.admin_key = admin_key
        self.group_size = group_size
        self.model = model
        self.tag = f"{run_tag}-{uuid.uuid4().hex[:6]}"
        self.max_concurrent_groups = max_concurrent_groups
        self.end_mode = end_mode
        self.discount = discount
        self.request_timeout_s = request_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.log_every_s = log_every_s
        if max_consecutive_failures < 0:
            raise ConfigError("agent.max_consecutive_failures must be >= 0 (0: never give up)")
        self.max_consecutive_failures = max_consecutive_failures
        self.consecutive_failures = 0
        self.last_failure = ""
        self.stats = RunnerStats()
        self._stop: asyncio.Event | None = None
        self._main: asyncio.Task | None = None
        self._fatal: AgentRunnerError | None = None
        self._fatal_waiter: asyncio.Future | None = None

    def stop(self) -> None:
        """Start no new group and abandon the ones in flight (call it on the runner's
        event loop; ``run`` installs it as the SIGTERM / SIGINT handler)."""
        if self._stop is not None:
            self._stop.set()
        if self._main is not None:
            self._main.cancel()

    async def run_async(self, max_groups: int | None = None) -> RunnerStats:
        self._stop = asyncio.Event()
        # Sessions wait for the head gate inside POST /sessions, which overrides this
        # with no read timeout (SessionClient.start).
        timeout = httpx.Timeout(self.request_timeout_s, connect=30.0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with openai.DefaultAsyncHttpxClient(timeout=timeout, limits=limits) as http:
            sessions = SessionClient(http, self.base_url, self.admin_key)
            served = await sessions.wait_ready(self.ready_timeout_s)
            if self.model is None:
                if not served:
                    raise ProxyRequestError("the proxy serves no model (GET /models is empty)")
                self.model = served[0]
            # A fatal failure streak (see _failed) ends the run from wherever it waits.
            self._fatal_waiter = asyncio.get_running_loop().create_future()
            drive = asyncio.create_task(self._drive(sessions, http, max_groups))
            try:
                await asyncio.wait({drive, self._fatal_waiter},
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not drive.done():
                    drive.cancel()
                    await asyncio.gather(drive, return_exceptions=True)
            if self._fatal is not None:
                raise self._fatal
            drive.result()  # re-raise what the loop raised
        return self.stats

    async def _drive(self, sessions: SessionClient, http: Any, max_groups: int | None) -> None:
        assert self._stop is not None
        slots = asyncio.Semaphore(self.max_concurrent_groups)
        running: set[asyncio.Task] = set()
        reporter = asyncio.create_task(self._report())
        k = 0
        try:
            while not self._stop.is_set() and (max_groups is None or k < max_groups):
                record = next(self.records, None)
                if record is None:
                    break
                await slots.acquire()
                if self._stop.is_set():
                    slots.release()
                    break
                task = asyncio.create_task(self._group(sessions, http, k, record))
                task.add_done_callback(lambda _t: slots.release())
                running.add(task)
                task.add_done_callback(running.discard)
                k += 1
                self.stats.groups_started += 1
            if running:
                await asyncio.gather(*running)
        finally:
            reporter.cancel()
            for task in running:
                task.cancel()
            if running:
                # Let cancelled episodes clean up (e.g. kill an agent command's processes).
                await asyncio.gather(*running, return_exceptions=True)

    def run(self, max_groups: int | None = None) -> RunnerStats:
        """Run until ``max_groups`` groups are done, the records run out, or SIGTERM /
        SIGINT (then in-flight episodes are abandoned; the proxy's session timeout or
        the advantage processor's group timeout releases their group)."""
        async def main() -> RunnerStats:
            loop = asyncio.get_running_loop()
            self._main = asyncio.current_task()
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    loop.add_signal_handler(sig, self.stop)
                except (NotImplementedError, RuntimeError):  # not the main thread
                    pass
            try:
                return await self.run_async(max_groups)
            except asyncio.CancelledError:
                # stop(): sessions waiting at the gate or mid-episode are abandoned;
                # the proxy expires them after proxy.session_ttl_s.
                return self.stats

        return asyncio.run(main())

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self.log_every_s)
            log.info("agent runner: %s", {k: round(v, 3) for k, v in self.stats.summary().items()})

    async def _group(self, sessions: SessionClient, http: Any, k: int,
                     record: Mapping[str, Any]) -> list[Episode | None]:
        group_id = f"{self.tag}-a{k:08d}"
        episodes = await asyncio.gather(*[
            self._episode(sessions, http, group_id, i, record) for i in range(self.group_size)])
        self.stats.groups_done += 1
        return episodes

    async def _episode(self, sessions: SessionClient, http: Any, group_id: str,
                       index: int, record: Mapping[str, Any]) -> Episode | None:
        task = str(record.get("task") or "math")
        task_data = {k: v for k, v in record.items() if k not in ("messages", "prompt", "prompt_id")}
        task_data.setdefault("prompt_id", str(record.get("prompt_id", "")))
        try:
            started = await sessions.start(group_id=group_id, group_size=self.group_size,
                                           sample_index=index, task=task, task_data=task_data)
            sid, key = started["session_id"], started["api_key"]
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # No session: nothing to end. The group completes with fewer members (the
            # advantage processor's group timeout releases it); the episode counts as failed.
            self._failed(exc, f"episode {group_id}/{index} could not start a session")
            self.stats.episodes += 1
            return None
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key=key, http_client=http,
                                    max_retries=0, timeout=self.request_timeout_s)
        episode: Episode | None = None
        try:
            episode = await self.agent.run(client, self.model, record)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(exc, f"episode {group_id}/{index} failed; ending its session with reward 0")
        rewards = episode.rewards if episode is not None else [(None, 0.0)]
        discount = episode.discount if episode is not None and episode.discount is not None \
            else self.discount
        clean = episode is not None
        try:
            for completion_id, reward in rewards:
                await sessions.reward(sid, key, reward, completion_id)
        except ProxyRequestError as exc:
            # E.g. no completion yet (the agent failed before its first call): the
            # session still ends below, and the proxy leaves it out of its group.
            log.warning("reward of session %s (%s/%d) refused: %s", sid, group_id, index, exc)
            clean = False
        try:
            await sessions.end(sid, key, mode=self.end_mode, discount=discount)
        except ProxyRequestError as exc:  # e.g. expired: the proxy already dropped it
            log.warning("session %s (%s/%d) could not be ended: %s", sid, group_id, index, exc)
            clean = False
        if not clean and episode is not None:
            self._failed(None, f"episode {group_id}/{index}: the proxy refused its reward or end")
            episode = None
        self.stats.episodes += 1
        if episode is not None:
            self.consecutive_failures = 0
            self.stats.turns += episode.turns
            self.stats.recent_rewards.append(episode.reward)
        return episode

    def _failed(self, exc: BaseException | None, what: str) -> None:
        """Count a failed episode; after ``max_consecutive_failures`` in a row stop the
        run with :class:`AgentRunnerError` (every episode failing, e.g. a broken agent
        command, would otherwise be an endless run in which the trainer never steps)."""
        self.stats.failed_episodes += 1
        self.consecutive_failures += 1
        if exc is not None:
            self.last_failure = f"{type(exc).__name__}: {exc}"
            log.warning("%s (%s)", what, self.last_failure)
        else:
            log.warning("%s", what)
        if self.max_consecutive_failures and self.consecutive_failures >= self.max_consecutive_failures \
                and self._fatal is None:
            self._fatal = AgentRunnerError(
                f"{self.consecutive_failures} agent episodes failed in a row "
                f"(agent.max_consecutive_failures={self.max_consecutive_failures}); the last "
                f"error: {self.last_failure or what}. Fix the agent (or the proxy) and rerun.")
            if self._stop is not None:
                self._stop.set()
            if self._fatal_waiter is not None and not self._fatal_waiter.done():
                self._fatal_waiter.set_result(None)


# ------------------------------------------------------------------ from a run config


def dataset_reward_fn(ds: Any) -> RewardFn | None:
    """The built-in task's reward with the dataset's ``task_options`` (e.g. the
    synthetic task's ``format_credit``); None: each record's own task decides."""
    if ds.type not in ("synthetic", "gsm8k"):
        return None
    from ..tasks.base import task_reward

    options = dict(ds.task_options)
    if ds.type == "gsm8k" and ds.path:
        options.setdefault("path", ds.path)
    return task_reward(ds.type, **options)


def build_agent(cfg: Any) -> Agent:
    """The workflow named by ``cfg.agent.workflow``, with the run's sampling settings
    (``cfg``: a TrainConfig or its :class:`~tapioca.config.sections.AgentSection`)."""
    a, g = cfg.agent, cfg.gconfig
    common = {"max_tokens": g.max_new_tokens, "temperature": g.temperature, "top_p": g.top_p,
              "reward_fn": dataset_reward_fn(cfg.train_dataset)}
    if a.workflow == "math":
        from .math_agent import MathAgent

        return MathAgent(max_turns=a.max_turns, turn_discount=a.turn_discount,
                         feedback=a.feedback, **common)
    if a.workflow == "tir":
        from .tir_agent import SYSTEM_PROMPT, TIRAgent, default_toolbox

        return TIRAgent(toolbox=default_toolbox(a.tool_timeout_s, a.tool_memory_mb, a.tool_max_processes,
                                                a.tool_sandbox),
                        max_tool_rounds=a.max_turns, system_prompt=a.system_prompt or SYSTEM_PROMPT,
                        **common)
    if a.workflow == "command":
        from .command_agent import CommandAgent

        return CommandAgent(command=a.command, timeout_s=a.command_timeout_s,
                            reward_fn=common["reward_fn"])
    raise ConfigError(f"agent.workflow={a.workflow!r}: use math, tir or command")


def runner_from_config(cfg: Any, member: int = 0) -> AgentRunner:
    """The runner of one member of a run (``cfg``: a TrainConfig)."""
    from ..config.sections import agent_section
    from ..tasks.datasets import dataset_rows

    cfg = agent_section(cfg)
    ds = cfg.train_dataset
    seed = cfg.seed * 1000 + member

    def rows(epoch: int):
        task, it = dataset_rows(ds, seed + epoch if ds.shuffle else 0)
        for row in it:
            row = dict(row)
            row.setdefault("task", task)
            yield row

    p = cfg.proxy
    host = "127.0.0.1" if p.host in ("0.0.0.0", "::", "") else p.host
    base_url = cfg.agent.base_url or f"http://{host}:{p.port}/v1"
    return AgentRunner(build_agent(cfg), cycle_records(rows, max_epochs=ds.max_epochs),
                       base_url=base_url, admin_key=p.admin_key(), group_size=cfg.gconfig.n_samples,
                       model=None, run_tag=cfg.run_id, end_mode=cfg.agent.end_mode,
                       discount=None, max_concurrent_groups=cfg.agent.max_concurrent_groups,
                       request_timeout_s=cfg.agent.request_timeout_s,
                       max_consecutive_failures=cfg.agent.max_consecutive_failures)


def main(argv: list[str] | None = None) -> int:
    """``python -m tapioca.agents.runner --config run.yaml [--member N] [key=value ...]``:
    what ``tapioca train`` starts in agent mode."""
    from ..config.loader import load_config
    from ..config.schema import TrainConfig

    parser = argparse.ArgumentParser(prog="python -m tapioca.agents.runner")
    parser.add_argument("--config", required=True)
    parser.add_argument("--member", type=int, default=0)
    parser.add_argument("--max-groups", type=int, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s agent-{args.member} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    try:
        cfg = load_config(TrainConfig, args.config, args.overrides)
        runner = runner_from_config(cfg, args.member)
        stats = runner.run(args.max_groups)
    except TapiocaError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return exc.exit_code  # EXIT_CONFIG (a config error) is not restarted by the launcher
    log.info("agent runner stopped: %s", stats.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
