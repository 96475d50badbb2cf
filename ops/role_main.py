"""Entry point of one role process: `tapioca role NAME --config FILE [key=value ...]`
(the launcher runs ``python -m tapioca.ops.role_main`` the same way).

Its exit status tells the launcher whether a restart can help (``EXIT_NO_RESTART``,
``EXIT_STORAGE``, ``EXIT_OOM``: no; an out-of-memory error gets the memory plan's advice,
ops/memory_check.py), and a failure's one-line reason also goes to the pipe the launcher
passed in ``$TAPIOCA_REASON_FD``: the role's log may be on the disk that is full."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from ..bus.runner import RoleRunner
from ..config.loader import load_config
from ..config.schema import TrainConfig
from ..runtime.builders import ROLES, build_role
from ..runtime.run import resolve_run
from ..schemas.errors import ConfigError, DeviceMemoryError, TapiocaError, out_of_memory_error, storage_error
from .launcher import REASON_FD_ENV


def _report(exc: BaseException, reason_fd: str) -> None:
    """The traceback and ``error: ...`` on stderr (the role's log) when it can be written,
    and the one line to the launcher's pipe (``reason_fd``) whatever the disk does."""
    line = str(exc).replace("\n", " ") if isinstance(exc, TapiocaError) else \
        f"{type(exc).__name__}: {exc}".replace("\n", " ")
    try:
        traceback.print_exc()
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()
    except OSError:  # the log is on a full disk: the pipe below still says why
        pass
    if reason_fd.isdigit():
        try:
            os.write(int(reason_fd), f"{line[:4000]}\n".encode())
        except OSError:
            pass


def run_role_process(role: str, config: str, overrides: list[str], member: int = 0) -> int:
    # The pipe is this process's alone: processes it starts do not inherit the fd.
    reason_fd = os.environ.pop(REASON_FD_ENV, "")
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {role}-{member} %(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cfg = None
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
    except Exception as exc:
        # A TapiocaError exits with its exit_code: EXIT_CONFIG (a config error, a checkpoint
        # format), EXIT_STORAGE (a full or failing disk, raised by the role or met here) and
        # EXIT_OOM (out of device memory) are not retried by the launcher (schemas/errors.py).
        err = storage_error(exc) or out_of_memory_error(exc) or exc
        if isinstance(err, DeviceMemoryError) and cfg is not None:
            # EXIT_OOM, not restarted: the line says what lowers the memory.
            from .memory_check import with_oom_advice

            err = with_oom_advice(err, cfg)
        _report(err, reason_fd)
        return err.exit_code if isinstance(err, TapiocaError) else 1


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
