"""How a training episode wraps an unmodified agent program, with nothing but the
standard library: open a session on the proxy, run the program with the session's key
as its OpenAI key, score its answer, post the reward, end the session.

    python examples/agents/session_wrapper.py --proxy http://127.0.0.1:8000/v1 \
        --admin-key $TAPIOCA_PROXY_KEY --question "max(3,7)=" --answer 7 \
        -- python examples/agents/openai_agent.py

``tapioca train`` with ``agent.workflow=command`` does the same for every prompt of
the dataset, ``gconfig.n_samples`` sessions per prompt sharing a ``group_id``
(``tapioca.agents.runner``). Here a single session is its own group of one; pass
``--group-id`` and ``--group-size`` to several calls to build a GRPO group by hand.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request


def post(url: str, key: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as resp:  # waits while the gate is shut
        return json.loads(resp.read())


def wait_ready(proxy: str, key: str, wait_s: float) -> None:
    """The proxy takes a while to load its model after `tapioca train` starts it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            req = urllib.request.Request(f"{proxy}/models", headers={"Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(req, timeout=10):
                return
        except urllib.error.HTTPError:
            raise  # it answers, but refuses (a wrong admin key): main() says so
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"error: no proxy answered at {proxy} within {wait_s:.0f} s")
            time.sleep(1.0)


def refused(exc: urllib.error.HTTPError, proxy: str) -> str:
    """One line for a request the proxy refused: its own message, and what to do."""
    try:
        message = json.loads(exc.read()).get("error", {}).get("message", "")
    except (ValueError, AttributeError, OSError):
        message = ""
    line = f"error: the proxy at {proxy} refused {exc.url.removeprefix(proxy)} (HTTP {exc.code}"
    line += f": {message})" if message else ")"
    if exc.code in (401, 403):
        line += ("; pass the proxy's admin key with --admin-key or $TAPIOCA_PROXY_KEY (a run of "
                 "`tapioca train` keeps it in RUN_DIR/secrets/proxy-admin.key, or proxy.api_key)")
    return line


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--proxy", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--admin-key", default=os.environ.get("TAPIOCA_PROXY_KEY", ""))
    ap.add_argument("--question", required=True)
    ap.add_argument("--answer", required=True)
    ap.add_argument("--task", default="synthetic")
    ap.add_argument("--group-id", default=None)
    ap.add_argument("--group-size", type=int, default=1)
    ap.add_argument("--sample-index", type=int, default=None)
    ap.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for the proxy")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = [c for c in args.command if c != "--"]
    if not command:
        ap.error("give the agent program after --, e.g. -- python examples/agents/openai_agent.py")

    # Errors are one line (what failed and what to do), never a stack trace.
    try:
        episode(args, command)
    except urllib.error.HTTPError as exc:
        raise SystemExit(refused(exc, args.proxy)) from None
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or "").strip().splitlines()[-1:] or [""]
        raise SystemExit(f"error: the agent program {exc.cmd[0]!r} exited with code "
                         f"{exc.returncode}" + (f": {tail[0]}" if tail[0] else "")) from None
    except OSError as exc:
        raise SystemExit(f"error: cannot reach the proxy at {args.proxy}: {exc}") from None


def episode(args: argparse.Namespace, command: list[str]) -> None:
    wait_ready(args.proxy, args.admin_key, args.wait_s)
    # 1. A session: its api_key is an OpenAI key that only reaches this session.
    session = post(f"{args.proxy}/sessions", args.admin_key, {
        "group_id": args.group_id, "group_size": args.group_size,
        "sample_index": args.sample_index, "task": args.task,
        "task_data": {"answer": args.answer}})
    sid, key = session["session_id"], session["api_key"]

    # 2. The unmodified program, pointed at the proxy by its environment only.
    env = {**os.environ, "OPENAI_BASE_URL": args.proxy, "OPENAI_API_KEY": key}
    try:
        out = subprocess.run(command + [args.question], env=env, capture_output=True, text=True,
                             check=True).stdout.strip()
    except OSError as exc:  # before the OSError of an unreachable proxy, in main()
        raise SystemExit(f"error: cannot run the agent program {command[0]!r}: {exc}") from None

    # 3. Score it (here: exact match of the first line) and hand the reward back.
    reward = 1.0 if out.splitlines()[0:1] == [args.answer] else 0.0
    post(f"{args.proxy}/sessions/{sid}/reward", key, {"reward": reward, "completion_id": None})
    ended = post(f"{args.proxy}/sessions/{sid}/end", key, {"mode": "concat", "discount": None})
    print(json.dumps({"answer": out, "reward": reward, "group_id": session["group_id"],
                      "policy_version": session["policy_version"], **ended}))


if __name__ == "__main__":
    sys.exit(main())
