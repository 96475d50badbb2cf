"""No module of the tree shadows an importable package.

A script run from a folder puts that folder first on ``sys.path`` (``python
benchmarks/x.py``), pytest puts each test folder there, and ``python -m pytest`` puts the
repository root there. A module in such a folder with the name of an installed top-level
package then replaces the package for every import in that process, a third party's
included: ``benchmarks/kernels.py`` did so to the ``kernels`` package once transformers
5.25 began importing it (issue 36), failing every 2-rank test and the benchmarks.

The check covers every folder of ``benchmarks/``, ``examples/`` and ``tests/`` that holds
Python files, and the repository root itself (its top-level folders are the layers).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from importlib.machinery import PathFinder
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("benchmarks", "examples", "tests")


def _script_folders() -> list[Path]:
    """The repository root and every folder under SCANNED that holds a .py file."""
    folders = [ROOT]
    for base in SCANNED:
        for dirpath, dirnames, filenames in os.walk(ROOT / base):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            if any(f.endswith(".py") for f in filenames):
                folders.append(Path(dirpath))
    return folders


def _names(folder: Path) -> set[str]:
    """What ``import NAME`` would find in ``folder``: its modules and its sub-folders."""
    out = set()
    for entry in folder.iterdir():
        if entry.name.startswith((".", "__")):
            continue
        if entry.suffix == ".py":
            out.add(entry.stem)
        elif entry.is_dir():
            out.add(entry.name)
    return out


def _clashes(folders: list[Path]) -> list[str]:
    """Entries of ``folders`` whose name an import would otherwise resolve elsewhere: an
    installed distribution's top-level name, the standard library, or anything on
    ``sys.path`` outside these folders."""
    ours = {str(f.resolve()) for f in folders}
    # sys.path without the folders themselves (pytest inserted some of the tree's)
    elsewhere = [p for p in sys.path if p and str(Path(p).resolve()) not in ours]
    installed = set(importlib.metadata.packages_distributions())
    out = []
    for folder in folders:
        for name in sorted(_names(folder)):
            if (name in installed or name in sys.stdlib_module_names or name in sys.builtin_module_names
                    or PathFinder.find_spec(name, elsewhere) is not None):
                out.append(str(folder / name))
    return out


def test_no_module_of_the_tree_has_the_name_of_an_importable_package():
    clashes = [str(Path(c).relative_to(ROOT)) for c in _clashes(_script_folders())]
    assert not clashes, (
        f"these modules or folders of the tree have the name of an importable package and "
        f"replace it in any process that has their folder on sys.path: {clashes}; rename them")


def test_the_check_reports_a_planted_clash(tmp_path):
    # the check itself: a module named like an installed package, a standard-library
    # module and a package folder are reported; a fresh name is not
    installed = sorted(n for n in importlib.metadata.packages_distributions() if n.isidentifier())[0]
    for name in (f"{installed}.py", "json.py", "tapioca_fresh_name_xyz.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "email").mkdir()
    found = {Path(c).name for c in _clashes([tmp_path])}
    assert found == {installed, "json", "email"}, found
