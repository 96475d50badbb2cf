"""Typed events, one class per kind of fact on the log.

Plain data only: no tokenizers, clients or tensors. Fields are only ever added, with
defaults (bumping ``SCHEMA_VERSION``); a breaking change is a new ``.v2`` topic.
Which topic each event goes to, and the key it is partitioned by, is in
:mod:`tapioca.schemas.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from .envelope import Event
from .errors import SchemaError


@dataclass(kw_only=True)
class ImageRef:
    """One image by content address (docs/vlm.md): its encoded bytes (PNG, JPEG, WebP,
    GIF or BMP as sent) are in the run's image store under ``sha256``, the hex SHA-256 of
    those bytes. ``width`` / ``height``: its pixels as decoded, before any resize.
    ``data_b64``: the same bytes in base64, also on the event when they are at most
    ``vlm.inline_image_max_bytes`` (a reader needs no store for those); empty otherwise.
    An event lists its images in the order of their placeholders in its tokens."""

    sha256: str
    mime: str = "image/png"
    width: int = 0
    height: int = 0
    data_b64: str = ""

    def __post_init__(self) -> None:
        h = self.sha256
        if not (isinstance(h, str) and len(h) == 64 and all(c in "0123456789abcdef" for c in h)):
            raise SchemaError(f"image sha256 {str(h)[:80]!r} is not 64 lowercase hex digits (the "
                              "SHA-256 of the image's bytes)")


@dataclass(kw_only=True)
class PromptEvent(Event):
    """One prompt to be completed ``n_samples`` times (a GRPO group).

    ``group_index`` is the feeder's own sequence number k of this group; the head gate
    (DESIGN.md §3) recovers it from the last prompt event after a restart.
    """

    TYPE: ClassVar[str] = "prompt"

    group_id: str
    prompt_id: str
    group_index: int
    n_samples: int
    prompt_ids: list[int]
    prompt_text: str = ""
    epoch: int = 0
    dataset_position: int = 0
    task: str = ""
    # What a reward needs (e.g. the reference answer); free-form, JSON-serialisable.
    task_data: dict[str, Any] = field(default_factory=dict)
    # Per-prompt overrides of the rollout sampling config (temperature, max_new_tokens, ...).
    sampling: dict[str, Any] = field(default_factory=dict)
    # Latest policy version the feeder had seen when it admitted this group.
    admitted_at_version: int = 0
    # The feeder's own bookkeeping, recovered from its last prompt event at a restart:
    # how many of its groups the trainer had rejected (freeing head-gate slots), counted
    # from weights.v1 up to offset ``weights_offset`` (-1: none).
    freed_groups: int = 0
    weights_offset: int = -1
    # The prompt's images, in the order of their placeholders in prompt_ids (empty: text).
    images: list[ImageRef] = field(default_factory=list)


@dataclass(kw_only=True)
class TrajectoryEvent(Event):
    """One completion of one prompt, with everything training and auditing need.

    ``output_versions[t]`` is the policy version that generated output token t (a
    sequence may span versions under interruptible generation). ``loss_mask[t]`` is 1
    for tokens the model produced and should be trained on, 0 for tool / user tokens;
    empty means all ones. ``turn_boundaries`` are output-token offsets where turns start.
    """

    TYPE: ClassVar[str] = "trajectory"
    _same_length: ClassVar[tuple[str, ...]] = (
        "output_ids", "output_logprobs", "output_versions", "loss_mask",
    )
    _optional_arrays: ClassVar[tuple[str, ...]] = ("loss_mask",)

    traj_id: str
    group_id: str
    prompt_id: str
    sample_index: int
    group_size: int
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    loss_mask: list[int] = field(default_factory=list)
    turn_boundaries: list[int] = field(default_factory=list)
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] = "stop"
    output_text: str = ""
    task: str = ""
    task_data: dict[str, Any] = field(default_factory=dict)
    group_index: int = 0
    # Wall-clock facts, seconds: queued_s, generate_s, ...
    timings: dict[str, float] = field(default_factory=dict)
    # The images of prompt_ids + output_ids, in the order of their placeholders.
    images: list[ImageRef] = field(default_factory=list)


@dataclass(kw_only=True)
class RewardEvent(Event):
    """A scalar reward for one trajectory from one scorer (built-in or external).

    Keyed by ``group_id`` so rewards land on the partition of their group. The group
    advantage processor takes the first reward it sees for each ``traj_id`` (later ones,
    redeliveries included, change nothing).
    """

    TYPE: ClassVar[str] = "reward"

    traj_id: str
    group_id: str
    reward: float
    scorer: str = "default"
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class SampleSequence:
    """One trajectory of a training-ready group, with its reward and advantage."""

    _same_length: ClassVar[tuple[str, ...]] = (
        "output_ids", "behav_logprobs", "output_versions", "loss_mask",
    )
    _optional_arrays: ClassVar[tuple[str, ...]] = ("loss_mask",)

    traj_id: str
    output_ids: list[int]
    behav_logprobs: list[float]
    output_versions: list[int]
    reward: float
    advantage: float
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    # Output-token offsets where turns start (copied from the TrajectoryEvent); the
    # trainer's turn-level GAE uses them. Empty: turns are the runs of loss_mask 1.
    turn_boundaries: list[int] = field(default_factory=list)
    # The reward after advantage.reward_norm, the value the estimator (and the trainer's
    # GAE) used; ``reward`` stays the shaped, un-normalised reward. None: no reward_norm.
    norm_reward: Optional[float] = None
    # The images of the sample's prompt_ids + this output_ids, in placeholder order
    # (copied from the TrajectoryEvent); the trainer recomputes the pixels from the bytes.
    images: list[ImageRef] = field(default_factory=list)


@dataclass(kw_only=True)
class SampleEvent(Event):
    """A complete group, shaped and normalised, ready for the trainer.

    ``min_version`` is the oldest policy version of any token in the group: the
    trainer's tail gate compares it with its own version.
    """

    TYPE: ClassVar[str] = "sample"

    group_id: str
    prompt_id: str
    prompt_ids: list[int]
    sequences: list[SampleSequence]
    group_index: int = 0
    min_version: int = 0
    max_version: int = 0
    estimator: str = "grpo"
    # The processor's effective normalisation (NormConfig.spec(), e.g. "mean=group
    # std=group leave1out=0 unbiased=0 eps=1e-06"); the trainer refuses a mismatch with
    # its own. Empty (events from before this field): not compared.
    adv_norm: str = ""
    # The processor's reward normalisation (advantage.reward_norm as NormConfig.spec(),
    # "none" when off); the trainer refuses a mismatch. Empty (older events): not compared.
    reward_norm: str = ""
    task: str = ""
    # Non-empty: the group is not for training (e.g. "timeout: 7 of 8 rewards"). The
    # trainer counts it as rejected, which frees its slot in the feeder's head gate.
    dropped_reason: str = ""


@dataclass(kw_only=True)
class WeightTensor:
    """One tensor of a flat weights buffer: its bytes are ``[offset, offset + nbytes)``
    of the buffer (the safetensors data section's order; no gaps)."""

    name: str
    dtype: str  # a torch dtype name: bfloat16, float32, ...
    shape: list[int]
    offset: int


@dataclass(kw_only=True)
class WeightsFile:
    """A durable weights file (safetensors) written after its version was published."""

    version: int
    path: str
    sha256: str
    num_bytes: int = 0


@dataclass(kw_only=True)
class WeightsEvent(Event):
    """Policy version ``version`` is ready; ``transport`` says how its bytes reach an
    engine. Keyed by ``run_id`` on one partition, so versions are read in order.

    ``file``: the safetensors file ``path`` (``sha256`` of the file); ``ipc``:
    a shared buffer on this host (CUDA IPC or a shared-memory file, ``transport_info``);
    ``nccl``: pulled from the trainer over a process group (nccl, or gloo on CPU) whose
    rendezvous is ``transport_info["store"]``. Fast transports carry the buffer's
    ``tensors``, ``data_bytes`` and one checksum per ``bucket_bytes`` of it
    (models/weight_sync/layout.py); their ``path``/``sha256`` are empty until the
    background writer has written this version's file (then a later event lists it in
    ``files``)."""

    TYPE: ClassVar[str] = "weights"

    version: int
    path: str
    sha256: str
    num_bytes: int = 0
    # The durable file's format; how this version travels is ``transport``.
    format: Literal["safetensors", "nccl"] = "safetensors"
    # Deprecated: always equal to ``version``; read ``version``. Writers may leave it out
    # (0): it is filled in from ``version``, so it stays on the wire for readers of the
    # older schema, and a value read from an older event is kept as it was.
    step: int = 0
    # Set when an operator republishes an older version as current.
    rollback_of: Optional[int] = None
    # Groups trained to make this version (audit: no group is trained twice).
    group_ids: list[str] = field(default_factory=list)
    # Groups the trainer has rejected so far in this run (over-stale or filtered). The
    # feeder's head gate frees their slots; the trainer re-announces its current version
    # when this count changes, so the gate never waits on groups that will not come.
    groups_rejected: int = 0
    # The groups rejected since the trainer's previous weights event: with group_ids,
    # every group the trainer read has its fate on the log.
    rejected_group_ids: list[str] = field(default_factory=list)
    # Versions so far (this one included) that were rollbacks, not training steps: the
    # head gate counts trained steps, version - rollbacks (algorithms/head_gate.py).
    rollbacks: int = 0
    # Trained steps (version - rollbacks) and rejected groups of this run made before
    # this run id's log began: a run resumed on a broker that lost its log gets a new
    # run id (ops/launcher.py), its producers number groups from 0 again, and the head
    # gate counts only what happened on this log (algorithms/head_gate.py).
    base_steps: int = 0
    base_rejected: int = 0
    # --- weight transports (docs/weight-sync.md) ---
    transport: Literal["file", "ipc", "nccl"] = "file"
    # What a reader of a fast transport needs besides the layout: ipc: the slot and the
    # CUDA IPC handle (or the shared-memory file); nccl: the store address and session.
    transport_info: dict[str, Any] = field(default_factory=dict)
    tensors: list[WeightTensor] = field(default_factory=list)
    data_bytes: int = 0
    bucket_bytes: int = 0
    # One checksum per bucket of the (4 KiB-padded) buffer, computed where the bytes are.
    bucket_checksums: list[str] = field(default_factory=list)
    # Durable files (any version) the background writer finished since the previous
    # weights event: what `tapioca weights list` and rollback read their sha256 from.
    files: list[WeightsFile] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.step == 0:  # the deprecated field (see ``step``)
            self.step = self.version


@dataclass(kw_only=True)
class ControlEvent(Event):
    """An operator command (pause / resume / drain / ...) to a role, a member, or all."""

    TYPE: ClassVar[str] = "control"

    command_id: str
    command: str
    target: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class ControlAckEvent(Event):
    """A target's acknowledgement of a control command."""

    TYPE: ClassVar[str] = "control_ack"

    command_id: str
    target: str
    member_id: str
    ok: bool = True
    message: str = ""


@dataclass(kw_only=True)
class FleetEvent(Event):
    """A heartbeat / status report of one running member of a role."""

    TYPE: ClassVar[str] = "fleet"

    member_id: str
    role: str
    status: Literal["starting", "running", "paused", "draining", "stopped", "failed"] = "running"
    host: str = ""
    pid: int = 0
    policy_version: int = 0
    rates: dict[str, float] = field(default_factory=dict)
    lag: dict[str, int] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class MetricsEvent(Event):
    """Scalar metrics of one role at one step (trainer step, rollout window, ...)."""

    TYPE: ClassVar[str] = "metrics"

    source: str
    step: int
    metrics: dict[str, float]
    policy_version: int = 0


@dataclass(kw_only=True)
class DlqRecord(Event):
    """An event a consumer could not decode or handle.

    The same coordinates are in the Kafka headers (``tapioca.error``,
    ``tapioca.source_topic``, ``tapioca.source_partition``, ``tapioca.source_offset``).
    ``payload_b64`` holds the original bytes (truncated past the size limit, then
    ``payload_truncated``), so ``tapioca dlq retry`` can republish it.
    """

    TYPE: ClassVar[str] = "dlq"

    source_topic: str
    source_partition: int
    source_offset: int
    error: str
    error_type: str
    consumer_group: str = ""
    source_key: Optional[str] = None
    payload_b64: str = ""
    payload_truncated: bool = False
    attempts: int = 1
