"""An SGLang server (0.5.23) as an InferenceEngine.

Consumes GenRequests and weights files; emits GenResults (shared machinery:
:mod:`tapioca.engines.server_engine`). The endpoints and shapes, checked against SGLang
0.5.23's source (``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``,
``srt/managers/tokenizer_manager.py``, ``srt/utils/weight_versions.py``):

- ``POST /generate`` ``{"rid", "input_ids", "sampling_params", "return_logprob": true}``
  -> ``{"output_ids", "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort",
  ...}, "output_token_logprobs": [[logprob, token_id, text|null], ...],
  "weight_version", "weight_versions": [{"version", "start", "end"}]}}`` (the spans are
  present once a request saw a version change);
- ``POST /pause_generation`` ``{"mode": "retract"}``: running requests go back to the
  waiting queue and recompute their KV cache after ``/continue_generation`` (so the
  cache can be flushed with the update; in-place pausing cannot flush);
- ``POST /update_weights_from_disk`` ``{"model_path": DIR, "weight_version",
  "abort_all_requests": false, "flush_cache": true}`` -> ``{"success", "message"}``;
- ``POST /continue_generation``;
- ``POST /update_weight_version`` ``{"new_version", "abort_all_requests": false}``;
- ``POST /abort_request`` ``{"rid"}`` (``{"abort_all": true}`` exists; not used, a
  server may serve other workers); ``GET /health``;
- LoRA runs (``actor.lora.enabled``; launched with ``--enable-lora --max-lora-rank R
  --max-loras-per-batch N --max-loaded-loras N --lora-target-modules ...``):
  ``POST /load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST
  /unload_lora_adapter`` ``{"lora_name"}`` -> ``{"success", "error_message",
  "loaded_adapters"}`` (``LoRAUpdateOutput``; HTTP 400 when not ``success``), and
  ``/generate`` carries ``"lora_path": <adapter name>``.

Behaviour logprobs: SGLang's default is ``log_softmax(logits / T)`` over the full
vocabulary, before top-p / top-k filtering (``srt/layers/sampler.py``), and greedy
requests get T = 1: exactly Tapioca's convention. Do not set
``SGLANG_RETURN_ORIGINAL_LOGPROB`` on the server (it drops the temperature).

Routed experts (MoE routing replay, R3): a server started with
``--enable-return-routed-experts`` (added when this role launches it with
``rollout.return_routed_experts`` or ``actor.moe.router_replay`` R3) answers a request that
sets ``"return_routed_experts": true`` with ``meta_info.routed_experts``: base64 of raw
int32 ids ``[prompt + output - 1, hidden layers, top_k]`` (SGLang's
``routed_experts_capturer.py``: one row per KV slot of the request but its last token),
cut here to the model's MoE layers.

Not run here: SGLang's CPU engine needs kernels only its source build has, so this
adapter is tested against those documented shapes (tests/unit/test_engine_sglang.py and
its fixtures), not a live server. Device-to-device updates
(``/init_weights_update_group`` + ``/update_weights_from_distributed``) are not wired
yet: every update reloads the weights file from disk.
"""

from __future__ import annotations

from pathlib import Path

from ..schemas.errors import EngineError
from .base import GenRequest
from .server_engine import RawOutput, RequestRejected, Server, ServerEngine


class SGLangEngine(ServerEngine):
    backend = "sglang"

    async def _check(self, server: Server) -> None:
        return None  # nothing in its server info tells the logprob mode (see above)

    def _validate_images(self, request: GenRequest) -> None:
        # A visual dataset with this engine is refused at start (config/features.py's
        # sglang_x_images); an image from elsewhere (a jsonl row, the proxy) is refused here.
        if request.images:
            raise EngineError(f"request {request.request_id!r} has images; the SGLang adapter sends "
                              "token ids only (images are not wired yet): use rollout.engine=torch "
                              "or vllm for a vision-language model")

    async def _generate(self, server: Server, request: GenRequest, lora: str | None = None) -> RawOutput:
        s = request.sampling
        params = {
            "max_new_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1,  # -1 = the whole vocabulary
            "stop_token_ids": sorted(set(s.stop_token_ids) | set(self.eos_token_ids)),
            "skip_special_tokens": False,
            "no_stop_trim": True,  # keep the stop string's tokens, as the torch engine does
        }
        if s.stop_strings:
            params["stop"] = list(s.stop_strings)
        body = {"rid": request.request_id, "input_ids": list(request.prompt_ids),
                "sampling_params": params, "return_logprob": True}
        if lora is not None:
            body["lora_path"] = lora  # a loaded adapter's name (GenerateReqInput.lora_path)
        if self.return_routed_experts:
            body["return_routed_experts"] = True
        out = await self._post(server, "/generate", json=body, timeout=self.cfg.request_timeout_s)
        raw = parse_generate(out, server.url)
        if self.return_routed_experts:
            raw.routed_experts = parse_routed_experts(out, self._num_layers, self._top_k, server.url)
        return raw

    async def _pause(self, server: Server) -> None:
        await self._post(server, "/pause_generation", json={"mode": "retract"})

    async def _load_lora(self, server: Server, name: str, path: str) -> None:
        res = await self._post(server, "/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                               timeout=self.cfg.request_timeout_s)
        if not isinstance(res, dict) or not res.get("success"):
            raise EngineError(f"SGLang server {server.url} failed to load adapter {name} from {path}: {res}")

    async def _unload_lora(self, server: Server, name: str) -> None:
        res = await self._post(server, "/unload_lora_adapter", json={"lora_name": name})
        if not isinstance(res, dict) or not res.get("success"):
            raise RequestRejected(f"SGLang server {server.url} did not unload adapter {name}: {res}")

    async def _resume(self, server: Server) -> None:
        await self._post(server, "/continue_generation", json={})

    async def _reload(self, server: Server, stage: Path, version: int) -> None:
        res = await self._post(server, "/update_weights_from_disk", json={
            "model_path": str(stage), "weight_version": str(version),
            "abort_all_requests": False, "flush_cache": True},
            timeout=self.cfg.request_timeout_s)
        if not isinstance(res, dict) or not res.get("success"):
            raise EngineError(f"SGLang server {server.url} failed to load {stage}: {res}")

    async def _set_version(self, server: Server, version: int) -> None:
        await self._post(server, "/update_weight_version",
                         json={"new_version": str(version), "abort_all_requests": False})

    async def _abort(self, server: Server, request_ids: list[str]) -> None:
        for rid in request_ids:  # by id: the server may serve other workers too
            await self._post(server, "/abort_request", json={"rid": rid})


def parse_generate(out: dict, url: str = "") -> RawOutput:
    """A ``/generate`` response (one prompt, not streamed) as a RawOutput."""
    try:
        meta = out["meta_info"]
        ids = [int(t) for t in out.get("output_ids") or []]
        logprobs = [float(e[0]) for e in meta.get("output_token_logprobs") or []]
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        spans = [(str(w["version"]), int(w["start"]), int(w["end"]))
                 for w in meta.get("weight_versions") or []]
        if not spans and meta.get("weight_version") is not None:
            spans = [(str(meta["weight_version"]), 0, len(ids))]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineError(f"SGLang server {url} answered /generate with an unexpected shape "
                          f"({exc!r}): {str(out)[:300]}") from None
    return RawOutput(ids, logprobs, kind or "abort", spans or None)


def parse_routed_experts(out: dict, num_layers: int, top_k: int, url: str = ""):
    """``meta_info.routed_experts`` (base64 int32) as ``[tokens, num_layers, top_k]``, or
    None when the server sent none. The token count is what the ids' size says; a size
    that is no whole number of tokens comes back flat (``[1, 1, n]``: the engine refuses
    that shape and counts it)."""
    import base64
    import binascii

    import numpy as np

    text = (out.get("meta_info") or {}).get("routed_experts")
    if not text:
        return None
    try:
        flat = np.frombuffer(base64.b64decode(text), dtype="<i4")
    except (binascii.Error, ValueError) as exc:
        raise EngineError(f"SGLang server {url} sent routed_experts that are not base64 int32: {exc}") from None
    per_token = num_layers * top_k
    if per_token < 1 or flat.size % per_token:
        return flat.reshape(1, 1, -1)
    return flat.reshape(-1, num_layers, top_k)


def sglang_command(python: str, model_path: str, *, port: int, dtype: str, max_num_seqs: int,
                   device: str, version: int, extra_args: list[str],
                   return_routed_experts: bool = False,
                   tensor_parallel_size: int = 1) -> list[str]:
    """The launch command of an SGLang server with the flags Tapioca relies on."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--max-running-requests", str(max_num_seqs), "--weight-version", str(version)]
    if device == "cpu":
        cmd += ["--device", "cpu"]
    if return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if tensor_parallel_size > 1:
        cmd += ["--tp-size", str(tensor_parallel_size)]
    return cmd + list(extra_args)
