"""Entry point of one role process: `tapioca role NAME --config FILE [key=value ...]`
(the launcher runs ``python -m tapioca.ops.role_main`` the same way)."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback

from ..bus.runner import RoleRunner
from ..config.loader import load_config
from ..config.schema import TrainConfig
from ..runtime.builders import ROLES, build_role
from ..runtime.run import resolve_run
from ..schemas.errors import ConfigError, TapiocaError


def run_role_process(role: str, config: str, overrides: list[str], member: int = 0) -> int:
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {role}-{member} %(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        cfg = load_config(TrainConfig, config, overrides)
        if not cfg.trial_name:
            # resolve_run would name a new trial by this process's start time: every role
            # process (and every restart of one) would be a run of its own.
            raise ConfigError(
                f"tapioca role {role}: the config names no trial, so its processes cannot agree "
                "on one run; set trial_name in the YAML or on the command line "
                "(trial_name=NAME), or pass the config.yaml that `tapioca train` wrote into "
                "the run directory")
        cfg = resolve_run(cfg, client_id=f"{cfg.run_id}-{role}-{member}")
        instance = build_role(role, cfg, member)
        runner = RoleRunner(instance, cfg.bus, member_id=f"{role}-{member}")
        runner.run()
        logging.info("stopped cleanly: %s", runner.stats)
        return 0
    except TapiocaError as exc:
        # ConfigError, CheckpointFormatError, ...: EXIT_CONFIG, which the launcher does not
        # retry and reports by this last "error:" line (schemas/errors.py).
        traceback.print_exc()
        sys.stderr.write(f"error: {exc}\n")
        return exc.exit_code
    except Exception:
        traceback.print_exc()
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tapioca role")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--config", required=True)
    parser.add_argument("--member", type=int, default=0)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    return run_role_process(args.role, args.config, args.overrides, args.member)


if __name__ == "__main__":
    sys.exit(main())
