"""docker-compose.yml cannot be run here (no docker daemon), so this checks what can be
checked without it: every service's `tapioca` command exists with the arguments it is
given, every role it names is a role, and the run config it reads loads and validates
with its dotted overrides."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]


def _services() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_every_compose_service_runs_an_existing_command_and_a_valid_config():
    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig
    from tapioca.ops.cli import app
    from tapioca.runtime.builders import ROLES

    runner = CliRunner()
    checked = []
    for name, svc in _services().items():
        cmd = svc.get("command")
        if not cmd or cmd[0] != "tapioca":
            continue
        args = cmd[1:]
        # `topics create` is a command group and its subcommand; `role NAME` takes the
        # role as an argument (checked against ROLES below).
        command = args[:2] if args[0] == "topics" else args[:1]
        result = runner.invoke(app, [*command, "--help"])
        assert result.exit_code == 0, f"service {name}: `tapioca {' '.join(command)}` is not a command"
        if "--config" in args:
            assert "--config" in result.output, f"service {name}: no --config option"
            i = args.index("--config")
            path = ROOT / args[i + 1].replace("/app/", "", 1)
            assert path.exists(), f"service {name} reads {args[i + 1]}, not in the repo"
            cfg = load_config(TrainConfig, str(path), [a for a in args[i + 2:] if "=" in a])
            assert cfg.bus.run_id == cfg.run_id, f"service {name}: bus.run_id is not the run's"
        if args[0] == "role":
            assert args[1] in ROLES, f"service {name}: no role {args[1]!r}"
        checked.append(name)
    # Every role has its service, plus the topic creator and the key maker.
    assert set(ROLES) | {"topics", "keygen"} <= set(checked)


def test_compose_binds_kafka_to_localhost_and_signs_the_run():
    """An unauthenticated Kafka on every interface lets anyone on the network command
    the fleet; the run's signing key comes from the keygen service."""
    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig

    services = _services()
    for mapping in services["kafka"]["ports"]:
        assert str(mapping).startswith("127.0.0.1:"), f"kafka published on all interfaces: {mapping}"
    key_path = services["keygen"]["command"][-1]
    for name, svc in services.items():
        cmd = svc.get("command") or []
        if "--config" in cmd:
            cfg = load_config(TrainConfig, str(ROOT / cmd[cmd.index("--config") + 1].replace("/app/", "", 1)))
            assert cfg.bus.signing_key_path == key_path, f"service {name} does not verify signatures"
            assert svc["depends_on"]["keygen"]["condition"] == "service_completed_successfully"


def test_vllm_profile_has_a_server_with_the_adapters_flags_and_a_rollout_using_it():
    from tapioca.engines.vllm_engine import vllm_command

    services = _services()
    server, rollout = services["vllm"], services["rollout-vllm"]
    assert server["profiles"] == rollout["profiles"] == ["vllm"]
    # The flags the adapter relies on are the ones `tapioca role rollout` launches with.
    launch = vllm_command("python", "/m", port=1, dtype="float32", max_num_seqs=1, extra_args=[])
    needed = ["--logprobs-mode", "processed_logprobs", "--enable-scale-out",
              "--generation-config", "vllm"]
    assert all(flag in launch for flag in needed)
    assert all(flag in server["command"] for flag in needed)
    assert server["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert "./runs:/app/runs" in server["volumes"]  # weights files at the roles' paths
    assert "rollout.engine=vllm" in rollout["command"]
    assert "rollout.server.urls=[http://vllm:8000]" in rollout["command"]
    assert rollout["depends_on"]["vllm"]["condition"] == "service_healthy"
