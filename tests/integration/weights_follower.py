"""A rollout worker process for test_weight_transport.py (not a test module).

Runs the real rollout role, built from the run's config by runtime/builders.py, under a
RoleRunner; each time its engine holds one of the target versions it writes the engine's
weights and its receiver's counters to ``OUT.v<N>.pt`` (torch.save), and after the last
target it stops and exits 0.

    python weights_follower.py OUT MEMBER 1,2 key=value ...   (TrainConfig overrides)
"""

from __future__ import annotations

import os
import sys
import threading
import time


def _engine_weights(engine) -> dict:
    """The engine's weights by HF name: the paged engine's fused tensors split back, or
    TorchEngine's model."""
    decoder = getattr(engine, "decoder", None)
    return decoder.hf_state_dict() if decoder is not None else engine.model.state_dict()


def main() -> int:
    out, member, targets, *overrides = sys.argv[1:]
    import torch

    from tapioca.bus import RoleRunner
    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig
    from tapioca.runtime.builders import build_role

    cfg = load_config(TrainConfig, None, overrides)
    role = build_role("rollout", cfg, int(member))
    runner = RoleRunner(role, cfg.bus, member_id=f"rollout-{member}")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            runner.run(max_seconds=400)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    for target in (int(v) for v in targets.split(",")):
        while role.engine.version < target:
            if errors or not thread.is_alive() or time.monotonic() > deadline:
                print(f"follower {member}: engine at version {role.engine.version}, waiting for "
                      f"{target}; runner errors: {errors}", file=sys.stderr)
                return 1
            time.sleep(0.02)
        receiver = role.load_weights.receiver
        dump = {"version": role.engine.version, "fast_loads": receiver.fast_loads,
                "file_loads": receiver.file_loads,
                "weights": {k: v.detach().clone() for k, v in _engine_weights(role.engine).items()}}
        tmp = f"{out}.v{target}.pt.tmp"
        torch.save(dump, tmp)
        os.replace(tmp, f"{out}.v{target}.pt")
    runner.stop()
    thread.join(30)
    role.load_weights.receiver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
