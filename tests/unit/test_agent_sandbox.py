"""The Python tool's sandbox contains model-written code: each escape of the fault-
injection pass (issue 31) is tried for real and must fail; where the sandbox cannot be
built (user namespaces disabled by the kernel's own switch, or a root the process cap
does not bind) the executor refuses to start unless ``sandbox="none"`` is explicit.

Real processes, real namespaces, no mocks: these need Linux with user namespaces (as
root, as CI runs, or unprivileged) and skip only where ``unshare`` itself is missing.
"""

from __future__ import annotations

import ast
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import uuid

import pytest

from tapioca.agents.sandbox import SANDBOX_UID, bind_paths
from tapioca.agents.tools import PythonExecutor
from tapioca.bus.signing import create_key_file, key_path_of_run, write_secret_file
from tapioca.schemas.errors import ConfigError

MAX_PROCESSES = 8


@pytest.fixture(scope="module")
def box():
    # Generous wall time: a loaded 2-core box; nothing here waits for it.
    return PythonExecutor(timeout_s=30.0, memory_mb=256, max_processes=MAX_PROCESSES)


def _read(path: str) -> str:
    """A program that prints the file at ``path``, or how it was kept from it."""
    return textwrap.dedent(f"""\
        try:
            print('ESCAPED', open({path!r}).read())
        except OSError as exc:
            print('contained', type(exc).__name__)""")


def test_a_planted_file_outside_its_directory_is_not_visible(box, tmp_path):
    planted = tmp_path / "planted.txt"
    planted.write_text("PLANTED-SECRET")
    r = box.run(_read(str(planted)))
    assert r.output == "contained FileNotFoundError", r.output


def test_a_0600_file_in_the_agents_home_is_not_visible(box):
    home = os.path.expanduser("~")
    secret = os.path.join(home, f".tapioca-sandbox-test-{uuid.uuid4().hex}")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"HOME-SECRET")
        os.close(fd)
        r = box.run(_read(secret))
        assert r.output == "contained FileNotFoundError", r.output
    finally:
        os.unlink(secret)


def test_the_run_directorys_keys_are_not_visible(box, tmp_path):
    """The bus signing key and the proxy's admin key, where `tapioca train` writes them."""
    run_dir = tmp_path / "runs" / "exp" / "trial"
    create_key_file(key_path_of_run(run_dir))
    write_secret_file(run_dir / "secrets" / "proxy-admin.key", "ADMIN-KEY")
    for key in (key_path_of_run(run_dir), run_dir / "secrets" / "proxy-admin.key"):
        assert key.exists()
        r = box.run(_read(str(key)))
        assert r.output == "contained FileNotFoundError", r.output


def test_nothing_of_the_host_but_the_interpreter_and_libraries_is_visible(box):
    """Every file the program can find outside the read-only interpreter and library
    paths: its own main.py, the sandbox's two-line /etc/passwd and /etc/group, the
    time zone link, the device nodes and links. os.listdir('/') is not the host's."""
    binds = bind_paths(box.python)
    code = textwrap.dedent(f"""\
        import os
        skip = {binds!r} + ['/proc']
        found = []
        for top, dirs, files in os.walk('/'):
            dirs[:] = [d for d in dirs if os.path.join(top, d) not in skip]
            found += [os.path.join(top, f) for f in files if os.path.join(top, f) not in skip]
        print(sorted(os.listdir('/')))
        print(sorted(found))""")
    r = box.run(code)
    assert r.ok, r.output
    top, found = (ast.literal_eval(line) for line in r.output.splitlines())
    firsts = {p.split("/")[1] for p in binds}
    assert set(top) <= {"etc", "dev", "proc", "tmp"} | firsts, top
    assert set(top) != set(os.listdir("/"))
    assert "home" not in top and "var" not in top and "opt" not in set(top) - firsts
    others = [f for f in found if not f.endswith("/main.py")]
    devices = [f"/dev/{d}" for d in ("null", "zero", "full", "random", "urandom", "stdin", "stdout", "stderr")]
    zone = ["/etc/localtime"] if os.path.islink("/etc/localtime") else []
    assert others == sorted(["/etc/passwd", "/etc/group", *devices, *zone]), others
    assert len(found) - len(others) == 1


def test_it_cannot_write_outside_its_directory(box, tmp_path):
    tag = uuid.uuid4().hex
    site = sysconfig.get_paths()["purelib"]  # a .pth here would run in every later Python
    targets = [str(tmp_path / "escaped"), f"/tmp/tapioca-escape-{tag}", os.path.join(site, f"escape-{tag}.pth"),
               f"/escape-{tag}", f"/etc/escape-{tag}", os.path.join(os.path.expanduser("~"), f".escape-{tag}")]
    code = textwrap.dedent(f"""\
        for path in {targets!r}:
            try:
                open(path, 'w').write('x')
                print('ESCAPED', path)
            except OSError as exc:
                print('contained', type(exc).__name__)
        open('mine.txt', 'w').write('ok')
        print(open('mine.txt').read())""")
    try:
        r = box.run(code)
        lines = r.output.splitlines()
        assert all(line.startswith("contained") for line in lines[:-1]), r.output
        assert lines[-1] == "ok", "its own directory must stay writable"
        assert not [t for t in targets if os.path.exists(t)]
    finally:
        for t in targets:
            if os.path.exists(t):
                os.unlink(t)


def test_it_cannot_remount_or_unmount_its_file_system(box):
    """Root of its user namespace, it owns no mount: remounting read-write, unmounting, or
    doing either in a mount namespace of its own all fail."""
    code = textwrap.dedent("""\
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        MS_REMOUNT, MS_BIND = 32, 4096
        def result(ret):
            return 'ok' if ret == 0 else os.strerror(ctypes.get_errno())
        print('remount /', result(libc.mount(None, b'/', None, MS_REMOUNT | MS_BIND, None)))
        print('umount /proc', result(libc.umount2(b'/proc', 2)))
        print('own mount ns', result(libc.unshare(0x00020000)))
        print('remount / there', result(libc.mount(None, b'/', None, MS_REMOUNT | MS_BIND, None)))
        print('umount /usr there', result(libc.umount2(b'/usr', 2)))""")
    lines = box.run(code).output.splitlines()
    assert len(lines) == 5, lines
    assert lines[0] == "remount / Operation not permitted" and lines[1] == "umount /proc Operation not permitted"
    if lines[2] == "own mount ns ok":  # allowed, but the mounts it copies are locked
        assert not lines[3].endswith(" ok") and not lines[4].endswith(" ok"), lines


def test_it_is_root_of_a_namespace_mapped_to_an_unprivileged_uid(box):
    """Root inside, a dedicated uid outside when the agent is root (else the agent's own
    uid: the launcher's namespace maps its root to it, so the program's map reads 0 0 1)."""
    r = box.run("import os\nprint(os.getuid(), open('/proc/self/uid_map').read().split())")
    outer = SANDBOX_UID if os.geteuid() == 0 else 0
    assert r.output == f"0 {['0', str(outer), '1']}", r.output
    assert SANDBOX_UID != 0 and SANDBOX_UID != os.geteuid()


def _fork_loop(limit: int) -> str:
    """Fork up to ``limit`` sleeping children; print how many it got and what stopped it."""
    return textwrap.dedent(f"""\
        import os, time
        kids, why = 0, 'none'
        try:
            for _ in range({limit}):
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                kids += 1
        except OSError as exc:
            why = type(exc).__name__
        print(kids, why)""")


def test_a_fork_loop_stops_at_the_process_cap_even_as_root(box):
    """64 forks against a cap of 8: the program and 7 children (RLIMIT_NPROC counts the
    program too). Before the fix, as root, all 64 ran."""
    r = box.run(_fork_loop(64))
    kids, why = r.output.split()
    assert int(kids) == MAX_PROCESSES - 1 and why == "BlockingIOError", r.output


def test_the_cap_is_per_call_not_per_uid():
    """Calls running at once as the same uid each get their own cap (the TIR agent runs
    tools from threads)."""
    from concurrent.futures import ThreadPoolExecutor

    ex = PythonExecutor(timeout_s=30.0, memory_mb=256, max_processes=4)
    code = _fork_loop(16).replace("print(kids, why)", "print(kids, why, flush=True)\ntime.sleep(2)")
    with ThreadPoolExecutor(3) as pool:
        outs = [r.output for r in pool.map(lambda _: ex.run(code), range(3))]
    assert outs == ["3 BlockingIOError"] * 3, outs


def test_an_8_gib_allocation_stays_contained(box):
    r = box.run("b = bytearray(8 * 1024 ** 3)\nprint('allocated')")
    assert "MemoryError" in r.output and "allocated" not in r.output


def _userns_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--user", "--map-root-user", "true"],
                          capture_output=True).returncode == 0


def _make_executor_in(prelude: str, sandbox: str) -> subprocess.CompletedProcess:
    """Make a PythonExecutor in a fresh user namespace (root of it, mapped to this
    process's uid) after the shell ``prelude`` ran there; print its first result or the
    error that refused it."""
    script = textwrap.dedent(f"""\
        from tapioca.agents.tools import PythonExecutor
        from tapioca.schemas.errors import ConfigError
        try:
            ex = PythonExecutor(timeout_s=30.0, memory_mb=256, sandbox={sandbox!r})
        except ConfigError as exc:
            print('REFUSED', exc)
        else:
            print('RAN', ex.run('print(6 * 7)').output)""")
    return subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c",
                           f'{prelude} exec "$0" -c "$1"', sys.executable, script],
                          capture_output=True, text=True, timeout=300)


needs_userns = pytest.mark.skipif(not _userns_works(), reason="unshare --user does not work here")


@needs_userns
def test_it_refuses_to_start_when_user_namespaces_are_disabled():
    """user.max_user_namespaces = 0 (the kernel's switch, set in a namespace of the test's
    own): the sandbox cannot be built, and the executor says so instead of running the
    code unisolated; sandbox none runs it, as asked."""
    off = "echo 0 > /proc/sys/user/max_user_namespaces &&"
    out = _make_executor_in(off, "namespace")
    assert out.stdout.startswith("REFUSED agent.tool_sandbox=namespace"), out.stdout + out.stderr
    assert "No space left on device" in out.stdout  # the kernel's answer to a 0 limit
    assert "set agent.tool_sandbox: none" in out.stdout and len(out.stdout.splitlines()) == 1
    out = _make_executor_in(off, "none")
    assert out.stdout.strip() == "RAN 42", out.stdout + out.stderr


@needs_userns
def test_it_refuses_to_start_where_the_process_cap_would_not_bind():
    """Root of a user namespace mapped to the host's root (unshare -r as root) can build
    namespaces but cannot drop to another uid, and the kernel exempts the host's root
    from RLIMIT_NPROC: the executor refuses rather than run without a process cap."""
    if os.geteuid() != 0:
        pytest.skip("only root's own uid is exempt from RLIMIT_NPROC")
    out = _make_executor_in("", "namespace")
    assert out.stdout.startswith("REFUSED"), out.stdout + out.stderr
    assert "process limit is not enforced" in out.stdout


def test_an_unprivileged_agent_gets_the_same_sandbox(tmp_path):
    """The path for an agent that is not root: the launcher creates the user namespace
    itself (root of it mapped to the agent's uid). Run as uid 4321 with the system's
    Python: the planted file is invisible, writes outside fail, the cap holds."""
    python = "/usr/bin/python3"
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists(python):
        pytest.skip("needs root (to become another user), setpriv and /usr/bin/python3")
    uid = 4321
    planted = tmp_path / "planted.txt"
    planted.write_text("PLANTED-SECRET")
    ex = PythonExecutor(timeout_s=30.0, memory_mb=256, max_processes=MAX_PROCESSES, python=python,
                        check_sandbox=False)
    base = tempfile.mkdtemp(prefix="tapioca-unpriv-")
    try:
        os.chmod(base, 0o755)
        work, root = os.path.join(base, "tapioca-py-work"), os.path.join(base, "root")
        os.mkdir(work)
        os.mkdir(root)
        code = _read(str(planted)) + "\nprint(open('/proc/self/uid_map').read().split())\n" + _fork_loop(64)
        with open(os.path.join(work, "main.py"), "w") as f:
            f.write(code)
        for p in (work, root, os.path.join(work, "main.py")):
            os.chown(p, uid, uid)
        argv, env = ex._command(work, root)
        # The launcher must be readable by that user: a copy outside a private checkout.
        setup = os.path.join(base, "sandbox_setup.py")
        shutil.copy(argv[3], setup)
        os.chmod(setup, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        argv[3] = setup
        out = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv],
                             cwd=work, env=env, capture_output=True, text=True, timeout=120)
        lines = out.stdout.splitlines()
        assert out.returncode == 0 and len(lines) == 3, out.stdout + out.stderr
        assert lines[0] == "contained FileNotFoundError"
        # Root of its namespace, mapped to root of the launcher's (uid 4321 on the host).
        assert lines[1] == "['0', '0', '1']"
        assert lines[2] == f"{MAX_PROCESSES - 1} BlockingIOError"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_bad_sandbox_setting_is_refused():
    with pytest.raises(ConfigError, match="use namespace"):
        PythonExecutor(sandbox="bubblewrap")
    with pytest.raises(ConfigError, match="max_processes"):
        PythonExecutor(max_processes=0)


def test_the_agent_config_reaches_the_executor():
    """agent.tool_max_processes and agent.tool_sandbox go to the TIR agent's executor;
    bad values are refused when the config loads."""
    from tapioca.agents.runner import build_agent
    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig

    cfg = load_config(TrainConfig, None, ["agent.enabled=true", "agent.workflow=tir",
                                          "agent.tool_max_processes=5", "agent.tool_sandbox=none"])
    python = build_agent(cfg).toolbox.tools["python"]
    assert (python.max_processes, python.sandbox) == (5, "none")
    assert load_config(TrainConfig).agent.tool_sandbox == "namespace"
    for bad, message in (("agent.tool_sandbox=off", "use namespace"), ("agent.tool_max_processes=0", ">= 1")):
        with pytest.raises(ConfigError, match=message):
            load_config(TrainConfig, None, [bad])
