"""torch's autoload registers the "ddpwire" backend, so no ``import ddpwire.torch`` is needed.

torch >= 2.5 calls every ``torch.backends`` entry point at ``import torch``;
ddpwire's entry point is _ddpwire_autoload.autoload. The scripts here run in
fresh interpreters started from a temporary directory, without PYTHONPATH,
and none of them imports ddpwire. They find ddpwire through its installation,
because torch reads the entry point from the installed metadata. A stale
editable install (from before the entry point existed) fails them; run
``pip install -e .`` again.
"""
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

torch = pytest.importorskip("torch")

from test_torch_backend import LIMIT, finish, free_ports  # noqa: E402

if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5):
    pytest.skip("torch < 2.5 has no backend autoloading", allow_module_level=True)
if not torch.distributed.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

import _ddpwire_autoload  # noqa: E402


def clean_env(**extra):
    """The environment without PYTHONPATH (so the checkout is not on
    sys.path) or any autoload switch, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def run_script(tmp_path, source, *, env=None, name="script.py"):
    """Run ``source`` as a script in ``tmp_path``; return the JSON object on
    its last line of stdout."""
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env or clean_env(),
                          capture_output=True, text=True, timeout=LIMIT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_entry_point_is_declared():
    found = [ep for ep in entry_points(group="torch.backends") if ep.name == "ddpwire"]
    assert len(found) == 1, ("no single torch.backends entry point named ddpwire (a stale install? "
                             f"run `pip install -e .`): {found}")
    assert found[0].value == "_ddpwire_autoload:autoload"
    assert found[0].load() is _ddpwire_autoload.autoload


IMPORT_TORCH = """
    import json, sys
    import torch
    import torch.distributed as dist
    plugin = dist.Backend._plugins.get("DDPWIRE")
    print(json.dumps({
        "registered": "ddpwire" in dist.Backend.backend_list,
        "capability": dist.Backend.backend_capability.get("ddpwire"),
        "creator": plugin and f"{plugin.creator_fn.__module__}.{plugin.creator_fn.__name__}",
        "hook": "_ddpwire_autoload" in sys.modules,
        "ddpwire": sorted(m for m in sys.modules if m == "ddpwire" or m.startswith("ddpwire.")),
        "defaults": dist.Backend.default_device_backend_map,
    }))
"""


def test_import_torch_registers_the_backend_without_importing_ddpwire(tmp_path):
    got, _ = run_script(tmp_path, IMPORT_TORCH)
    assert got["hook"] and got["registered"], got
    assert got["capability"] == ["cpu", "cuda", "mps"]
    assert got["creator"] == "_ddpwire_autoload._create"
    # neither the compiled core nor anything else of ddpwire: only the hook
    assert got["ddpwire"] == [], got
    # registering makes ddpwire no device's default (init_process_group() without a name)
    assert got["defaults"]["cpu"] == "gloo"
    assert "ddpwire" not in got["defaults"].values(), got["defaults"]


def test_autoload_off_leaves_the_explicit_import(tmp_path):
    store = tmp_path / "store"
    got, _ = run_script(tmp_path, f"""
        import json, sys
        import torch
        import torch.distributed as dist
        before = "ddpwire" in dist.Backend.backend_list
        hook = "_ddpwire_autoload" in sys.modules
        import ddpwire.torch
        plugin = dist.Backend._plugins["DDPWIRE"]
        dist.init_process_group("ddpwire", init_method="file://{store}", rank=0, world_size=1)
        t = torch.full((4,), 3.0)
        dist.all_reduce(t)
        backend = dist.get_backend()
        dist.destroy_process_group()
        print(json.dumps({{"before": before, "hook": hook, "sum": t.tolist(), "backend": backend,
                          "creator": plugin.creator_fn.__module__}}))
    """, env=clean_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert not got["before"] and not got["hook"], got
    assert got["backend"] == "ddpwire" and got["sum"] == [3.0] * 4
    # registered by ddpwire.torch with the real creator, through the same code
    assert got["creator"] == "ddpwire.torch.backend"


def test_import_ddpwire_torch_after_autoload_keeps_one_registration(tmp_path):
    got, stderr = run_script(tmp_path, """
        import json
        import torch
        import torch.distributed as dist
        first = dist.Backend._plugins["DDPWIRE"]
        import ddpwire.torch
        import _ddpwire_autoload
        again = _ddpwire_autoload.register()
        print(json.dumps({"same": dist.Backend._plugins["DDPWIRE"] is first, "again": again,
                          "count": dist.Backend.backend_list.count("ddpwire")}))
    """)
    assert got == {"same": True, "again": False, "count": 1}, (got, stderr)


def test_the_backend_takes_no_device_from_torchs_defaults(tmp_path):
    # torch 2.13 gives a registered backend each listed device that has no
    # default yet; drop mps's default, as in a torch without it
    got, _ = run_script(tmp_path, """
        import json
        import torch.distributed as dist
        import _ddpwire_autoload
        del dist.Backend.default_device_backend_map["mps"]
        before = dict(dist.Backend.default_device_backend_map)
        registered = _ddpwire_autoload.register()
        print(json.dumps({"registered": registered, "before": before,
                          "after": dist.Backend.default_device_backend_map,
                          "capability": dist.Backend.backend_capability["ddpwire"]}))
    """, env=clean_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert got["registered"] and got["capability"] == ["cpu", "cuda", "mps"], got
    assert got["after"] == got["before"], got


WORLD_SCRIPT = """
    import json, os, sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist

    lazy = not any(m == "ddpwire" or m.startswith("ddpwire.") for m in sys.modules)
    dist.init_process_group("ddpwire", timeout=timedelta(seconds=60))  # env://
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    backend = dist.get_backend()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "world": world, "lazy": lazy, "backend": backend,
                      "sum": sorted(set(t.tolist()))}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_init_process_group_without_importing_ddpwire(tmp_path, world):
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(WORLD_SCRIPT))
    port = free_ports(1)[0]
    procs = [subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path,
        env=clean_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    codes, outputs = finish(procs)
    assert codes == [0] * world, "\n".join(outputs)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    total = float(world * (world + 1) // 2)
    for rank, got in enumerate(results):
        assert got == {"rank": rank, "world": world, "lazy": True, "backend": "ddpwire",
                       "sum": [total]}, outputs[rank]


def test_a_broken_ddpwire_does_not_break_import_torch(tmp_path):
    # a ddpwire that fails to import, ahead of the installed one on sys.path
    (tmp_path / "ddpwire").mkdir()
    (tmp_path / "ddpwire" / "__init__.py").write_text('raise ImportError("broken ddpwire")\n')
    got, _ = run_script(tmp_path, """
        import json
        import torch
        import torch.distributed as dist
        registered = "ddpwire" in dist.Backend.backend_list
        try:
            dist.init_process_group("ddpwire", init_method="tcp://127.0.0.1:1", rank=0,
                                    world_size=1)
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"registered": registered, "error": error}))
    """)
    assert got["registered"], got
    # the error shows where it belongs: at init_process_group("ddpwire")
    assert got["error"] and "broken ddpwire" in got["error"], got


def test_the_hook_warns_once_and_never_raises(monkeypatch):
    def fail(creator=None):
        raise RuntimeError("no registry here")

    monkeypatch.setattr(_ddpwire_autoload, "register", fail)
    monkeypatch.setattr(_ddpwire_autoload, "_warned", False)
    with pytest.warns(RuntimeWarning, match="no registry here") as caught:
        _ddpwire_autoload.autoload()
        _ddpwire_autoload.autoload()
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1


def test_without_torch_distributed_the_hook_does_nothing(monkeypatch):
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("registered without torch.distributed")

    monkeypatch.setattr(dist, "is_available", lambda: False)
    monkeypatch.setattr(dist.Backend, "register_backend", refuse)
    assert _ddpwire_autoload.register() is False
    _ddpwire_autoload.autoload()  # no error, no warning
