"""The Python package's imports point down: every module imports only modules of its own row, or
of rows above it, in docs/architecture.md's Python table (the Rust side's twin is
``crates/oxcomm/tests/it/layers.rs``). Every module of the package must be in the table.

Imports are read from the source (``ast``), at module level and inside functions alike: a lazy
import that runs up is an upward import all the same.
"""

from __future__ import annotations

import ast
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(os.path.dirname(HERE), "python", "oxcomm")
ARCHITECTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(HERE))), "docs", "architecture.md")

#: The only imports that run up, each with its reason (see the table's introduction).
EXCEPTIONS = {
    ("__init__.py", "onebit.py"): "re-exported as oxcomm.onebit once Communicator is defined",
    ("__init__.py", "coalesced.py"): "re-exported as oxcomm.coalesced once Communicator is defined",
}


def _rows():
    """{file or folder/ of the package: its row in the table}."""
    text = open(ARCHITECTURE, encoding="utf-8").read()
    start = text.index("The Python package (`oxcomm-py/python/oxcomm/`)")
    table = text[start : text.index("Tests: `oxcomm-py/tests/`", start)]
    rows = {}
    for k, line in enumerate(ln for ln in table.splitlines() if ln.startswith("| `")):
        first = line.split("|")[1]
        for name in re.findall(r"`([^`]+)`", first):
            rows[name] = k
    return rows


def _row_of(rel, rows):
    """The row of a module path relative to the package (``torch/ops.py``, ``__init__.py``)."""
    top = rel.split("/")[0]
    if "/" in rel and top + "/" in rows:
        return rows[top + "/"]
    return rows.get(rel)


def _module_path(name):
    """``oxcomm.x.y`` → the file it names, relative to the package (None outside oxcomm)."""
    parts = name.split(".")
    if parts[0] != "oxcomm":
        return None
    rest = parts[1:]
    if not rest:
        return "__init__.py"
    if rest[0] == "_native":
        return "_native.pyi"
    base = os.path.join(PACKAGE, *rest)
    if os.path.isdir(base):
        return "/".join(rest) + "/__init__.py"
    return "/".join(rest) + ".py"


def _imports(rel):
    """The oxcomm modules the file ``rel`` imports (absolute names)."""
    path = os.path.join(PACKAGE, rel)
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    here = ["oxcomm", *rel[: -len(".py")].split("/")]
    package = here[:-1] if not rel.endswith("__init__.py") else here[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                # `from . import onebit` names a module; `from oxcomm import ReduceOp` the package
                candidate = f"{mod}.{a.name}"
                found = _module_path(candidate)
                if found and (found == "_native.pyi" or os.path.exists(os.path.join(PACKAGE, found))):
                    out.add(candidate)
                else:
                    out.add(mod)
    return {m for m in out if m == "oxcomm" or m.startswith("oxcomm.")}


def _files():
    for root, _, names in os.walk(PACKAGE):
        for n in names:
            if n.endswith(".py"):
                yield os.path.relpath(os.path.join(root, n), PACKAGE).replace(os.sep, "/")


def test_every_module_is_in_the_table():
    rows = _rows()
    missing = sorted(rel for rel in _files() if _row_of(rel, rows) is None)
    assert not missing, f"modules missing from docs/architecture.md's Python table: {missing}"


def test_imports_point_down():
    rows = _rows()
    upward = []
    for rel in sorted(_files()):
        mine = _row_of(rel, rows)
        for name in sorted(_imports(rel)):
            target = _module_path(name)
            theirs = _row_of(target, rows) if target else None
            if theirs is None:
                # a package's __init__ named by its folder (oxcomm.optim, oxcomm._cuda)
                theirs = rows.get(target.split("/")[0] + "/") if target else None
            if theirs is not None and theirs > mine and (rel, target) not in EXCEPTIONS:
                upward.append(f"{rel} (row {mine}) imports {name} (row {theirs})")
    assert not upward, "imports that run up the table:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import():
    """The checker itself: a made-up upward edge is found (so a green run means something)."""
    rows = _rows()
    assert _row_of("onebit_torch.py", rows) < _row_of("torch/process_group.py", rows)
    assert "oxcomm.torch.process_group" not in _imports("onebit_torch.py")
    assert "oxcomm._cuda" in {m.rsplit(".", 1)[0] for m in _imports("__init__.py")} | _imports("__init__.py")
