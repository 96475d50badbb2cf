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
class RoutedExperts:
    """The top-k expert ids a mixture-of-experts model routed each token to, in each of
    its MoE layers, during one generation (rollout routing replay, R3; docs/models.md).

    Tokens are those the engine fed through the model: ``prompt_ids + output_ids`` but
    the last sampled token, so ``num_tokens = len(prompt_ids) + len(output_ids) - 1`` (vLLM's
    and SGLang's convention). The ids are one little-endian array ``[num_tokens,
    num_layers, top_k]``, token-major, of ``dtype`` (uint8 when the model has at most 256
    experts, else uint16): 48 MoE layers x top-8 are 384 bytes a token in uint8 (512 in
    base64). ``num_layers`` counts MoE layers only, in layer order. The bytes are on the
    event (``data_b64``) or, beyond the writer's inline limit, in the run's blob store
    under ``blob_sha256``, the hex SHA-256 of the raw bytes (:mod:`tapioca.media.store`);
    exactly one of the two is set."""

    num_tokens: int
    num_layers: int
    top_k: int
    dtype: Literal["uint8", "uint16"] = "uint8"
    data_b64: str = ""
    blob_sha256: str = ""

    @property
    def num_bytes(self) -> int:
        """Bytes of the raw array (before base64)."""
        return self.num_tokens * self.num_layers * self.top_k * (1 if self.dtype == "uint8" else 2)

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_layers", "top_k"):
            value = getattr(self, name)
            if type(value) is not int or value < (0 if name == "num_tokens" else 1):
                raise SchemaError(f"routed_experts.{name} is {value!r}; it counts "
                                  f"{'tokens (>= 0)' if name == 'num_tokens' else name + ' (>= 1)'}")
        if self.dtype not in ("uint8", "uint16"):
            raise SchemaError(f"routed_experts.dtype {self.dtype!r}: expected one of uint8, uint16")
        inline, blob = bool(self.data_b64), bool(self.blob_sha256)
        if inline == blob and self.num_bytes:
            raise SchemaError("routed_experts needs exactly one of data_b64 (the ids inline) and "
                              f"blob_sha256 (their blob), got {'both' if inline else 'neither'}")
        if blob and not (len(self.blob_sha256) == 64
                         and all(c in "0123456789abcdef" for c in self.blob_sha256)):
            raise SchemaError(f"routed_experts.blob_sha256 {self.blob_sha256[:80]!r} is not 64 "
                              "lowercase hex digits (the SHA-256 of the ids' bytes)")
        want = 4 * ((self.num_bytes + 2) // 3)  # base64 of num_bytes bytes, padded
        if inline and len(self.data_b64) != want:
            raise SchemaError(
                f"routed_experts.data_b64 has {len(self.data_b64)} characters, but {self.num_tokens} "
                f"tokens x {self.num_layers} layers x top-{self.top_k} in {self.dtype} are "
                f"{self.num_bytes} bytes, {want} in base64")


def check_routed_tokens(routes: "RoutedExperts | None", prompt_len: int, output_len: int,
                        where: str) -> None:
    """Routes must cover every token the engine fed: prompt + output - 1."""
    if routes is None:
        return
    want = max(0, prompt_len + output_len - 1)
    if routes.num_tokens != want:
        raise SchemaError(
            f"{where}: routed_experts covers {routes.num_tokens} tokens, but {prompt_len} prompt + "
            f"{output_len} output tokens need {want} (every token but the last sampled one)")


@dataclass(kw_only=True)
class PromptEvent(Event):
    """One prompt to be completed ``n_samples`` times (a GRPO group).

    ``group_index`` is the feeder's own sequence number k of this group; the head gate
    (docs/design.md#3-policy-versions-and-the-staleness-window) recovers it from the last
    prompt event after a restart.
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
    # from progress.v1 up to offset ``progress_offset`` (-1: none).
    freed_groups: int = 0
    # Deprecated: the weights.v1 offset older feeders counted rejections through (they
    # read them from weights events); no longer written (-1), read as -1 by this feeder.
    weights_offset: int = -1
    progress_offset: int = -1
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
    # Agent proxy: the session this trajectory came from ("" otherwise), and what a reward
    # given to the whole session after it ended (``POST /v1/sessions/{id}/reward``,
    # ``tapioca reward``) is multiplied by for this trajectory: AReaL's turn discount,
    # ``discount ** (completions after this trajectory's last one)``.
    session_id: str = ""
    delayed_reward_factor: float = 1.0
    # The experts every token was routed to in every MoE layer (rollout.return_routed_experts;
    # None: not recorded). The trainer replays them with actor.moe.router_replay R3.
    routed_experts: Optional[RoutedExperts] = None
    # The sampling seed of the one generation request that produced output_ids (the paged
    # engine keys each draw by (seed, token position); `tapioca regenerate` replays it,
    # docs/provenance.md). None: not recorded (an engine without per-request seeds, a
    # proxy trajectory made of several requests, an event from before the field).
    sampling_seed: Optional[int] = None

    def validate(self) -> None:
        super().validate()
        check_routed_tokens(self.routed_experts, len(self.prompt_ids), len(self.output_ids),
                            f"trajectory {self.traj_id}")


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
    # The rollout's routes over the group's prompt_ids + this output_ids (copied from the
    # TrajectoryEvent; None: not recorded). The trainer checks them (sample_checks.py).
    routed_experts: Optional[RoutedExperts] = None


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
    # Seconds from the group's last trajectory to its last reward (producers' clocks,
    # ``produced_at``; 0 when a reward came first): how late its rewards came.
    reward_delay_s: float = 0.0

    def validate(self) -> None:
        super().validate()
        for seq in self.sequences:
            check_routed_tokens(seq.routed_experts, len(self.prompt_ids), len(seq.output_ids),
                                f"group {self.group_id} sequence {seq.traj_id}")


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
class WeightsAdapter:
    """A LoRA version (``actor.lora.enabled``): the event's bytes are an adapter for the base
    model ``base_id`` names, not whole weights. ``name`` is the version's adapter name
    (``{gconfig.lora_name}-v{version}``); with the ``file`` transport ``path`` is a PEFT
    adapter directory of that name (``adapter_model.safetensors`` + ``adapter_config.json``)
    and ``sha256`` covers both files (weights/adapter_files.py). A reader on another base,
    or serving other target modules or a lower maximum rank, refuses the event."""

    name: str
    peft_type: str = "lora"
    rank: int
    alpha: float
    # The short names of the wrapped modules (q_proj, ..., down_proj), sorted.
    target_modules: list[str]
    # The base model's identity: a digest of its safetensors files' headers and bytes
    # (weights/base_id.py), computed alike by the trainer and by every reader.
    base_id: str


@dataclass(kw_only=True)
class WeightsEvent(Event):
    """The bytes of policy version ``version``: where they are and how to check them.
    Keyed by ``run_id`` on one partition, so versions are read in order.

    ``transport`` says how the bytes reach an engine. ``file``: the safetensors file
    ``path`` (``sha256`` of the file); ``ipc``: a shared buffer on this host (CUDA IPC or
    a shared-memory file, ``transport_info``); ``nccl``: pulled from the trainer over a
    process group (nccl, or gloo on CPU) whose rendezvous is ``transport_info["store"]``.
    Fast transports carry the buffer's ``tensors``, ``data_bytes`` and one checksum per
    ``bucket_bytes`` of it (weights/layout.py); their ``path``/``sha256`` are empty until
    the background writer has written this version's file (then a later event lists it
    in ``files``).

    The trainer publishes one per new version and, for a version already published,
    again only to say "a durable file for this version is ready" (``files``, or its
    ``path`` once written) or, at its start, to name its current version's bytes; a
    repeat carries no other news. What the trainer made of the groups it read (trained,
    rejected) and the counts of the head gate are on ``progress.v1``
    (:class:`ProgressEvent`). The fields that carried them here (``group_ids``,
    ``groups_rejected``, ``rejected_group_ids``, ``rollbacks``, ``base_steps``,
    ``base_rejected``) are deprecated: still decoded (an archive from before keeps them),
    no longer written (left at their defaults)."""

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
    # Set when an operator republishes an older version as current: this version's
    # bytes are those of version ``rollback_of``.
    rollback_of: Optional[int] = None
    # --- deprecated: on progress.v1 now (ProgressEvent); not written, still decoded ---
    group_ids: list[str] = field(default_factory=list)
    groups_rejected: int = 0
    rejected_group_ids: list[str] = field(default_factory=list)
    rollbacks: int = 0
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
    # actor.lora.enabled: the bytes are this adapter (None: the whole weights).
    adapter: Optional[WeightsAdapter] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.step == 0:  # the deprecated field (see ``step``)
            self.step = self.version


@dataclass(kw_only=True)
class ProgressEvent(Event):
    """The trainer's progress: its version and what it made of every group it read.

    Keyed by ``run_id`` on ``progress.v1`` (one partition, so it is read in order). The
    trainer publishes one with every new version (a training step, a rollback, a resume
    above the log), one whenever the groups it rejected change, and one at its start.
    The head gates (the prompt feeder, the agent proxy) read this topic only, and the
    feeder recovers its count of freed slots by offset on it (algorithms/head_gate.py,
    producers/feeder.py). Where the version's bytes are is on ``weights.v1``.
    """

    TYPE: ClassVar[str] = "progress"

    version: int
    # The groups trained to make ``version`` (every progress event of a version names
    # them; a rollback's version trained none). With ``rejected_group_ids``, every group
    # the trainer read has its fate on the log (audit: no group is trained twice).
    group_ids: list[str] = field(default_factory=list)
    # Groups the trainer has rejected so far in this run (over-stale, filtered,
    # dead-lettered): shown, not trusted, by the feeder, which frees slots by name.
    groups_rejected: int = 0
    # The groups rejected since the trainer's previous progress event (a restarted
    # trainer names its last ones again; readers de-duplicate by id).
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
