"""Registers ddpwire's torch.distributed backend when torch is imported.

torch >= 2.5 calls every ``torch.backends`` entry point at the end of
``import torch``, unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``. ddpwire's entry
point is :func:`autoload`, so ``dist.init_process_group("ddpwire")`` works
without ``import ddpwire.torch``.

This module sits outside the ``ddpwire`` package on purpose. Importing
anything under ``ddpwire`` runs ddpwire/__init__.py, and that loads the
compiled core, so every ``import torch`` on the machine would pay for it.
This module imports only the standard library and torch.distributed, which is
already loaded when the hook runs. It registers the backend's name with a
creator that imports ddpwire.torch's real one on the first
``init_process_group("ddpwire")``.

:func:`register` is the only place that registers the backend;
``ddpwire.torch.backend.register`` (called by ``import ddpwire.torch``) calls
it as well.
"""
import warnings

#: the backend's name, as given to ``init_process_group``
BACKEND = "ddpwire"
#: devices whose tensors the backend takes (cuda and mps ones go through host memory)
DEVICES = ("cpu", "cuda", "mps")

_warned = False


def _create(store, rank, world_size, timeout):
    """The creator registered by the hook. It imports ddpwire.torch's real
    creator on first use."""
    from ddpwire.torch.backend import _create as create

    return create(store, rank, world_size, timeout)


def register(creator=None) -> bool:
    """Register the ``"ddpwire"`` backend for :data:`DEVICES`, with
    ``creator`` (default: the lazy :func:`_create`), unless it is registered
    already. Does nothing where torch has no torch.distributed. Returns True
    when it registered the backend now.

    The check comes first because ``Backend.register_backend`` overwrites an
    existing name in torch 2.13, and older torch asserts that it is new.

    The backend never becomes a device's default: what
    ``init_process_group()`` picks without a backend name stays torch's.
    Some torch versions make a registered backend the default for every
    device it lists other than cpu and cuda (mps here), or for any device
    that has no default yet. With autoloading, that would happen to every
    program that imports torch.
    """
    import torch.distributed as dist

    if not dist.is_available():
        return False
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return False
    defaults = getattr(dist.Backend, "default_device_backend_map", None)
    kept = dict(defaults) if isinstance(defaults, dict) else None
    dist.Backend.register_backend(BACKEND, creator or _create, devices=list(DEVICES))
    if kept is not None:
        defaults.clear()
        defaults.update(kept)
    return True


def autoload() -> None:
    """The ``torch.backends`` entry point. It never raises: torch would turn
    the error into a RuntimeError from ``import torch``, so a broken ddpwire
    would break torch. It warns once instead, and ``import ddpwire.torch``
    still registers the backend (or shows the real error)."""
    global _warned
    try:
        register()
    except Exception as err:  # noqa: BLE001 - must not break import torch
        if not _warned:
            _warned = True
            warnings.warn(
                f"ddpwire: could not register the 'ddpwire' torch.distributed backend at "
                f"import torch ({type(err).__name__}: {err}); `import ddpwire.torch` registers "
                "it explicitly (TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns off torch's autoloading)",
                RuntimeWarning,
                stacklevel=2,
            )
