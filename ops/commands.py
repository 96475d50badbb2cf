"""Commands that run roles: `tapioca demo` (and, as roles land, `train`)."""

from __future__ import annotations

import threading
import time

import typer

from tapioca.ops.cli import G, app, console


@app.command("demo")
def demo(
    events: int = typer.Option(1000, help="How many prompt events the bus smoke sends."),
) -> None:
    """Bus smoke on the embedded default: broker, topics, a role, a dead letter."""
    from tapioca.bus import BusConfig, EmbeddedBroker, EventProducer, Role, RoleRunner, ensure_topics
    from tapioca.ops.broker_state import resolve_bootstrap
    from tapioca.schemas import PromptEvent, RewardEvent, TapiocaError, topic

    class LengthScorer(Role):
        """Scores each prompt by its length: a stand-in until the RL loop lands."""

        name = "demo-scorer"
        group_inputs = ("prompts",)

        def init_state(self):
            return None

        def handle(self, event, state, source):
            yield RewardEvent(traj_id=event.group_id, group_id=event.group_id,
                              reward=len(event.prompt_ids) / 10, scorer="length")

    broker = None
    try:
        bootstrap = resolve_bootstrap(G.bootstrap)
    except TapiocaError:
        broker = EmbeddedBroker().start()
        bootstrap = broker.bootstrap
        console.print(f"embedded broker at {bootstrap}")
    try:
        cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=G.prefix, run_id="demo")
        ensure_topics(cfg)
        with EventProducer(cfg, "demo-feeder") as producer:
            t0 = time.perf_counter()
            for i in range(events):
                producer.publish(PromptEvent(group_id=f"demo-{i}", prompt_id=f"p{i}",
                                             group_index=i, n_samples=1,
                                             prompt_ids=list(range(i % 10 + 1))))
            producer.publish_raw(cfg.topic(topic("prompts")), b"bad", b"not an event")
            producer.flush()
        console.print(f"published {events} prompt events + 1 bad record "
                      f"in {time.perf_counter() - t0:.2f} s")
        runner = RoleRunner(LengthScorer(), cfg)
        thread = threading.Thread(target=runner.run, kwargs={"max_seconds": 120})
        thread.start()
        while runner.stats.consumed < events + 1 and thread.is_alive():
            time.sleep(0.2)
        runner.stop()
        thread.join()
        s = runner.stats
        console.print(f"role handled {s.handled}, produced {s.produced} rewards, "
                      f"dead-lettered {s.dead_lettered}, commits {s.commits}")
    finally:
        if broker is not None:
            broker.stop()
