"""The sweeps' one way to try a kernel module's knobs (module-level flags and sizes the
kernels read when traced): set inside a block, restored after it, even on an error."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def knobs(module, **values):
    """module's attributes set to values inside the block, restored after it."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
