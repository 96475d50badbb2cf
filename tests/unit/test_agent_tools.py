"""The agent tools: the Python sandbox enforces its limits (wall time, CPU time, memory,
file size, working directory, isolated mode, no network, its own processes) and reports
exceptions (its file system and process cap: test_agent_sandbox.py); the calculator
evaluates arithmetic and refuses everything else without calling eval."""

from __future__ import annotations

import json
import os

import pytest

from tapioca.agents.tools import Calculator, PythonExecutor, Toolbox, ToolError
from tapioca.schemas.errors import ConfigError


@pytest.fixture(scope="module")
def py():
    return PythonExecutor(timeout_s=2.0, memory_mb=256, max_output_chars=500)


def test_python_prints_and_exits_zero(py):
    r = py.run("x = sum(range(10))\nprint(x)")
    assert r.ok and r.exit_code == 0 and not r.timed_out
    assert r.output == "45"


def test_python_exception_is_reported_as_output(py):
    r = py.run("print('before')\n1/0")
    assert not r.ok and r.exit_code == 1
    assert "before" in r.output
    assert "ZeroDivisionError" in r.output and "Traceback" in r.output


def test_python_wall_timeout_kills_the_program(py):
    # sleep uses no CPU: only the wall-clock timeout can stop it
    r = py.run("import time\nprint('start', flush=True)\ntime.sleep(30)")
    assert r.timed_out and not r.ok
    assert r.wall_s < 10
    assert "start" in r.output and "TimeoutError" in r.output


def _alive_with(token: str) -> list[int]:
    """Host pids whose command line contains ``token`` (the host sees every process,
    also those in the sandbox's PID namespace)."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    pids.append(int(name))
        except (OSError, ValueError):
            pass
    return pids


def _sleeper(token: str, detach: bool) -> str:
    """A program that forks a child (which leaves the session when ``detach``) that
    execs a 60 s sleep carrying ``token`` on its command line, then sleeps itself."""
    return ("import os, sys, time\n"
            "if os.fork() == 0:\n"
            + ("    os.setsid()\n" if detach else "")
            + f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {token!r}])\n"
            "time.sleep(30)\n")


@pytest.mark.parametrize("detach", [False, True], ids=["child", "setsid_child"])
def test_python_timeout_also_kills_forked_children(py, detach):
    """The sandbox's PID namespace dies with the program: a forked child, even one that
    called setsid(), does not outlive the call."""
    import time
    import uuid

    token = f"tapioca-survivor-{uuid.uuid4().hex}"
    try:
        r = py.run(_sleeper(token, detach))
        assert r.timed_out
        deadline = time.monotonic() + 10  # SIGKILL of a namespace's processes is not instant
        while _alive_with(token) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive_with(token), "a forked child survived the call"
    finally:
        for pid in _alive_with(token):
            os.kill(pid, 9)


@pytest.mark.parametrize("sandbox", ["namespace", "none"])
def test_python_timeout_does_not_wait_for_a_detached_grandchild(sandbox):
    """A grandchild that leaves the process group (setsid) keeps the output pipe open
    after the kill when there is no PID namespace (sandbox none): the executor closes it
    and returns within the timeout + grace."""
    ex = PythonExecutor(timeout_s=1.0, memory_mb=256, sandbox=sandbox)
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    print('grandchild', flush=True)\n"
            "    time.sleep(8)\n"
            "    os._exit(0)\n"
            "time.sleep(30)\n")
    r = ex.run(code)
    assert r.timed_out and not r.ok
    assert r.wall_s < 4.0, f"blocked on the detached grandchild for {r.wall_s:.1f} s"
    assert "grandchild" in r.output and "TimeoutError" in r.output


def test_python_output_flood_is_capped_and_stopped():
    """Output is read incrementally: an endless print loop is stopped after
    4 * max_output_chars bytes instead of filling the runner's memory."""
    ex = PythonExecutor(timeout_s=20.0, memory_mb=256, max_output_chars=1000)
    r = ex.run("while True:\n    print('x' * 10**6)")
    assert not r.ok and not r.timed_out
    assert r.wall_s < 10
    assert "OutputLimitError" in r.output and "truncated" in r.output
    assert len(r.output) < 1300


def test_python_limits_are_set_without_preexec_fn_from_threads(py):
    """The TIR agent calls tools from worker threads: the limits come from the
    bootstrap inside the child, and concurrent calls each get them."""
    from concurrent.futures import ThreadPoolExecutor

    code = ("import resource\n"
            "print(resource.getrlimit(resource.RLIMIT_AS)[0] // 2**20,"
            " resource.getrlimit(resource.RLIMIT_CPU)[0])")
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: py.run(code), range(4)))
    assert all(r.ok and r.output == "256 3" for r in outs), [r.output for r in outs]


def test_python_has_no_network(py):
    r = py.run("import socket\n"
               "try:\n"
               "    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
               "    print('connected')\n"
               "except OSError as exc:\n"
               "    print('refused', exc.errno)")
    assert r.output.startswith("refused"), r.output
    # the traceback of a failing program shows main.py, not the bootstrap
    r = py.run("def f():\n    raise ValueError('boom')\nf()")
    assert 'File "main.py", line 3' in r.output and "runpy" not in r.output


def test_python_cannot_signal_a_sibling_process(py):
    """The program runs in its own PID namespace: another process of the agent's user is
    out of its reach and absent from its /proc."""
    import signal
    import subprocess
    import sys

    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        r = py.run("import os, signal\n"
                   "try:\n"
                   f"    os.kill({sibling.pid}, signal.SIGKILL)\n"
                   "    print('killed')\n"
                   "except ProcessLookupError:\n"
                   "    print('no such process')\n"
                   "except PermissionError:\n"
                   "    print('not permitted')\n"
                   f"print(os.path.exists('/proc/{sibling.pid}/cmdline'))")
        assert r.ok, r.output
        assert r.output.splitlines()[0] in ("no such process", "not permitted"), r.output
        assert sibling.poll() is None, "the sandboxed program killed a sibling process"
        assert r.output.splitlines()[1] == "False", r.output
    finally:
        sibling.send_signal(signal.SIGKILL)
        sibling.wait(10)


def test_python_cpu_limit_stops_a_busy_loop():
    # A wall timeout longer than the CPU limit: RLIMIT_CPU (ceil(timeout)+1 s) must fire
    # first... unless the box is so busy that wall time runs out first; either stops it.
    ex = PythonExecutor(timeout_s=1.0, memory_mb=256)
    r = ex.run("while True:\n    pass")
    assert not r.ok
    assert r.timed_out or "CPU time limit" in r.output


def test_python_memory_limit_raises_memory_error(py):
    r = py.run("b = bytearray(1024 * 1024 * 1024)\nprint('allocated')")
    assert not r.ok
    assert "MemoryError" in r.output
    assert "allocated" not in r.output


def test_python_runs_isolated_in_a_temporary_directory(py):
    r = py.run("import os, sys\nprint(os.getcwd())\nprint(sys.flags.isolated)\n"
               "print(os.environ.get('SECRET_FOR_TEST'))")
    cwd, isolated, secret = r.output.splitlines()
    assert os.path.basename(cwd).startswith("tapioca-py-")
    assert not os.path.exists(cwd), "the temporary directory was not removed"
    assert isolated == "1"
    assert secret == "None", "the parent's environment leaked into the sandbox"


def test_python_file_size_limit():
    ex = PythonExecutor(timeout_s=5.0, memory_mb=256, max_file_mb=1)
    r = ex.run("f = open('big', 'wb')\nf.write(b'x' * (4 * 1024 * 1024))\nf.close()\nprint('wrote')")
    assert not r.ok
    assert "wrote" not in r.output


def test_python_output_is_truncated(py):
    # under the 4 * max_output_chars read cap: the program finishes, the message is cut
    r = py.run("print('a' * 1500)")
    assert r.ok
    assert len(r.output) < 600 and "truncated" in r.output


def test_python_rejects_bad_settings():
    with pytest.raises(ConfigError):
        PythonExecutor(timeout_s=0)
    with pytest.raises(ConfigError):
        PythonExecutor(memory_mb=8)


@pytest.mark.parametrize("expr,want", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("7 / 2", 3.5), ("7 // 2", 3), ("7 % 4", 3),
    ("2 ** 10", 1024), ("-3 + +5", 2), ("sqrt(16) + abs(-2)", 6.0), ("max(3, 9, 4)", 9),
    ("round(pi, 2)", 3.14), ("factorial(5)", 120), ("1.5e3", 1500.0),
])
def test_calculator_arithmetic(expr, want):
    assert Calculator().evaluate(expr) == want


@pytest.mark.parametrize("expr", [
    "__import__('os').system('echo hi')",  # calls of anything else
    "open('/etc/passwd').read()",
    "(1).__class__",  # attribute access
    "x + 1",  # unknown names
    "'a' * 3",  # strings
    "[1, 2, 3]",  # containers
    "lambda: 1",
    "True + 1",  # booleans are not numbers here
    "9 ** 9 ** 9",  # an exponent that would hang the agent
    "10 ** 999 * 10 ** 999 * 10 ** 999 * 10 ** 999",  # an int that grows without bound
    "factorial(100000)",
    "1 +",  # not an expression
    "1 / 0",
    "sqrt(-1)",
    "max(1, key=abs)",  # keyword arguments
    "1" * 400,  # too long
])
def test_calculator_refuses(expr):
    with pytest.raises(ToolError):
        Calculator().evaluate(expr)


def test_toolbox_turns_every_mistake_into_a_message():
    box = Toolbox.of(Calculator(), PythonExecutor(timeout_s=2.0, memory_mb=256))
    names = [s["function"]["name"] for s in box.specs()]
    assert names == ["calculator", "python"]
    assert all(s["type"] == "function" and s["function"]["parameters"]["required"]
               for s in box.specs())
    assert box.call("calculator", json.dumps({"expression": "6*7"})).output == "42"
    assert box.call("python", {"code": "print(6*7)"}).output == "42"
    for name, args, needle in [
        ("shell", "{}", "unknown tool"),
        ("calculator", "{not json", "not valid JSON"),
        ("calculator", "[1]", "JSON object"),
        ("calculator", "{}", "missing argument"),
        ("calculator", '{"expression": "import os"}', "not an expression"),
    ]:
        r = box.call(name, args)
        assert not r.ok and r.output.startswith("Error:") and needle in r.output, r.output
