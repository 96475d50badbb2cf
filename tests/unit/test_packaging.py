"""The wheel ships every module of the tree.

The top-level folders (schemas/, bus/, producers/, ...) install as ``tapioca.*``
through ``[tool.setuptools] packages`` and ``package-dir`` in pyproject.toml; a
sub-folder missing there is silently left out of the wheel. This builds the wheel with
setuptools' own backend (in a subprocess, from a copy of pyproject.toml, README.md and
the package folders, so the checkout gets no build/ or egg-info; no network) and
compares its files with the tree.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "tapioca"


def _setuptools_config() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _package_roots(cfg: dict) -> list[str]:
    """The top-level folders the package is made of (``tapioca.X = "X"`` entries; the
    root itself, ``tapioca = "."``, is the package's ``__init__.py`` only)."""
    return sorted({d.split("/")[0] for d in cfg["package-dir"].values()} - {"."})


def _tree_files(roots: list[str]) -> set[str]:
    """Where every file of the package folders must be in the wheel: modules, and the
    exported JSON Schemas (the package's data)."""
    out = {f"{PREFIX}/__init__.py"}  # the repository root's: the checkout is the package
    for root in roots:
        for path in (ROOT / root).rglob("*"):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            rel = path.relative_to(ROOT).as_posix()
            if path.suffix == ".py" or rel.startswith("schemas/json/"):
                out.add(f"{PREFIX}/{rel}")
    return out


def _build_wheel(tmp_path: Path, roots: list[str]) -> tuple[Path, str]:
    src, out = tmp_path / "src", tmp_path / "dist"
    src.mkdir()
    out.mkdir()
    for name in ("pyproject.toml", "README.md", "__init__.py"):
        shutil.copy2(ROOT / name, src / name)
    for root in roots:
        shutil.copytree(ROOT / root, src / root,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run(
        [sys.executable, "-c",
         "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))",
         str(out)], cwd=src, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        "building the wheel failed (the dev extra has setuptools>=77):\n" + proc.stderr[-3000:])
    return out / proc.stdout.strip().splitlines()[-1], proc.stdout + proc.stderr


def test_wheel_ships_every_module_and_schema_of_the_tree(tmp_path):
    cfg = _setuptools_config()
    roots = _package_roots(cfg)
    assert {"schemas", "bus", "producers", "consumers", "trainers", "ops"} <= set(roots)
    wheel, log = _build_wheel(tmp_path, roots)
    shipped = {n for n in zipfile.ZipFile(wheel).namelist()
               if n.startswith(f"{PREFIX}/") and not n.endswith("/")}
    expected = _tree_files(roots)
    missing = sorted(expected - shipped)
    assert not missing, (
        "the wheel leaves out these files; add their folder's package (e.g. "
        "tapioca.engines.kernels) to [tool.setuptools] packages and package-dir in "
        f"pyproject.toml: {missing}")
    extra = sorted(n for n in shipped - expected if n.endswith(".py"))
    assert not extra, f"the wheel ships modules the tree does not have: {extra}"
    assert any(n.endswith("/reward.schema.json") for n in shipped)
    # setuptools' own complaint about data folders that are not declared packages.
    assert "is absent from the `packages` configuration" not in log, log[-3000:]


def test_every_listed_package_has_a_folder_and_every_folder_is_listed():
    cfg = _setuptools_config()
    packages, dirs = set(cfg["packages"]), cfg["package-dir"]
    assert packages == set(dirs), "packages and package-dir must list the same packages"
    # The root is `tapioca` (its __init__.py), so the folders' relative imports resolve
    # on disk as they do installed (tests/unit/test_import_graph.py).
    assert dirs.pop(PREFIX) == "." and (ROOT / "__init__.py").is_file()
    for name, folder in dirs.items():
        assert (ROOT / folder).is_dir(), f"{name} maps to {folder}/, which does not exist"
        assert name == f"{PREFIX}." + folder.replace("/", "."), (
            f"{name} = {folder!r}: package names follow the folders")
    for root in _package_roots(cfg):
        for init in (ROOT / root).rglob("__init__.py"):
            name = f"{PREFIX}." + init.parent.relative_to(ROOT).as_posix().replace("/", ".")
            assert name in packages, f"{init.parent.relative_to(ROOT)}/ is not in packages"


def test_the_installed_wheel_resolves_its_relative_imports(tmp_path):
    """Inside the package, modules import each other relatively (``from ..bus.runner
    import RoleRunner``; tests/unit/test_import_graph.py). Installed from the wheel, where
    the folders sit under ``tapioca/``, the CLI and a role process start: their modules
    come from the wheel and run as ``python -m`` runs them."""
    import os

    wheel, _ = _build_wheel(tmp_path, _package_roots(_setuptools_config()))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    check = (
        "import runpy, sys\n"
        "site, module = sys.argv[1], sys.argv[2]\n"
        "import importlib\n"
        "m = importlib.import_module(module)\n"
        "assert m.__file__.startswith(site), (m.__file__, 'is not the wheel copy')\n"
        "sys.argv = [module, '--help']\n"
        "runpy.run_module(module, run_name='__main__', alter_sys=True)\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    for module in ("tapioca.ops.cli", "tapioca.ops.role_main"):
        proc = subprocess.run([sys.executable, "-c", check, str(site), module], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, f"{module} from the wheel:\n{proc.stderr[-3000:]}"
        assert "Usage" in proc.stdout or "usage" in proc.stdout, proc.stdout[-2000:]
