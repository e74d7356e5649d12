"""The package's layers are its folders, and imports only go down them (issue 43).

Lowest first:

- ``ddpwire/wire/``: the messages and their extensions, errors, a framed
  connection (channel), the keys and seals of a link; below it only the
  compiled core and the package's private helpers (``_core``, ``_text``,
  ``_version``);
- ``ddpwire/plane/``: moving and reducing vectors (plans, the mesh and its
  steps, the star's step, shared memory, the collective service, rank and
  point-to-point links);
- ``ddpwire/session/``: who takes part and what each step does (admission,
  the roster, membership, balancing, options, the Coordinator and Worker);
- ``ddpwire/torch/``: the torch.distributed backend and training helpers;
- ``ddpwire/cli/`` and the package's own face (``ddpwire/__init__.py``,
  ``__main__.py``): what a user starts and imports.

A module may import from its own layer and those below it, never above,
at module level or inside a function alike. The compiled core's one import
up is ``wire/errors.py``, whose exceptions it raises and which imports
nothing of ddpwire. A new module goes in a folder
(the test names any that sits elsewhere).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, Set, Tuple

import pytest

import ddpwire

# the package imported: the checkout's, or an installed wheel's where the
# suite runs against one (CI removes the source tree's ddpwire/ there)
PACKAGE = Path(ddpwire.__file__).resolve().parent

ORDER = ["core", "wire", "plane", "session", "torch", "face"]
#: the modules outside the layer folders, and their place
ROOT = {"_core": "core", "_text": "core", "_version": "core", "": "face", "__main__": "face"}
FOLDERS = {"wire": "wire", "plane": "plane", "session": "session", "torch": "torch",
           "cli": "face"}


def layer_of(name: str) -> str:
    """The layer of module ``name`` (dotted under ddpwire; "" is the package)."""
    if name in ROOT:
        return ROOT[name]
    folder = name.split(".")[0]
    if folder in FOLDERS:
        return FOLDERS[folder]
    raise KeyError(name)


def modules() -> Iterator[Tuple[str, Path]]:
    """(name under ddpwire, "" for the package itself; its file) of every module."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def imports(name: str, path: Path) -> Set[str]:
    """The ddpwire modules ``name`` imports, anywhere in its file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [p for p in package if p]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base, module = package[:len(package) - (node.level - 1)], node.module or ""
            elif node.module == "ddpwire" or (node.module or "").startswith("ddpwire."):
                base, module = [], node.module[len("ddpwire."):]
            else:
                continue
            found |= _resolve(base, module, node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "ddpwire":
                    found.add("")
                elif alias.name.startswith("ddpwire."):
                    found.add(alias.name[len("ddpwire."):])
    return {m for m in found if _is_module(m)}


def _resolve(base, module: str, names) -> Set[str]:
    """What "from <base + module> import <names>" imports: each name that is
    a module, else the module it comes from ("" is the package's face)."""
    target = ".".join(base + ([module] if module else []))
    out = set()
    for alias in names:
        sub = f"{target}.{alias.name}" if target else alias.name
        out.add(sub if _is_module(sub) else target)
    return {m for m in out if _is_module(m)}


def _is_module(name: str) -> bool:
    path = PACKAGE.joinpath(*name.split(".")) if name else PACKAGE
    return name == "_core" or path.with_suffix(".py").is_file() or \
        (path / "__init__.py").is_file()


def test_every_module_is_in_a_layer():
    assert len(list(modules())) > 50  # the package was found, not an empty folder
    stray = []
    for name, _ in modules():
        try:
            layer_of(name)
        except KeyError:
            stray.append(name)
    assert not stray, f"put these modules in a layer's folder: {stray}"


def test_imports_only_go_down():
    upward = []
    for name, path in modules():
        mine = ORDER.index(layer_of(name))
        for dep in sorted(imports(name, path)):
            if ORDER.index(layer_of(dep)) > mine:
                upward.append(f"{name or 'ddpwire'} ({layer_of(name)}) -> {dep} "
                              f"({layer_of(dep)})")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself: an import up a layer, inside a function, is found."""
    module = tmp_path / "errors.py"
    module.write_text("def f():\n    from ..session.coordinator import Coordinator\n"
                      "def g():\n    import ddpwire\n")
    assert {"session.coordinator", ""} <= imports("wire.errors", module)
    assert layer_of("session.coordinator") == "session" and layer_of("wire.errors") == "wire"


def _compiled_imports() -> Set[str]:
    """The ddpwire modules the compiled core's sources import at run time
    (`import` and `from ... import`, not `cimport`)."""
    found: Set[str] = set()
    for path in sorted(PACKAGE.glob("_core.pyx")) + sorted(PACKAGE.glob("_*.pxi")):
        for line in path.read_text(encoding="utf-8").splitlines():
            m = re.match(r"\s*from\s+(\.*)(ddpwire\.)?([\w.]*)\s+import\s+(?!.*\bcimport\b)", line)
            if m and (m.group(1) or m.group(2)):
                found.add(m.group(3))
            m = re.match(r"\s*import\s+ddpwire\.([\w.]+)", line)
            if m:
                found.add(m.group(1))
    return found


def test_the_compiled_core_imports_only_the_error_classes():
    # the core is the lowest layer, but it raises ddpwire's exceptions: the
    # one edge up it may take is to wire.errors, which imports nothing of
    # ddpwire (so no cycle and nothing above comes with it)
    if not (PACKAGE / "_core.pyx").exists():
        pytest.skip("the compiled core's sources are not in this tree (an installed wheel)")
    assert _compiled_imports() == {"wire.errors"}
    assert imports("wire.errors", PACKAGE / "wire" / "errors.py") == set()
