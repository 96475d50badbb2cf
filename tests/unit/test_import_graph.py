"""Imports a tool can follow from the checkout as it lies on disk, and the layers they keep.

The repository root is the package ``tapioca`` (its ``__init__.py``; pyproject.toml maps
``tapioca`` to ``.`` and ``tapioca.<folder>`` to each folder), so a module's file is
``<folder>/<module>.py`` whether it runs from a clone, the editable install or the wheel.
Inside the package, modules import each other relatively (``from ..bus.runner import
RoleRunner``, ``from .role import Role``): the dots name the folders. These tests check
that every relative import resolves to a file of the tree, that the folders in
``RELATIVE_ONLY`` have no absolute ``tapioca.`` import left, that the ``tapioca`` CLI
modules form no import circle, and the architecture: the folders import only down the
layer table ``LAYERS`` and the roles (``ROLES``) never import each other, they meet on
the log.

The converter is here too. ``python tests/unit/test_import_graph.py [FOLDER ...]``
rewrites the absolute ``from tapioca.X import ...`` statements of the package's modules
(default: every package folder) into their relative form, in place; run ``ruff check
--fix --select I`` afterwards to sort the moved imports. Tests, benchmarks and examples
are not part of the package and keep importing ``tapioca.*``.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "tapioca"
# Folders whose modules may hold no absolute self-import; None: every package folder.
RELATIVE_ONLY: tuple[str, ...] | None = None
# Modules exempt from that rule (none left).
NOT_YET: tuple[str, ...] = ()
# The modules that make up the `tapioca` command.
CLI_MODULES = ("cli", "cli_context", "admin_cli", "commands", "eval_cli", "fleet_cli",
               "supervised_cli", "plot", "proxy_cli", "replay_cli")


def package_dirs() -> dict[str, str]:
    """``tapioca.X`` -> folder, from pyproject.toml."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same table, read by hand
        text = (ROOT / "pyproject.toml").read_text()
        table = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
        return dict(re.findall(r'^"([\w.]+)"\s*=\s*"([\w/]+)"', table, re.M))
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def package_files(folders: tuple[str, ...] | None = None) -> dict[Path, str]:
    """Every module of the package (or of ``folders``) -> its dotted module name."""
    dirs = package_dirs()
    # "tapioca" = ".": the root's __init__.py only (it imports nothing), not the whole tree.
    roots = sorted({d.split("/")[0] for d in dirs.values()} - {"."})
    out: dict[Path, str] = {}
    for root in roots if folders is None else folders:
        for path in sorted((ROOT / root).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[path] = ".".join((PREFIX, *parts))
    return out


def package_of(path: Path, module: str) -> str:
    """The package a module's relative imports start from (a package's own
    ``__init__`` starts from itself)."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def relative_name(target: str, package: str) -> str:
    """``from <target> import`` written relative to ``package``: as few dots as the
    common prefix allows (``tapioca.bus.runner`` from ``tapioca.ops`` is ``..bus.runner``;
    from ``tapioca.bus`` it is ``.runner``)."""
    t, p = target.split("."), package.split(".")
    common = 0
    while common < min(len(t), len(p)) and t[common] == p[common]:
        common += 1
    if common == 0:
        raise ValueError(f"{target} is not inside {package}'s top-level package")
    return "." * (len(p) - common + 1) + ".".join(t[common:])


_FROM = re.compile(r"from\s+(" + PREFIX + r"(?:\.\w+)*)\s+import\b")


def to_relative(source: str, path: Path, module: str) -> str:
    """``source`` with each absolute ``from tapioca... import`` made relative. ``import
    tapioca.x`` statements (which bind the name ``tapioca``) are refused, not guessed."""
    package = package_of(path, module)
    lines = source.splitlines(keepends=True)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PREFIX or alias.name.startswith(PREFIX + "."):
                    raise ValueError(f"{path}:{node.lineno}: `import {alias.name}` binds the "
                                     "name tapioca; write it as `from ... import ...` first")
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                and (node.module == PREFIX or node.module.startswith(PREFIX + "."))):
            continue
        i = node.lineno - 1
        head = lines[i][node.col_offset:]
        m = _FROM.match(head)
        if m is None or m.group(1) != node.module:
            raise ValueError(f"{path}:{node.lineno}: cannot rewrite this import statement")
        new = f"from {relative_name(node.module, package)} import"
        lines[i] = lines[i][:node.col_offset] + new + head[m.end():]
    return "".join(lines)


def resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name a (relative) ``from ... import`` names."""
    if node.level == 0:
        return node.module or ""
    base = package_of(path, module).split(".")
    if node.level > len(base):
        raise ValueError(f"{path}:{node.lineno}: the import goes above {PREFIX}")
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def module_file(name: str) -> Path | None:
    """The file of a ``tapioca.*`` module (or package) in the checkout, if any."""
    parts = name.split(".")[1:]
    for candidate in (ROOT.joinpath(*parts).with_suffix(".py"),
                      ROOT.joinpath(*parts, "__init__.py")):
        if parts and candidate.is_file():
            return candidate
    return None


def imports_of(path: Path, module: str, source: str | None = None) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every ``from ... import`` of a module,
    module level or not (a tool draws both); ``source``: the text to read instead of the
    file's."""
    tree = ast.parse(path.read_text() if source is None else source)
    return [(n.lineno, resolve(module, path, n), [a.name for a in n.names])
            for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]


# ---------------------------------------------------------------------- layers

# The folders are the layers, top first. A folder imports only folders of the layers
# below its own; the folders of one layer never import each other. One line a layer: a
# new folder goes into the line where it belongs (test_every_package_folder_has_a_layer).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ops",),                                          # the `tapioca` CLI and launchers
    ("runtime",),                                      # resolve_run() and the role builders
    ("producers", "consumers", "trainers", "agents"),  # the roles: they meet on the log
    ("engines", "tasks"),                              # inference engines; datasets, rewards
    ("weights",),                                      # moving and following weights
    ("config",),                                       # the dataclass configs
    ("models",),                                       # model and tokenizer construction
    ("algorithms", "bus", "media"),                    # pure RL math; the only Kafka code; images, blobs
    ("schemas",),                                      # events, topics, the one error base
)
# The roles, by the files their process runs (a folder: all of its modules). None
# imports another's modules, at module level or inside a function, directly or through
# the modules it imports: they meet on the log. Shared code (producers/weights_follow.py,
# trainers/checkpoint.py, ...) belongs to no role.
ROLES: dict[str, tuple[str, ...]] = {
    "feeder": ("producers/feeder.py",),
    "rollout": ("producers/rollout.py",),
    "proxy": ("producers/proxy",),
    "reward": ("consumers/reward_scorer.py",),
    "advantage": ("consumers/advantage.py",),
    "archiver": ("consumers/archiver.py",),
    "trainer": ("trainers/trainer.py", "trainers/trainer_state.py", "trainers/admission.py",
                "trainers/batch_step.py", "trainers/publishing.py", "trainers/checkpointing.py",
                "trainers/rollback.py"),
    "supervised": ("trainers/supervised",),  # tapioca sft|dpo|rm|distill, one process each
    "agent": ("agents/runner.py",),
    "evaluator": ("producers/evaluator.py",),
}

Edge = tuple[str, str, str]  # (where: "path:line", importing module, imported module)


def folder_of(module: str) -> str:
    """``tapioca.bus.runner`` -> ``bus``."""
    return module.split(".")[1] if module.count(".") else ""


def edges_of(path: Path, module: str, source: str | None = None) -> list[Edge]:
    """Every module a module imports (``from pkg import mod`` names ``pkg.mod``), with
    the packages whose ``__init__`` the import runs; only modules of the package."""
    out = []
    where = path.relative_to(ROOT).as_posix()
    for line, target, names in imports_of(path, module, source):
        if not target.startswith(PREFIX + "."):
            continue
        targets = [target] + [f"{target}.{n}" for n in names if module_file(f"{target}.{n}")]
        for t in targets:
            parts = t.split(".")
            # `import a.b.c` runs a/__init__ and a/b/__init__ first.
            for i in range(2, len(parts) + 1):
                out.append((f"{where}:{line}", module, ".".join(parts[:i])))
    return out


@functools.lru_cache(maxsize=1)
def _tree_edges() -> tuple[Edge, ...]:
    return tuple(e for path, module in package_files().items() for e in edges_of(path, module))


def tree_edges() -> list[Edge]:
    """The edges of every module of the tree (parsed once per test session)."""
    return list(_tree_edges())


def layer_violations(edges: list[Edge], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """The imports that do not run down ``layers``: upward, within one layer (between
    two of its folders), or from or to a folder the table does not place."""
    rank = {folder: i for i, layer in enumerate(layers) for folder in layer}
    deepest: dict[tuple[str, str, str], str] = {}  # one line per statement and folder pair
    for where, src, dst in edges:
        a, b = folder_of(src), folder_of(dst)
        if a != b and len(dst) > len(deepest.get((where, a, b), "")):
            deepest[(where, a, b)] = dst
    bad = []
    for (where, a, b), dst in deepest.items():
        if a not in rank or b not in rank:
            bad.append(f"{where}: {a} imports {dst}, and LAYERS does not place "
                       f"{' and '.join(f for f in (a, b) if f not in rank)}")
        elif rank[a] == rank[b]:
            bad.append(f"{where}: {a} imports {dst}, a folder of its own layer {layers[rank[a]]}")
        elif rank[a] > rank[b]:
            bad.append(f"{where}: {a} imports {dst}, a layer above it")
    return bad


def _role_modules(spec: tuple[str, ...], modules: dict[Path, str]) -> set[str]:
    return {m for path, m in modules.items()
            if any(path.relative_to(ROOT).as_posix() == p
                   or path.relative_to(ROOT).as_posix().startswith(p + "/") for p in spec)}


def role_violations(edges: list[Edge], roles: dict[str, tuple[str, ...]] = ROLES) -> list[str]:
    """Each import path by which one role's modules reach another role's: a role's
    closure under ``edges`` must hold no other role's module."""
    modules = package_files()
    own = {role: _role_modules(spec, modules) for role, spec in roles.items()}
    graph: dict[str, list[tuple[str, str]]] = {}
    for where, src, dst in edges:
        graph.setdefault(src, []).append((where, dst))
    bad = []
    for role, start in own.items():
        others = {m: r for r, ms in own.items() if r != role for m in ms}
        seen, stack = set(start), [(m, ()) for m in sorted(start)]
        while stack:
            mod, path = stack.pop()
            for where, dst in graph.get(mod, ()):
                if dst in others:
                    chain = " -> ".join((*path, where))
                    bad.append(f"role {role} imports role {others[dst]}'s {dst} ({chain})")
                elif dst not in seen:
                    seen.add(dst)
                    stack.append((dst, (*path, where)))
    return sorted(set(bad))


# ---------------------------------------------------------------------- tests


def test_every_relative_import_resolves_to_a_file_of_the_tree():
    broken = []
    for path, module in package_files().items():
        for line, target, names in imports_of(path, module):
            if not target.startswith(PREFIX + "."):
                continue
            if module_file(target) is not None:
                continue
            # `from .pkg import module`: the names are the modules.
            if all(module_file(f"{target}.{n}") is not None for n in names):
                continue
            broken.append(f"{path.relative_to(ROOT)}:{line}: {target}")
    assert not broken, f"imports that name no file of the checkout: {broken}"


def test_a_checkout_imports_as_a_package_from_its_parent_folder():
    """No install needed: from the folder that holds the checkout, ``import <checkout's
    name>.producers.feeder`` runs the checkout's files, its relative imports reaching
    schemas/, bus/, config/, ... on disk (a clone named tapioca: ``import tapioca...``,
    the names an import-graph tool draws)."""
    import subprocess

    name = ROOT.name
    if not name.isidentifier():
        pytest.skip(f"the checkout's folder name {name!r} is not a Python name")
    check = ("import importlib, sys\n"
             "m = importlib.import_module(sys.argv[1] + '.producers.feeder')\n"
             "print(m.__file__)\n"
             "print(sorted({k.split('.')[1] for k in sys.modules if k.startswith(sys.argv[1] + '.')}))\n")
    proc = subprocess.run([sys.executable, "-c", check, name], cwd=ROOT.parent,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    file, folders = proc.stdout.splitlines()[-2:]
    assert file == str(ROOT / "producers" / "feeder.py")
    assert {"producers", "schemas", "bus", "config", "algorithms"} <= set(ast.literal_eval(folders))


def test_the_installed_tapioca_package_is_this_checkout(tmp_path):
    """What an import-graph tool asks Python for (grimp and import-linter:
    ``find_spec("tapioca").submodule_search_locations``, then a walk of those folders)
    names the checkout itself, from any folder: with the editable install's old
    namespace package it named no folder, and the tools drew nothing."""
    import subprocess

    check = ("import importlib.util\n"
             "spec = importlib.util.find_spec('tapioca')\n"
             "print(spec.origin)\n"
             "print(list(spec.submodule_search_locations))\n")
    proc = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    origin, locations = proc.stdout.splitlines()[-2:]
    where = "; run `make install` (pip install -e .) to install this checkout"
    assert origin != "None" and Path(origin).resolve() == ROOT / "__init__.py", origin + where
    assert [Path(p).resolve() for p in ast.literal_eval(locations)] == [ROOT], locations + where


def test_converted_folders_import_the_package_relatively():
    left = []
    for path in package_files(RELATIVE_ONLY):
        if path.relative_to(ROOT).as_posix() in NOT_YET:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n.split(".")[0] == PREFIX for n in names):
                left.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not left, (f"absolute tapioca imports in {', '.join(RELATIVE_ONLY)}: {left}; "
                      "`python tests/unit/test_import_graph.py FOLDER` rewrites them")


def test_the_cli_modules_form_no_import_circle():
    """ops/cli.py composes the command modules; none of them imports it, and they do not
    import each other (the shared pieces live in ops/cli_context.py)."""
    files = {m: ROOT / "ops" / f"{m}.py" for m in CLI_MODULES}
    edges = {}
    for name, path in files.items():
        targets = set()
        for _, target, names in imports_of(path, f"{PREFIX}.ops.{name}"):
            targets.add(target)
            targets.update(f"{target}.{n}" for n in names)
        edges[name] = {m for m in CLI_MODULES if f"{PREFIX}.ops.{m}" in targets} - {name}
    assert edges["cli"] == set(CLI_MODULES) - {"cli"}
    assert edges["cli_context"] == set()
    for name in set(CLI_MODULES) - {"cli", "cli_context"}:
        assert edges[name] <= {"cli_context"}, f"ops/{name}.py imports {edges[name]}"


# Import circles between modules still to take apart, each with the work that does it.
KNOWN_CIRCLES: dict[frozenset[str], str] = {}


def import_circles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected groups of two or more modules in ``edges`` (imports at
    module level, in a function or for type checking alike: a tool draws them all),
    package ``__init__`` files aside (a package's registrations import its modules)."""
    graph: dict[str, set[str]] = {}
    for _, src, dst in edges:
        target = module_file(dst)
        if src != dst and target is not None and target.name != "__init__.py":
            graph.setdefault(src, set()).add(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while group[-1:] != [v]:
                group.append(stack.pop())
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_modules_form_no_import_circle():
    """Issue 38: five circles (bus/fleet <-> runner, models/attention <-> attention_fa4,
    models/forward <-> packed, the tasks registry ring, weights/files <-> adapter_files),
    all gone (the last through weights/payload.py, which reads and writes either payload)."""
    fleet, runner, nowhere = f"{PREFIX}.bus.fleet", f"{PREFIX}.bus.runner", f"{PREFIX}.bus.nowhere"
    assert import_circles([("", fleet, runner), ("", runner, fleet)]) == [[fleet, runner]]
    assert import_circles([("", fleet, nowhere), ("", nowhere, fleet)]) == []  # no such file
    circles = [frozenset(group) for group in import_circles(tree_edges())]
    assert [sorted(g) for g in circles if g not in KNOWN_CIRCLES] == []


def test_the_converter_writes_the_shortest_relative_form(tmp_path):
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from tapioca.producers.proxy.sessions import Session\n"
        "from tapioca.producers import rollout\n"
        "from tapioca.bus.replay import (\n    Replayer, ReplayFilter,\n)\n"
        "if TYPE_CHECKING:\n    from tapioca.bus.runner import RoleRunner\n"
        "def f():\n    from tapioca.schemas.errors import ConfigError  # why\n"
        "    return 'from tapioca.x import y'\n")
    path = ROOT / "producers" / "proxy" / "server.py"
    out = to_relative(source, path, f"{PREFIX}.producers.proxy.server")
    assert out == (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from .sessions import Session\n"
        "from .. import rollout\n"
        "from ...bus.replay import (\n    Replayer, ReplayFilter,\n)\n"
        "if TYPE_CHECKING:\n    from ...bus.runner import RoleRunner\n"
        "def f():\n    from ...schemas.errors import ConfigError  # why\n"
        "    return 'from tapioca.x import y'\n")
    # A package's __init__ imports relative to itself.
    init = to_relative("from tapioca.bus.admin import probe\n", ROOT / "bus" / "__init__.py",
                       f"{PREFIX}.bus")
    assert init == "from .admin import probe\n"
    assert to_relative(out, path, f"{PREFIX}.producers.proxy.server") == out


def test_the_folders_import_only_down_the_layer_table():
    bad = layer_violations(tree_edges())
    assert not bad, ("imports against the layer table (LAYERS in this file; roles never "
                     "import each other, they meet on the log):\n" + "\n".join(bad))


def test_no_role_imports_another_role():
    bad = role_violations(tree_edges())
    assert not bad, "roles meet on the log, never by import:\n" + "\n".join(bad)


def test_every_package_folder_has_a_layer_and_every_role_its_files():
    placed = {f for layer in LAYERS for f in layer}
    folders = {d.split("/")[0] for d in package_dirs().values()} - {"."}
    assert folders <= placed, f"put {sorted(folders - placed)} into a line of LAYERS"
    assert len(placed) == sum(map(len, LAYERS)), "a folder is in two layers"
    modules = package_files()
    for role, spec in ROLES.items():
        assert _role_modules(spec, modules), f"ROLES[{role!r}] names no module of the tree: {spec}"


def _planted(rel: str, source: str) -> list[Edge]:
    """The edges of a module that is not in the tree, parsed by the same code."""
    path = ROOT / rel
    parts = Path(rel).with_suffix("").parts
    return edges_of(path, ".".join((PREFIX, *parts)), source)


def test_the_layer_check_fails_on_a_planted_upward_import():
    edges = tree_edges()
    assert not layer_violations(edges)
    # bus/ (layer 7) importing a role (layer 2), inside a function as a tool draws it.
    up = _planted("bus/planted.py", "def f():\n    from ..producers.rollout import RolloutWorker\n")
    assert layer_violations(edges + up) == [
        "bus/planted.py:2: bus imports tapioca.producers.rollout, a layer above it"]
    # One role's folder importing another's: the same layer.
    side = _planted("consumers/planted.py", "from ..trainers import checkpoint\n")
    assert layer_violations(edges + side) == [
        "consumers/planted.py:1: consumers imports tapioca.trainers.checkpoint, a folder of its "
        "own layer ('producers', 'consumers', 'trainers', 'agents')"]
    # A folder the table does not place.
    new = _planted("newfolder/x.py", "from ..schemas.errors import TapiocaError\n")
    assert layer_violations(new) == [
        "newfolder/x.py:1: newfolder imports tapioca.schemas.errors, and LAYERS does not place "
        "newfolder"]
    # Down the table is fine: ops (layer 0) may import anything.
    assert not layer_violations(_planted("ops/planted.py", "from ..producers import feeder\n"))


def test_the_role_check_fails_on_a_planted_import_between_roles():
    edges = tree_edges()
    assert not role_violations(edges)
    # Inside producers/ the folder check passes; the role check does not: the feeder
    # reaching the rollout worker directly, or through a shared module of producers/
    # (inside a function: a tool draws it, and it runs when called).
    direct = _planted("producers/feeder.py", "from . import rollout\n")
    assert not layer_violations(edges + direct)
    assert role_violations(edges + direct) == [
        "role feeder imports role rollout's tapioca.producers.rollout (producers/feeder.py:1)"]
    shared = (_planted("producers/feeder.py", "def f():\n    from .planted import helper\n")
              + _planted("producers/planted.py", "from .rollout import RolloutWorker\n"))
    assert role_violations(edges + shared) == [
        "role feeder imports role rollout's tapioca.producers.rollout "
        "(producers/feeder.py:2 -> producers/planted.py:1)"]


def main(folders: list[str]) -> int:
    changed = 0
    for path, module in package_files(tuple(folders) or None).items():
        source = path.read_text()
        new = to_relative(source, path, module)
        if new != source:
            path.write_text(new)
            changed += 1
            print(f"rewrote {path.relative_to(ROOT)}")
    print(f"{changed} file(s) rewritten; now run `ruff check --fix --select I` to sort them")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
