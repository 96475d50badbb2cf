"""Tools an agent can call: a sandboxed Python executor and a safe calculator.

Consumes tool-call arguments (the JSON string of an OpenAI ``tool_calls[i].function``);
emits the text of the tool message the agent sends back. No Kafka, no model: agents
(:mod:`tapioca.agents.tir_agent`) call these between chat completions.

Python executor: the code runs in a fresh ``python -I`` subprocess (isolated mode: no
user site-packages, no ``PYTHON*`` environment variables, the script's directory not on
``sys.path``) in a temporary working directory that is deleted afterwards, with a
minimal environment, in its own session (so a timeout kills every process it forked).
A bootstrap inside the child (no ``preexec_fn``, which is unsafe when tools are called
from threads) sets ``RLIMIT_AS`` (address space = memory), ``RLIMIT_CPU`` (CPU
seconds), ``RLIMIT_FSIZE`` (bytes a file may grow to), ``RLIMIT_CORE`` = 0 and, for a
non-root user, ``RLIMIT_NPROC`` (``max_processes`` on top of what the user already
runs) before the code runs; there is also a wall-clock timeout, and output is read
incrementally and the program stopped after ``4 * max_output_chars`` bytes (the tool
message is truncated to ``max_output_chars``).

Other processes (``isolate_processes``): when ``unshare --user --map-root-user --pid
--fork --mount-proc`` works (checked once; unprivileged user namespaces, or root), the
program runs in a new PID namespace with its own /proc: it sees only its own processes
and cannot signal any other (``kill`` of an outside pid is "no such process"), and when
the executor kills it, the kernel kills everything it forked, ``setsid()`` escapees
included. Where namespaces are refused but the agent runs as root, the program runs as
the user ``nobody`` (a non-root user cannot signal root's processes), if the Python
installation is readable by other users. Otherwise it runs in its own session only
and CAN signal other processes of the agent's user (:func:`process_isolation` says
which applies here; docs/security.md).
Network (``isolate_network``): when ``unshare --user --map-root-user --net`` works, the
program has no network (only a down loopback) and no capabilities on the host.

Not isolated: the file system (the program can read, and write, whatever the agent's
user can; in a user namespace as root, root's files too), and system calls (no seccomp
filter). Without ``unshare`` there is NO network isolation: the program can open
sockets. ``RLIMIT_NPROC`` is not enforced for root, so as root a fork bomb runs until
the wall-clock timeout kills it. Without a PID namespace, a grandchild that calls
``os.setsid()`` leaves the process group and survives the timeout (its inherited CPU
limit still applies); the executor does not wait for it. For code untrusted beyond
arithmetic, run the agent in a container.

Calculator: parses an arithmetic expression with :mod:`ast` and evaluates only numbers,
``+ - * / // % **``, unary signs and a fixed set of math functions and constants. No
``eval``; exponents and result sizes are bounded so ``9**9**9`` cannot hang the agent.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import operator
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..schemas.errors import ConfigError, TapiocaError


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
    # Processes/threads the program may add (RLIMIT_NPROC; not enforced for root).
    max_processes: int = 32
    # Run the program in a new user + network namespace when the OS allows it.
    isolate_network: bool = True
    # Run it in its own PID namespace (or, as root without namespaces, as nobody) so it
    # cannot signal other processes (process_isolation()).
    isolate_processes: bool = True
    python: str = sys.executable
    name: str = "python"

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError("PythonExecutor.timeout_s must be > 0")
        if self.memory_mb < 64:
            raise ConfigError("PythonExecutor.memory_mb must be >= 64 (the interpreter "
                              "alone maps ~30 MB)")

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
        uid = self._drop_to()[0] if self._isolation() == "nobody" else os.getuid()
        if uid != 0:
            # RLIMIT_NPROC caps all processes of the real uid, so the budget is on top of
            # what this user already runs (the kernel ignores it for root).
            limits.append(("RLIMIT_NPROC", _processes_of(uid) + self.max_processes))
        return limits

    def _isolation(self) -> str:
        return process_isolation(self.python) if self.isolate_processes else "session"

    @staticmethod
    def _drop_to() -> tuple[int, int]:
        import pwd

        nobody = pwd.getpwnam("nobody")
        return nobody.pw_uid, nobody.pw_gid

    def _argv(self) -> list[str]:
        items = [f"{name}={value}" for name, value in self._limits()]
        isolation = self._isolation()
        if isolation == "nobody":
            uid, gid = self._drop_to()
            items.append(f"DROP_TO={uid}:{gid}")
        argv = [self.python, "-I", "-c", _BOOTSTRAP, ",".join(items)]
        namespaces = []
        if isolation == "pid-namespace":
            namespaces += ["--pid", "--fork", "--mount-proc"]
        if self.isolate_network and network_namespace_available():
            namespaces.append("--net")
        if namespaces:
            argv = ["unshare", "--user", "--map-root-user", *namespaces, "--", *argv]
        return argv

    def run(self, code: str) -> ToolResult:
        if not isinstance(code, str):
            raise ToolError(f"python: 'code' must be a string, got {type(code).__name__}")
        start = time.monotonic()
        cap = 4 * self.max_output_chars  # bytes read before the program is stopped
        with tempfile.TemporaryDirectory(prefix="tapioca-py-") as cwd:
            with open(os.path.join(cwd, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            argv = self._argv()
            if any(a.startswith("DROP_TO=") for a in argv[-1].split(",")):
                uid, gid = self._drop_to()  # the program runs as nobody: its directory too
                os.chown(cwd, uid, gid)
                os.chown(os.path.join(cwd, "main.py"), uid, gid)
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": cwd, "TMPDIR": cwd,
                   # One thread for numeric libraries: RLIMIT_AS counts every thread's stack.
                   "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
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


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(proc: subprocess.Popen, timeout_s: float, cap: int,
                 grace_s: float = 1.0) -> tuple[bytes, bool, bool]:
    """Read the child's output until EOF, ``timeout_s`` or ``cap`` bytes; on a timeout or
    an overflow kill its process group and read for at most ``grace_s`` more. A
    grandchild that left the group (``os.setsid()``) can hold the pipe open after the
    kill: then the pipe is closed and what was read is returned, so the agent never
    blocks. Returns (output, timed_out, overflow)."""
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


@functools.lru_cache(maxsize=None)
def pid_namespace_available() -> bool:
    """Whether ``unshare --user --map-root-user --pid --fork --mount-proc`` works here
    (unprivileged user namespaces allowed, or root). Checked once."""
    return _unshare_works("--pid", "--fork", "--mount-proc")


def _readable_by_others(path: str) -> bool:
    """Whether every directory above ``path`` lets other users through and ``path`` is
    readable by them (so a program dropped to nobody can still import the stdlib)."""
    import stat

    p = os.path.realpath(path)
    parts = [p] + [os.path.dirname(p)]
    while parts[-1] != os.path.dirname(parts[-1]):
        parts.append(os.path.dirname(parts[-1]))
    try:
        for i, d in enumerate(parts):
            mode = os.stat(d).st_mode
            need = stat.S_IROTH if i == 0 else stat.S_IXOTH
            if not mode & need:
                return False
    except OSError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def process_isolation(python: str = sys.executable) -> str:
    """How the sandbox keeps a program from signalling other processes here:
    "pid-namespace" (its own PID namespace), "nobody" (root without namespaces: the
    program runs as nobody), or "session" (only its own session: it CAN signal the
    agent user's processes)."""
    if pid_namespace_available():
        return "pid-namespace"
    if os.geteuid() == 0:
        import sysconfig

        stdlib = sysconfig.get_paths()["stdlib"]
        try:
            import pwd

            pwd.getpwnam("nobody")
        except KeyError:
            return "session"
        if _readable_by_others(python) and _readable_by_others(stdlib):
            return "nobody"
    return "session"


def _unshare_works(*flags: str) -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", *flags, "--", "true"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.lru_cache(maxsize=None)
def network_namespace_available() -> bool:
    """Whether ``unshare --user --map-root-user --net`` works here without privileges
    (util-linux installed, unprivileged user namespaces allowed). Checked once."""
    return _unshare_works("--net")


# Runs as ``python -I -c _BOOTSTRAP "RLIMIT_AS=...,RLIMIT_CPU=...[,DROP_TO=uid:gid]"`` in
# the child's working directory: sets the limits on itself, drops to ``uid:gid`` when
# asked (root without namespaces: nobody), then runs main.py as __main__. A traceback is
# printed without the bootstrap's own frames.
_BOOTSTRAP = """\
import os, resource, runpy, sys, traceback
drop = None
for item in sys.argv[1].split(','):
    name, value = item.split('=')
    if name == 'DROP_TO':
        drop = [int(v) for v in value.split(':')]
        continue
    resource.setrlimit(getattr(resource, name), (int(value), int(value)))
if drop:
    os.setgroups([])
    os.setgid(drop[1])
    os.setuid(drop[0])
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
