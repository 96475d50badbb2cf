"""The agent runner and its workflows against the real proxy over loopback (uvicorn on
127.0.0.1, the tiny model in the in-process engine, the real embedded broker):

* the multi-turn math agent's groups arrive on ``trajectories.v1`` / ``rewards.v1`` as
  ``n_samples`` trajectories per group with session rewards discounted by turn;
* the unmodified ``examples/agents/openai_agent.py`` (only the ``openai`` SDK, pointed
  at the proxy by ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``) runs once per session and
  its calls become the session's trajectory;
* the TIR agent offers its tools through the proxy and finishes its episodes, and the
  recorded prompt holds the tools block;
* a runner whose agent fails every episode stops with an error instead of idling.
"""

from __future__ import annotations

import string
import sys
import uuid
from pathlib import Path

import pytest

from tapioca.agents.command_agent import CommandAgent
from tapioca.agents.math_agent import MathAgent
from tapioca.agents.runner import AgentRunner, AgentRunnerError
from tapioca.agents.tir_agent import TIRAgent, default_toolbox
from tapioca.bus import BusConfig, ensure_topics, read_events
from tapioca.config.schema import (
    DatasetConfig,
    GenerationConfig,
    ModelConfig,
    ProxyConfig,
    TrainConfig,
)
from tapioca.models.factory import build_tiny_model
from tapioca.models.tokenizer import build_char_tokenizer
from tapioca.producers.proxy import ProxyServer
from tapioca.producers.proxy.tool_calls import render_tools_prompt
from tapioca.runtime.builders import build_proxy_service
from tapioca.schemas.events import RewardEvent, TrajectoryEvent
from tapioca.tasks.synthetic import SYNTHETIC_ALPHABET, SyntheticTask

pytestmark = pytest.mark.integration

ADMIN = "agent-test-admin"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model with a char tokenizer over every printable ASCII character (so the
    TIR agent's tools block in the system prompt round-trips through decode, not as
    <unk>) and a context long enough for it (the block alone is ~1200 tokens)."""
    alphabet = SYNTHETIC_ALPHABET + "".join(c for c in string.printable
                                            if c not in SYNTHETIC_ALPHABET and c not in "\r\x0b\x0c")
    tokenizer = build_char_tokenizer(alphabet)
    model = build_tiny_model(len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, max_position_embeddings=4096)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    path = tmp_path_factory.mktemp("agents") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def proxy(broker, model_dir, one_torch_thread):
    bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:12]}",
                    run_id="agenttest.t0")
    ensure_topics(bus)
    cfg = TrainConfig(experiment_name="agenttest", trial_name="t0", seed=5,
                      model=ModelConfig(path=model_dir), bus=bus,
                      gconfig=GenerationConfig(max_new_tokens=2),
                      # the head gate stays open
                      train_dataset=DatasetConfig(prompts_per_step=1000),
                      proxy=ProxyConfig(api_key=ADMIN))
    server = ProxyServer(build_proxy_service(cfg), "127.0.0.1", 0).start()
    yield server, bus
    server.stop()


def records(n: int):
    task = SyntheticTask(op="copy", max_digit=3)
    return list(task.iter_records("train", seed=0))[:n]


def published(bus):
    trajs = [e for e in read_events(bus, "trajectories") if isinstance(e, TrajectoryEvent)]
    rewards = {e.traj_id: e for e in read_events(bus, "rewards") if isinstance(e, RewardEvent)}
    return trajs, rewards


def assert_turn_mask(t: TrajectoryEvent) -> None:
    """The exact loss-mask structure of a concatenated session: 0 before the first turn
    (a prompt tail moved into the output), then per model turn a run of 1s (its
    tokens, with real logprobs) starting at its boundary, followed by 0s (the next
    user / tool message and the template around it) up to the next boundary; the last
    turn's 1s run to the end."""
    mask, n = t.loss_mask, len(t.output_ids)
    assert mask is not None and len(mask) == len(t.output_logprobs) == n
    bounds = list(t.turn_boundaries) + [n]
    assert mask[:bounds[0]] == [0] * bounds[0]
    for i, (b, nxt) in enumerate(zip(bounds, bounds[1:])):
        seg = mask[b:nxt]
        ones = seg.index(0) if 0 in seg else len(seg)
        assert ones >= 1, f"turn {i} has no model token"
        assert seg == [1] * ones + [0] * (len(seg) - ones), seg
        if nxt < n:
            assert ones < len(seg), f"no masked message between turn {i} and turn {i + 1}"
        else:
            assert ones == len(seg), "the last turn's tokens run to the end"
    for lp, m in zip(t.output_logprobs, mask):
        assert (lp < 0.0) if m else (lp == 0.0)


def test_math_agent_groups_reach_the_topics(proxy):
    server, bus = proxy
    agent = MathAgent(max_turns=3, turn_discount=0.5, max_tokens=2)
    runner = AgentRunner(agent, records(3), base_url=server.base_url, admin_key=ADMIN,
                         group_size=4, run_tag="mathtest", max_concurrent_groups=2)
    stats = runner.run()
    assert (stats.groups_done, stats.episodes, stats.failed_episodes) == (3, 12, 0)
    trajs, rewards = published(bus)
    assert len(trajs) == 12 and len(rewards) == 12
    by_group: dict[str, list[TrajectoryEvent]] = {}
    for t in trajs:
        by_group.setdefault(t.group_id, []).append(t)
    assert len(by_group) == 3 and all(len(v) == 4 for v in by_group.values())
    assert all(g.startswith("mathtest-") for g in by_group)
    for t in trajs:
        r = rewards[t.traj_id]
        turns = len(t.turn_boundaries)
        assert 1 <= turns <= 3 and r.scorer == "session"
        # score (0 or 1) on the last answer, discounted 0.5 per earlier turn
        assert r.reward in (0.0, 0.5 ** (turns - 1)), (turns, r.reward)
        if turns < 3:
            assert r.reward > 0, "the agent stops early only when it is right"
        assert t.task == "synthetic" and t.task_data["answer"] in ("0", "1", "2", "3")


def test_unmodified_openai_script_trains_through_the_proxy(proxy):
    server, bus = proxy
    script = ROOT / "examples" / "agents" / "openai_agent.py"
    agent = CommandAgent(command=f"{sys.executable} {script}", timeout_s=120)
    runner = AgentRunner(agent, records(1), base_url=server.base_url, admin_key=ADMIN,
                         group_size=2, run_tag="scripttest")
    stats = runner.run()
    assert (stats.episodes, stats.failed_episodes) == (2, 0)
    trajs, rewards = published(bus)
    assert len(trajs) == 2
    for t in trajs:
        # the script's calls (1, or 2 when the first reply was empty) are the trajectory
        assert 1 <= len(t.turn_boundaries) <= 2
        assert_turn_mask(t)
        assert rewards[t.traj_id].reward in (0.0, 1.0)


def test_tir_agent_offers_tools_and_finishes(proxy):
    server, bus = proxy
    agent = TIRAgent(toolbox=default_toolbox(timeout_s=3, memory_mb=256), max_tool_rounds=1,
                     system_prompt="", max_tokens=2)
    runner = AgentRunner(agent, records(1), base_url=server.base_url, admin_key=ADMIN,
                         group_size=2, run_tag="tirtest")
    stats = runner.run()
    assert (stats.episodes, stats.failed_episodes) == (2, 0)
    trajs, rewards = published(bus)
    assert len(trajs) == 2 and all(t.traj_id in rewards for t in trajs)
    block = render_tools_prompt(agent.toolbox.specs())
    for t in trajs:
        # the recorded prompt is what the model saw: the tools block is in it
        assert block in server.svc.tokenizer.decode(t.prompt_ids)
        assert_turn_mask(t)


def test_runner_gives_up_after_consecutive_failures(proxy):
    """A broken agent command fails every episode: instead of an endless run in which
    the trainer never steps, the runner raises (the process exits 1) naming the cause."""
    server, _ = proxy
    agent = CommandAgent(command="python -c 'import sys; sys.exit(\"agent broke: no API\")'",
                         timeout_s=60)
    runner = AgentRunner(agent, records(50), base_url=server.base_url, admin_key=ADMIN,
                         group_size=2, run_tag="failtest", max_concurrent_groups=2,
                         max_consecutive_failures=4)
    with pytest.raises(AgentRunnerError, match="4 agent episodes failed in a row.*agent broke: no API"):
        runner.run()
    assert 4 <= runner.stats.failed_episodes <= 8 and runner.stats.groups_started < 10


def test_a_session_that_cannot_start_is_a_counted_failure(proxy):
    """POST /sessions refused (here: a record too large for proxy.max_request_bytes):
    the episode is counted as failed and logged, the group is not broken, and a streak
    of them stops the runner with the proxy's error."""
    server, _ = proxy
    big = [dict(r, note="x" * 2_000_000) for r in records(2)]
    runner = AgentRunner(MathAgent(max_turns=1, max_tokens=2), big, base_url=server.base_url,
                         admin_key=ADMIN, group_size=2, run_tag="starttest", max_concurrent_groups=1,
                         max_consecutive_failures=0)
    stats = runner.run()
    assert (stats.groups_done, stats.episodes, stats.failed_episodes) == (2, 4, 4)
    runner = AgentRunner(MathAgent(max_turns=1, max_tokens=2), big, base_url=server.base_url,
                         admin_key=ADMIN, group_size=2, run_tag="starttest2",
                         max_consecutive_failures=3)
    with pytest.raises(AgentRunnerError, match="ProxyRequestError: POST /sessions -> 413"):
        runner.run()
