"""The package's layers, and that imports only go down them (issue 43).

Every module of ddpwire/ is in one layer, lowest first:

- wire: the compiled core, the messages and their extensions, errors, a
  framed connection (channel), keys and seals, a connection's lifecycle;
- plane: moving and reducing vectors (plans, the mesh, shared memory, the
  star's and the mesh's steps, the collective service, rank and p2p links);
- session: who takes part and what each step does (admission, roster,
  membership, balancing, options, the Coordinator and the Worker);
- torch: the torch.distributed backend and the training helpers;
- face: what a user starts (the command, the demo, the package's names).

A module may import from its own layer and those below it, never above,
at module level or inside a function alike. A new module must be given a
layer here (the test names any that is not).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, Set, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "ddpwire"

LAYERS: Dict[str, Tuple[str, ...]] = {
    "wire": ("_core", "_version", "_text", "errors", "messages", "extensions", "deadlines",
             "auth", "seal", "channel", "lifecycle", "launch", "sessioninfo", "threads",
             "incast"),
    "plane": ("plan", "reduce", "shm", "socket_threads", "star_step", "mesh", "mesh_step",
              "collectives", "p2p", "uplink", "torch.links"),
    "session": ("admission", "roster", "star", "elastic", "handover", "model_state",
                "shard_inbox", "splits", "step_model", "trials", "guard", "balance", "options",
                "join", "intake", "mesh_control", "results", "metrics", "progress",
                "coordinator", "worker"),
    "torch": ("torch", "torch.backend", "torch.balanced", "torch.buffer", "torch.comm_hook",
              "torch.composed", "torch.data", "torch.device", "torch.hooks", "torch.job",
              "torch.local_steps", "torch.models", "torch.rank_order", "torch.rendezvous",
              "torch.sparse", "torch.staging", "torch.trainer"),
    "face": ("", "__main__", "cli", "demo", "serve", "plot", "torch_check"),
}
ORDER = list(LAYERS)
LAYER_OF = {module: layer for layer, modules in LAYERS.items() for module in modules}


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
                base = package[:len(package) - (node.level - 1)]
            elif node.module and (node.module == "ddpwire" or node.module.startswith("ddpwire.")):
                base = []
                node_module = node.module[len("ddpwire"):].lstrip(".")
                found |= _resolve(base, node_module, node.names)
                continue
            else:
                continue
            found |= _resolve(base, node.module or "", node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ddpwire."):
                    found.add(alias.name[len("ddpwire."):])
    return {m for m in found if m in LAYER_OF or _is_module(m)}


def _resolve(base, module: str, names) -> Set[str]:
    target = ".".join(base + ([module] if module else []))
    out = {target} if module else set()  # "from . import x" imports x, not the package
    for alias in names:  # "from . import mesh": the name may be a module
        out.add(f"{target}.{alias.name}" if target else alias.name)
    return {m for m in out if _is_module(m)}


def _is_module(name: str) -> bool:
    path = PACKAGE.joinpath(*name.split(".")) if name else PACKAGE
    return name == "_core" or path.with_suffix(".py").is_file() or \
        (path / "__init__.py").is_file()


def test_every_module_has_a_layer():
    missing = [name for name, _ in modules() if name not in LAYER_OF]
    assert not missing, f"give these modules a layer in tests/test_layers.py: {missing}"
    stale = [m for m in LAYER_OF if not _is_module(m)]
    assert not stale, f"no such modules (moved or deleted?): {stale}"


def test_imports_only_go_down():
    upward = []
    for name, path in modules():
        mine = ORDER.index(LAYER_OF[name])
        for dep in sorted(imports(name, path)):
            if ORDER.index(LAYER_OF[dep]) > mine:
                upward.append(f"{name or 'ddpwire'} ({LAYER_OF[name]}) -> {dep} ({LAYER_OF[dep]})")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself: an import up a layer, inside a function, is found."""
    module = tmp_path / "errors.py"
    module.write_text("def f():\n    from .coordinator import Coordinator\n")
    assert "coordinator" in imports("errors", module)
