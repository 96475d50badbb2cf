"""`tapioca regenerate`: regenerate a logged trajectory and say whether it is identical.

Reads the trajectory (``--traj-id``) and its prompt's sampling overrides from the run's
archive (``--archive``, else ``<run dir>/archive`` when the archiver wrote one) or from
its topics on the broker (the run's ``bus`` section), then regenerates it with the run's
engine settings, the logged sampling seed and each logged version's weights file
(runtime/regenerate.py; docs/provenance.md says what is and is not reproducible).

Exit codes: 0 the token ids are identical (``--exact-logprobs``: the logprobs too, bit
for bit); 1 they differ, with the first differing output position; 2 the trajectory
cannot be regenerated (not found, no seed logged, a version's weights gone, ...).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from ..schemas.errors import CannotRegenerateError
from .cli_context import EXTRA_ARGS, OUTPUT_HELP, G, check_output, console, emit_json

app = typer.Typer()


def _find(run_dir: str, traj_id: str, archive: Optional[str]):
    """``(trajectory, prompt sampling overrides)`` from the archive or the broker."""
    from ..schemas.events import PromptEvent, TrajectoryEvent

    group_id = traj_id.rpartition(":")[0]
    traj, sampling = None, None
    where = archive or (str(Path(run_dir) / "archive") if (Path(run_dir) / "archive").is_dir() else None)
    if where:
        from ..bus.archive import iter_events

        for _, event in iter_events(where, topic=["trajectories", "prompts"]):
            if isinstance(event, TrajectoryEvent) and event.traj_id == traj_id:
                traj = event
            elif isinstance(event, PromptEvent) and event.group_id == group_id:
                sampling = dict(event.sampling)
        source = f"the archive {where}"
    else:
        from ..bus.reader import read_events
        from ..schemas.envelope import ANY_RUN
        from .cli_context import bus_config, run_dir_run_id

        G.run_dir = run_dir
        bus, run_id = bus_config(), run_dir_run_id()
        ours = [e for e in read_events(bus, "trajectories") if isinstance(e, TrajectoryEvent)
                and e.traj_id == traj_id and (run_id == ANY_RUN or e.run_id == run_id)]
        traj = ours[-1] if ours else None
        if traj is not None:
            prompts = [e for e in read_events(bus, "prompts") if isinstance(e, PromptEvent)
                       and e.group_id == group_id and e.run_id == traj.run_id]
            sampling = dict(prompts[-1].sampling) if prompts else None
        source = f"topic {bus.topic_prefix}.trajectories.v1 on {bus.bootstrap_servers}"
    if traj is None:
        raise CannotRegenerateError(f"no trajectory {traj_id!r} in {source}; ids are GROUP_ID:SAMPLE_INDEX "
                                    "(`tapioca tail trajectories` lists them), and a broker that stopped "
                                    "with its run keeps nothing: archive the run (archive.enabled)")
    return traj, sampling


@app.command("regenerate", context_settings=EXTRA_ARGS)
def regenerate_command(
    ctx: typer.Context,
    traj_id: str = typer.Option(..., "--traj-id", help="The trajectory to regenerate (GROUP_ID:INDEX)."),
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help="The run's directory "
                                          "(runs/EXPERIMENT/TRIAL): its config and weights."),
    archive: Optional[str] = typer.Option(None, "--archive", help="Read the trajectory from this "
                                          "archive (default: RUN_DIR/archive if present, else the broker)."),
    device: Optional[str] = typer.Option(None, "--device", help="Override rollout.device (the same "
                                         "device type is what reproduces)."),
    exact_logprobs: bool = typer.Option(False, "--exact-logprobs", help="Also require the logprobs "
                                        "bit for bit (they move in the last bits with the batch)."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Regenerate a logged trajectory from its prompt, sampling seed and versions' weights;
    exit 0 if the tokens are identical, 1 (with the first differing position) if not,
    2 if it cannot be regenerated. Extra arguments are dotted config overrides."""
    check_output(output)
    from transformers.utils import logging as hf_logging

    from ..config.loader import load_config
    from ..config.schema import TrainConfig
    from ..runtime.regenerate import regenerate

    hf_logging.disable_progress_bar()
    run_dir = run_dir or G.run_dir
    if not run_dir or not (Path(run_dir) / "config.yaml").is_file():
        raise CannotRegenerateError("pass --run-dir RUN_DIR, the directory `tapioca train` made "
                                    "(runs/EXPERIMENT/TRIAL, with its config.yaml and weights/)")
    cfg = load_config(TrainConfig, str(Path(run_dir) / "config.yaml"), list(ctx.args))
    traj, sampling = _find(run_dir, traj_id, archive)
    result, cmp = regenerate(cfg, traj, sampling, run_dir=run_dir, device=device)
    ok = cmp.identical and (cmp.logprobs_identical or not exact_logprobs)
    versions = sorted(set(traj.output_versions))
    report = {"traj_id": traj_id, "ok": ok, **cmp.as_dict(), "tokens": len(traj.output_ids),
              "regenerated_tokens": len(result.output_ids), "versions": versions,
              "sampling_seed": traj.sampling_seed}
    if output == "json":
        emit_json(report)
    elif cmp.identical:
        lp = ("bit for bit" if cmp.logprobs_identical else
              f"within {cmp.logprob_max_abs_diff:.3g} (not bit for bit: the batch differs, docs/provenance.md)")
        console.print(f"{traj_id}: identical, {len(traj.output_ids)} tokens of version(s) "
                      f"{', '.join(f'v{v}' for v in versions)}, seed {traj.sampling_seed}; logprobs {lp}")
    else:
        console.print(f"{traj_id}: differs at output position {cmp.first_difference} (logged token "
                      f"{cmp.logged_token}, regenerated {cmp.regenerated_token}); the logprobs before it "
                      f"differ by at most {cmp.logprob_max_abs_diff:.3g}")
    if not ok:
        sys.exit(1)
