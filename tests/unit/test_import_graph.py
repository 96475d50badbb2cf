"""Imports a tool can follow from the checkout as it lies on disk.

The package's folders install as ``tapioca.<folder>`` (pyproject.toml ``package-dir``),
but the checkout has no ``tapioca/`` folder, so a tool that maps ``tapioca.bus.runner``
to a file finds nothing. Inside the package, modules import each other relatively
(``from ..bus.runner import RoleRunner``, ``from .role import Role``): the dots name the
folders. These tests check that every relative import resolves to a file of the tree,
that the folders in ``RELATIVE_ONLY`` have no absolute ``tapioca.`` import left, and that
the ``tapioca`` CLI modules form no import circle.

The converter is here too. ``python tests/unit/test_import_graph.py [FOLDER ...]``
rewrites the absolute ``from tapioca.X import ...`` statements of the package's modules
(default: every package folder) into their relative form, in place; run ``ruff check
--fix --select I`` afterwards to sort the moved imports. Tests, benchmarks and examples
are not part of the package and keep importing ``tapioca.*``.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "tapioca"
# Folders whose modules may hold no absolute self-import; None: every package folder.
RELATIVE_ONLY: tuple[str, ...] | None = None
# Modules exempt from that rule (none left).
NOT_YET: tuple[str, ...] = ()
# The modules that make up the `tapioca` command.
CLI_MODULES = ("cli", "cli_context", "admin_cli", "commands", "fleet_cli", "supervised_cli",
               "plot", "proxy_cli", "replay_cli")


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
    roots = sorted({d.split("/")[0] for d in dirs.values()})
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


def imports_of(path: Path, module: str) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every ``from ... import`` of a module,
    module level or not (a tool draws both)."""
    tree = ast.parse(path.read_text())
    return [(n.lineno, resolve(module, path, n), [a.name for a in n.names])
            for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]


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
