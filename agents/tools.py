"""Tools an agent can call: a sandboxed Python executor and a safe calculator.

Consumes tool-call arguments (the JSON string of an OpenAI ``tool_calls[i].function``);
emits the text of the tool message the agent sends back. No Kafka, no model: agents
(:mod:`tapioca.agents.tir_agent`) call these between chat completions.

Python executor: model-written code is hostile. It runs in a fresh ``python -I``
subprocess (isolated mode: no user site-packages, no ``PYTHON*`` environment variables,
the script's directory not on ``sys.path``) in a temporary working directory that is
deleted afterwards, with a minimal environment, in its own session. A bootstrap inside
the child (no ``preexec_fn``, which is unsafe when tools are called from threads) sets
``RLIMIT_AS`` (memory), ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_FSIZE`` (bytes a file may
grow to), ``RLIMIT_CORE`` = 0 and ``RLIMIT_NPROC`` (processes) before the code runs;
there is also a wall-clock timeout, and output is read incrementally and the program
stopped after ``4 * max_output_chars`` bytes (the tool message is truncated to
``max_output_chars``).

Sandbox (``sandbox="namespace"``, the default; :mod:`tapioca.agents.sandbox_setup`):
the program runs in its own mount, PID, network and IPC namespaces, as root of a user
namespace that owns none of them, mapped to an unprivileged uid (a dedicated one,
``sandbox.SANDBOX_UID``, when the agent is root; the agent's own uid otherwise). Its
file system is a read-only private tmpfs holding only the system's libraries and the
interpreter's installation, read-only (:mod:`tapioca.agents.sandbox` lists them), and
its temporary directory, the only writable path: the run directory, the home directory
and the host's other files do not exist there. It sees only its own processes, has no
network (a down loopback), and at most ``max_processes`` processes and threads, itself
included, counted for this call alone (``RLIMIT_NPROC`` in its own user namespace,
enforced because its uid is not the host's root). When the executor stops it, the
kernel kills everything it forked. The executor checks the sandbox once when it is
made and refuses to start (:class:`~tapioca.schemas.errors.ConfigError`, saying why)
where it does not work: no silent fallback. ``sandbox="none"`` (config
``agent.tool_sandbox: none``) runs the code with the limits above only: it can then
read and write whatever the agent's user can, open sockets and signal the user's
processes, and as root ``RLIMIT_NPROC`` is not set (the kernel would ignore it). Not
filtered in either mode: system calls (no seccomp).

Calculator: parses an arithmetic expression with :mod:`ast` and evaluates only numbers,
``+ - * / // % **``, unary signs and a fixed set of math functions and constants. No
``eval``; exponents and result sizes are bounded so ``9**9**9`` cannot hang the agent.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import logging
import math
import operator
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..schemas.errors import ConfigError, TapiocaError
from .sandbox import SETUP_FAILED, launcher_argv, resolve_python

log = logging.getLogger(__name__)
SANDBOXES = ("namespace", "none")


class ToolError(TapiocaError):
    """A tool call could not run (unknown tool, bad arguments, a rejected expression).
    Agents turn it into the tool message, so the model sees what went wrong."""


@dataclass
class ToolResult:
    """What one tool call produced. ``output`` is what the model is shown."""

    output: str
    ok: bool = True
    timed_out: bool = False
    exit_code: int | None = None
    wall_s: float = 0.0


class Tool(Protocol):
    name: str

    def spec(self) -> dict[str, Any]: ...

    def call(self, arguments: dict[str, Any]) -> ToolResult: ...


# --------------------------------------------------------------------------- python


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [truncated {len(text) - limit} characters]"


@dataclass
class PythonExecutor:
    """Runs a Python snippet in a sandboxed subprocess; the tool message is its stdout
    and stderr (a traceback when it raised)."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_chars: int = 4000
    max_file_mb: int = 16
    # Processes and threads of one call, the program itself included (RLIMIT_NPROC).
    max_processes: int = 32
    # "namespace": isolated as the module docstring says, or refuse to start; "none": no
    # isolation (only the resource limits), chosen explicitly.
    sandbox: str = "namespace"
    python: str = sys.executable
    name: str = "python"
    # Try the sandbox once when made (the probe itself is made with False).
    check_sandbox: bool = field(default=True, repr=False)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError("PythonExecutor.timeout_s must be > 0")
        if self.memory_mb < 64:
            raise ConfigError("PythonExecutor.memory_mb must be >= 64 (the interpreter "
                              "alone maps ~30 MB)")
        if self.max_processes < 1:
            raise ConfigError("PythonExecutor.max_processes must be >= 1 (the program itself)")
        if self.sandbox not in SANDBOXES:
            raise ConfigError(f"agent.tool_sandbox={self.sandbox!r}: use namespace (isolate the "
                              "model's code) or none (run it without isolation)")
        self.python = resolve_python(self.python)
        if self.sandbox == "none":
            _warn_unsandboxed()
        elif self.check_sandbox:
            reason = sandbox_unavailable(self.python)
            if reason:
                raise ConfigError(
                    f"agent.tool_sandbox=namespace: the Python tool cannot isolate model-written "
                    f"code here ({reason}); it needs Linux user, mount and PID namespaces: run the "
                    "agent as root or allow unprivileged user namespaces (sysctl "
                    "user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, on Ubuntu "
                    "kernel.apparmor_restrict_unprivileged_userns=0; in a Docker container, a seccomp "
                    "profile that allows unshare, e.g. --security-opt seccomp=unconfined), or set "
                    "agent.tool_sandbox: none to run it without isolation")

    def spec(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name,
            "description": ("Run Python 3 code and return what it prints (stdout and "
                            f"stderr). Limits: {self.timeout_s:g} s, {self.memory_mb} MB. "
                            "Use print() to see values."),
            "parameters": {"type": "object", "properties": {
                "code": {"type": "string", "description": "The Python program to run."}},
                "required": ["code"]},
        }}

    def _limits(self) -> list[tuple[str, int]]:
        """(resource name, limit) pairs the bootstrap sets in the child before the code runs."""
        mem = self.memory_mb * 1024 * 1024
        limits = [("RLIMIT_AS", mem), ("RLIMIT_CPU", int(math.ceil(self.timeout_s)) + 1),
                  ("RLIMIT_FSIZE", self.max_file_mb * 1024 * 1024), ("RLIMIT_CORE", 0)]
        if self.sandbox == "namespace":
            # Counted in the program's own user namespace: this call's processes only.
            limits.append(("RLIMIT_NPROC", self.max_processes))
        elif os.getuid() != 0:
            # Without a user namespace RLIMIT_NPROC counts every process of the uid, so
            # the budget is on top of what this user already runs (ignored for root).
            limits.append(("RLIMIT_NPROC", _processes_of(os.getuid()) + self.max_processes))
        return limits

    def _command(self, cwd: str, root: str | None) -> tuple[list[str], dict[str, str]]:
        """The command line and environment of one call in ``cwd`` (``root``: the empty
        directory the sandbox's file system is mounted on)."""
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": cwd, "TMPDIR": cwd,
               # One thread for numeric libraries: RLIMIT_AS counts every thread's stack.
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        argv = [self.python, "-I", "-c", _BOOTSTRAP, ",".join(f"{n}={v}" for n, v in self._limits())]
        if root is None:
            return argv, env
        return launcher_argv(self.python, work=cwd, root=root, argv=argv, env=env), {"PATH": "/usr/bin:/bin"}

    def run(self, code: str) -> ToolResult:
        if not isinstance(code, str):
            raise ToolError(f"python: 'code' must be a string, got {type(code).__name__}")
        start = time.monotonic()
        cap = 4 * self.max_output_chars  # bytes read before the program is stopped
        sandboxed = self.sandbox == "namespace"
        with tempfile.TemporaryDirectory(prefix="tapioca-py-") as cwd, \
                (tempfile.TemporaryDirectory(prefix="tapioca-root-") if sandboxed
                 else contextlib.nullcontext(None)) as root:
            with open(os.path.join(cwd, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            argv, env = self._command(cwd, root)
            # No preexec_fn (not safe when the agent calls tools from threads): the
            # limits are set by the bootstrap inside the child; start_new_session is
            # done by Popen itself, so a timeout can kill every process it forked.
            proc = subprocess.Popen(
                argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            out, timed_out, overflow = _read_capped(proc, self.timeout_s, cap)
        wall = time.monotonic() - start
        text = out.decode("utf-8", errors="replace")
        code_ = proc.returncode
        if timed_out:
            text += f"\nTimeoutError: the program ran longer than {self.timeout_s:g} s and was stopped"
        elif overflow:
            text = _truncate(text, self.max_output_chars)
            text += f"\nOutputLimitError: the program printed more than {cap} bytes and was stopped"
        elif code_ is not None and code_ < 0:
            sig = -code_
            why = "CPU time limit" if sig == signal.SIGXCPU else signal.Signals(sig).name
            text += f"\nKilled by {why}"
        if overflow:
            output = text
        else:
            output = _truncate(text.strip() or "(no output)", self.max_output_chars)
        return ToolResult(output=output, ok=not timed_out and not overflow and code_ == 0,
                          timed_out=timed_out, exit_code=code_, wall_s=wall)

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        if "code" not in arguments:
            raise ToolError("python: missing argument 'code'")
        return self.run(arguments["code"])


@functools.lru_cache(maxsize=None)
def _warn_unsandboxed() -> None:
    log.warning("agent.tool_sandbox=none: the Python tool runs model-written code WITHOUT "
                "isolation (it can read the run directory's keys and open sockets)")


# The probe's program: whether a file planted next to its directory is visible, and how
# many children it could fork with max_processes=3 (the program and 2 children).
_PROBE = """\
import os, time
seen = os.path.exists({planted!r})
kids = 0
try:
    for _ in range(8):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        kids += 1
except OSError:
    pass
print('probe', seen, kids)
"""


@functools.lru_cache(maxsize=None)
def sandbox_unavailable(python: str) -> str | None:
    """Why the sandbox does not work for ``python`` here, or None when it does: one
    sandboxed run (once per interpreter) that must not see a host file and must not
    fork past its process limit."""
    with tempfile.NamedTemporaryFile(prefix="tapioca-probe-") as planted:
        try:
            probe = PythonExecutor(timeout_s=60.0, memory_mb=256, max_processes=3, python=python,
                                   check_sandbox=False)
            r = probe.run(_PROBE.format(planted=planted.name))
        except (ConfigError, OSError) as exc:
            return str(exc)
    last = r.output.strip().splitlines()[-1] if r.output.strip() else "(no output)"
    if r.exit_code == SETUP_FAILED or not last.startswith("probe "):
        return last.removeprefix("tapioca-sandbox: ")
    _, seen, kids = last.split()
    if seen != "False":
        return "a host file is visible inside it"
    if int(kids) > 2:
        return ("the process limit is not enforced: the agent is root of a user namespace "
                "mapped to the host's root, which RLIMIT_NPROC exempts")
    return None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(proc: subprocess.Popen, timeout_s: float, cap: int,
                 grace_s: float = 1.0) -> tuple[bytes, bool, bool]:
    """Read the child's output until EOF, ``timeout_s`` or ``cap`` bytes; on a timeout or
    an overflow kill its process group and read for at most ``grace_s`` more. A
    grandchild that left the group (``os.setsid()``, only possible without the sandbox's
    PID namespace) can hold the pipe open after the kill: then the pipe is closed and
    what was read is returned, so the agent never blocks. Returns (output, timed_out,
    overflow)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    chunks: list[bytes] = []
    size = 0
    timed_out = overflow = killed = False
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if killed:
                    break  # the grace period is over: a detached grandchild holds the pipe
                timed_out = True
                _kill_group(proc)
                killed, deadline = True, time.monotonic() + grace_s
                continue
            if not sel.select(left):
                continue
            data = os.read(fd, 65536)
            if not data:
                break  # EOF: every writer is gone
            if size < cap:
                chunks.append(data[:cap - size])
            size += len(data)
            if size >= cap and not killed:
                overflow = True
                _kill_group(proc)
                killed, deadline = True, time.monotonic() + grace_s
    proc.stdout.close()
    try:
        proc.wait(timeout=grace_s if killed else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # closed its output but still running
        _kill_group(proc)
        timed_out = timed_out or not killed
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    return b"".join(chunks), timed_out, overflow


def _processes_of(uid: int) -> int:
    """How many processes the real uid ``uid`` runs now (from /proc; 0 if unreadable)."""
    n = 0
    try:
        names = os.listdir("/proc")
    except OSError:
        return 0
    for name in names:
        if name.isdigit():
            try:
                n += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                pass
    return n


# Runs as ``python -I -c _BOOTSTRAP "RLIMIT_AS=...,RLIMIT_CPU=..."`` in the child's
# working directory: sets the limits on itself, then runs main.py as __main__. A
# traceback is printed without the bootstrap's own frames.
_BOOTSTRAP = """\
import resource, runpy, sys, traceback
for item in sys.argv[1].split(','):
    name, value = item.split('=')
    resource.setrlimit(getattr(resource, name), (int(value), int(value)))
sys.argv = ['main.py']
try:
    runpy.run_path('main.py', run_name='__main__')
except SystemExit:
    raise
except BaseException as exc:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != 'main.py':
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)
    sys.stderr.flush()
    sys.exit(1)
"""


# ----------------------------------------------------------------------- calculator

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS: dict[str, Callable[..., Any]] = {
    "abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt, "exp": math.exp,
    "log": math.log, "log10": math.log10, "log2": math.log2, "sin": math.sin, "cos": math.cos,
    "tan": math.tan, "floor": math.floor, "ceil": math.ceil, "factorial": math.factorial,
    "gcd": math.gcd,
}
_CONSTS = {"pi": math.pi, "e": math.e}


@dataclass
class Calculator:
    """Evaluates an arithmetic expression safely (an AST walk over a whitelist)."""

    max_chars: int = 300
    max_exponent: int = 1000
    max_int_digits: int = 1000
    max_factorial: int = 500
    name: str = "calculator"

    def spec(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name,
            "description": ("Evaluate an arithmetic expression, e.g. '(3 + 4) * 2 / 7' or "
                            "'sqrt(2) ** 2'. Operators + - * / // % **, functions "
                            + ", ".join(sorted(_FUNCS)) + ", constants pi and e."),
            "parameters": {"type": "object", "properties": {
                "expression": {"type": "string", "description": "The expression."}},
                "required": ["expression"]},
        }}

    def evaluate(self, expression: str) -> int | float:
        if not isinstance(expression, str):
            raise ToolError("calculator: the expression must be a string")
        if len(expression) > self.max_chars:
            raise ToolError(f"calculator: expression longer than {self.max_chars} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as exc:
            raise ToolError(f"calculator: not an expression: {exc.msg}") from None
        try:
            return self._eval(tree.body)
        except ToolError:
            raise
        except (ArithmeticError, ValueError, TypeError, OverflowError) as exc:
            raise ToolError(f"calculator: {type(exc).__name__}: {exc}") from None

    def _eval(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise ToolError(f"calculator: only numbers are allowed, got {node.value!r}")
            return self._check(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
                raise ToolError(f"calculator: exponent {right} is larger than {self.max_exponent}")
            return self._check(_BINOPS[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self._check(_UNARY[type(node.op)](self._eval(node.operand)))
        if isinstance(node, ast.Name):
            if node.id in _CONSTS:
                return _CONSTS[node.id]
            raise ToolError(f"calculator: unknown name {node.id!r}")
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCS or node.keywords:
                raise ToolError("calculator: only calls of " + ", ".join(sorted(_FUNCS))
                                + " with positional arguments are allowed")
            args = [self._eval(a) for a in node.args]
            if node.func.id == "factorial" and args and abs(args[0]) > self.max_factorial:
                raise ToolError(f"calculator: factorial argument larger than {self.max_factorial}")
            return self._check(_FUNCS[node.func.id](*args))
        raise ToolError(f"calculator: {type(node).__name__} is not allowed in an expression")

    def _check(self, value: Any) -> Any:
        # Bounding intermediate results keeps 10**1000 * 10**1000 ... from exploding.
        if isinstance(value, int) and value.bit_length() > self.max_int_digits * 3.33:
            raise ToolError(f"calculator: a result has more than {self.max_int_digits} digits")
        return value

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        if "expression" not in arguments:
            raise ToolError("calculator: missing argument 'expression'")
        start = time.monotonic()
        value = self.evaluate(arguments["expression"])
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)
        return ToolResult(output=str(value), wall_s=time.monotonic() - start)


# -------------------------------------------------------------------------- toolbox


@dataclass
class Toolbox:
    """The tools an agent offers the model, by name; turns tool calls into messages."""

    tools: dict[str, Tool] = field(default_factory=dict)

    @classmethod
    def of(cls, *tools: Tool) -> "Toolbox":
        return cls({t.name: t for t in tools})

    def specs(self) -> list[dict[str, Any]]:
        """The ``tools`` parameter of a chat completion request."""
        return [t.spec() for t in self.tools.values()]

    def call(self, name: str, arguments: str | dict[str, Any]) -> ToolResult:
        """Run one call. Never raises for the model's mistakes (unknown tool, arguments
        that are not JSON, a rejected expression): the error text is the result, so the
        model can read it and retry."""
        try:
            if name not in self.tools:
                raise ToolError(f"unknown tool {name!r}; available: {', '.join(self.tools)}")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments or "{}")
                except json.JSONDecodeError as exc:
                    raise ToolError(f"{name}: arguments are not valid JSON ({exc.msg})") from None
            if not isinstance(arguments, dict):
                raise ToolError(f"{name}: arguments must be a JSON object")
            return self.tools[name].call(arguments)
        except ToolError as exc:
            return ToolResult(output=f"Error: {exc}", ok=False)
