"""An ordinary agent program: it knows nothing about Tapioca.

It uses only the official ``openai`` SDK, which reads ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` from the environment. Pointed at OpenAI it calls OpenAI; pointed at
a Tapioca proxy (base URL ``http://HOST:PORT/v1``, key = a session key) every call it
makes is recorded for training. Nothing in this file changes between the two.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... python openai_agent.py "max(3,7)="

It asks the question, checks the reply with a cheap self-check (a non-empty answer),
asks once more if the reply was empty, and prints the final answer on stdout.
"""

import os
import sys

from openai import OpenAI


def solve(client: OpenAI, model: str, question: str, max_tokens: int) -> str:
    messages = [{"role": "user", "content": question}]
    answer = ""
    for _ in range(2):
        reply = client.chat.completions.create(model=model, messages=messages,
                                               max_tokens=max_tokens, temperature=1.0)
        answer = (reply.choices[0].message.content or "").strip()
        if answer:
            break
        messages += [{"role": "assistant", "content": ""},
                     {"role": "user", "content": "Please answer."}]
    return answer


def main() -> None:
    question = sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read()
    client = OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    model = os.environ.get("OPENAI_MODEL") or client.models.list().data[0].id
    print(solve(client, model, question, int(os.environ.get("AGENT_MAX_TOKENS", "64"))))


if __name__ == "__main__":
    main()
