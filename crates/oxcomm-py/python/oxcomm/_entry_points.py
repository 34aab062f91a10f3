"""What the wheel's entry points load: torch's lazy backend lookup finds ``"oxcomm"`` here.

The wheel registers :func:`register_torch_backend` in the ``torch.distributed.backends``
entry-point group (``pyproject.toml``). torch (2.15) looks a backend name up there the first
time a group is asked for it (``init_process_group("oxcomm")``, ``new_group(backend="oxcomm")``,
``is_backend_available("oxcomm")``), loads this function and calls it; it must register the
name. So a script, a launcher or a config that names the backend as a string (Lightning's
``process_group_backend``, DeepSpeed's ``dist_backend``) needs no ``import oxcomm.torch``.

This module owns only that hand-off: it imports nothing heavy itself, so that a failure to load
the backend reaches the user as one message naming it, not as torch's bare "failed to load".
"""


def register_torch_backend():
    """Register the torch.distributed backend ``"oxcomm"`` (importing :mod:`oxcomm.torch` does)."""
    try:
        import oxcomm.torch  # noqa: F401  (registers "oxcomm" on import)
    except Exception as e:  # noqa: BLE001 - reported whole, with its cause chained
        raise RuntimeError(
            f"oxcomm: the torch.distributed backend 'oxcomm' could not load: {type(e).__name__}: {e} "
            "(`python -c 'import oxcomm.torch'` shows the whole error; reinstall oxcomm for this torch "
            "with `pip install oxcomm`, or name another backend)"
        ) from e
