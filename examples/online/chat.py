"""A terminal chat with the model an online run is training (examples/online/README.md).

    tapioca train --config examples/online/online_cpu.yaml          # in one terminal
    python examples/online/chat.py --run-dir runs/online/<trial>    # in another

Every conversation is one episode (a proxy session) under your fixed key, so starting
the next one (``/new``) ends and exports the previous one, as AReaL's OpenClaw does.
Rate this episode with ``/rate 1`` (or ``/rate -1``), or an ended one later, from
anywhere, with ``tapioca --run-dir RUN reward SESSION_ID VALUE``: an episode ended
without a reward waits on the log for one (``advantage.reward_timeout_s``). ``/new`` and
``/quit`` print the id of the episode they end.

Only the standard library and the ``openai`` SDK; lines on stdin work as well as a
person (``printf 'hello\\n/quit\\n' | python examples/online/chat.py --run-dir RUN``).
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import yaml


def endpoint(args) -> tuple[str, str]:
    """The proxy's base URL and admin key, from the run's config.yaml (written by
    `tapioca train`) unless given."""
    if args.proxy and args.admin_key:
        return args.proxy, args.admin_key
    cfg = yaml.safe_load((Path(args.run_dir) / "config.yaml").read_text())
    proxy = cfg["proxy"]
    key = proxy.get("api_key") or Path(proxy["api_key_file"]).read_text().strip()
    return args.proxy or f"http://{proxy['host']}:{proxy['port']}/v1", args.admin_key or key


def post(url: str, key: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), dict(exc.headers)


def start(proxy: str, admin: str, key: str) -> dict:
    """A new episode under ``key``; waits out a 429 (the staleness bound) or a 503
    (the proxy is still loading) for as long as Retry-After says."""
    while True:
        try:
            status, body, headers = post(f"{proxy}/sessions", admin, {"api_key": key})
        except OSError as exc:  # not listening yet
            print(f"(waiting for the proxy at {proxy}: {exc})", file=sys.stderr)
            time.sleep(2)
            continue
        if status == 200:
            return body
        if status in (429, 503):
            wait = int(headers.get("Retry-After", "5"))
            print(f"(the proxy says: {body['error']['message']}; retrying in {wait} s)",
                  file=sys.stderr)
            time.sleep(wait)
            continue
        raise SystemExit(f"error: the proxy refused the session (HTTP {status}): {body}")


def said(previous: dict | None) -> None:
    if previous:
        what = ("waits for its reward" if previous["reward_pending"] else
                previous["reason"] or "rewarded")
        print(f"[episode {previous['session_id']} ended: {what}]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", help="the run's directory (runs/EXPERIMENT/TRIAL)")
    p.add_argument("--proxy", help="the proxy's base URL (default: from the run's config)")
    p.add_argument("--admin-key", help="the proxy's admin key (default: the run's)")
    p.add_argument("--key", default=f"user-{getpass.getuser()}-terminal-chat",
                   help="your fixed key across episodes (16+ characters)")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    if not args.run_dir and not (args.proxy and args.admin_key):
        p.error("give --run-dir, or --proxy and --admin-key")
    proxy, admin = endpoint(args)
    session = start(proxy, admin, args.key)
    client = openai.OpenAI(base_url=proxy, api_key=args.key, max_retries=3)
    messages: list[dict] = []
    print(f"episode {session['session_id']} (policy version {session['policy_version']}); "
          "/new, /rate VALUE, /quit")
    for line in sys.stdin:
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/new"):
            if text == "/new":
                session = start(proxy, admin, args.key)  # ends and exports the previous one
                said(session["previous"])  # None if it had expired (proxy.session_ttl_s)
                messages = []
                print(f"episode {session['session_id']}")
                continue
            break
        if text.startswith("/rate"):  # this episode's reward, on its latest reply
            try:
                value = float(text.split()[1])
            except (IndexError, ValueError):
                print("[/rate VALUE, e.g. /rate 1]")
                continue
            target = session["session_id"]
            status, body, _ = post(f"{proxy}/sessions/{target}/reward", admin, {"reward": value})
            print(f"[{target}: {'rewarded' if status == 200 else body['error']['message']}]")
            continue
        messages.append({"role": "user", "content": text})
        out = client.chat.completions.create(model="tapioca", messages=messages,
                                             max_tokens=args.max_tokens)
        reply = out.choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        print(f"model: {reply}")
    status, ended, _ = post(f"{proxy}/sessions/{session['session_id']}/end", admin, {})
    if status == 200:
        said(ended)
        print(f"reward it later: tapioca --run-dir {args.run_dir or 'RUN'} reward "
              f"{session['session_id']} 1")


if __name__ == "__main__":
    main()
