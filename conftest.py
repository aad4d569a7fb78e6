"""Shared pytest setup for every test file, under Bazel and under plain pytest.

- The import path: a checkout run (`pytest packages/...`) puts the four package roots on
  sys.path, as Bazel's `imports = ["."]` does.
- Eight host devices, so the shard_map tests can build an 8-way mesh on CPU; set before
  JAX initialises its backends.
- Tests marked gpu/tpu skip, saying why, where that accelerator is absent; under
  `bazel test --config=gpu|tpu` (PALLASITE_REQUIRE_ACCELERATOR) they fail instead.
- Autotune-on-miss off (PALLASITE_AUTOTUNE=0) unless the environment says otherwise.
"""

import os
import sys

_ROOT = os.path.dirname(os.path.abspath(__file__))
for _pkg in ("reference", "kernels", "tuning", "bench"):
    _path = os.path.join(_ROOT, "packages", _pkg)
    if os.path.isdir(_path) and _path not in sys.path:
        sys.path.insert(0, _path)

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# On a GPU a kernel call that misses the tuned table tunes itself (seconds per key) and
# runs whichever config won: a GPU parity test would then check a config it did not name,
# one that can differ from run to run and machine to machine, and would read and write the
# user's autotune cache. With it off, tests run the configs they name or the table's and
# defaults; tests of the tuning itself turn it on with monkeypatch.setenv.
os.environ.setdefault("PALLASITE_AUTOTUNE", "0")

import pytest  # noqa: E402


def _devices():
    import jax

    return [d.platform for d in jax.devices()]


def _has_platform(name):
    import jax

    try:
        return bool(jax.devices(name))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    required = os.environ.get("PALLASITE_REQUIRE_ACCELERATOR", "")
    for platform in ("gpu", "tpu"):
        marked = [item for item in items if platform in item.keywords]
        if marked and platform == required and not _has_platform(platform):
            # bazel test --config=gpu|tpu: a passing run must have run on the device.
            raise pytest.UsageError(
                f"PALLASITE_REQUIRE_ACCELERATOR={required}: {len(marked)} test(s) need a "
                f"{platform.upper()} and JAX sees none (devices: {_devices()}); run them "
                f"where one is, with jax's {platform.upper()} plugin installed (bazel "
                f"--config={platform} makes that venv)")
        if marked and not _has_platform(platform):
            skip = pytest.mark.skip(reason=f"needs a {platform.upper()}: none is visible to JAX")
            for item in marked:
                item.add_marker(skip)
