"""An ordinary vision agent: it knows nothing about Tapioca.

It uses only the official ``openai`` SDK (``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` from the
environment) and sends its images inline, as ``data:`` URLs in ``image_url`` content
parts, the way the OpenAI API takes them. Pointed at a Tapioca proxy with a session key,
every call is recorded for training, images included (stored by sha256, docs/vlm.md).

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=<session key> \\
        python openai_vision_agent.py "color?" square.png [more.png ...]

All images go in one user message before the question; it prints the model's answer.
"""

import base64
import mimetypes
import os
import sys

from openai import OpenAI


def image_part(path: str) -> dict:
    mime = mimetypes.guess_type(path)[0] or "image/png"
    with open(path, "rb") as f:
        b64 = base64.b64encode(f.read()).decode("ascii")
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64}"}}


def main() -> None:
    question, paths = sys.argv[1], sys.argv[2:]
    client = OpenAI(max_retries=0)
    model = os.environ.get("OPENAI_MODEL") or client.models.list().data[0].id
    content = [image_part(p) for p in paths] + [{"type": "text", "text": question}]
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                           max_tokens=int(os.environ.get("AGENT_MAX_TOKENS", "8")),
                                           temperature=1.0)
    print((reply.choices[0].message.content or "").strip())


if __name__ == "__main__":
    main()
