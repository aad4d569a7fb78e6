"""Every module of pallasite imports by its dotted path (nothing shadows a subpackage)."""

import importlib
import pkgutil

import pytest

import pallasite.bench
import pallasite.kernels
import pallasite.reference
import pallasite.tuning


def _modules():
    for package in (pallasite.reference, pallasite.kernels, pallasite.tuning,
                    pallasite.bench):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not info.name.endswith(".__main__"):  # importing it runs the CLI
                yield info.name


@pytest.mark.parametrize("name", sorted(_modules()))
def test_import_by_dotted_path(name):
    if name.endswith((".pallas_mosaic_gpu", ".pallas_triton", ".pallas_mosaic_tpu")):
        pytest.importorskip("jax.experimental.pallas")
    module = importlib.import_module(name)
    # `import a.b.c as m` walks attributes: each step must be the module, not a function.
    walked = importlib.import_module(name.split(".")[0])
    for part in name.split(".")[1:]:
        walked = getattr(walked, part)
    assert walked is module, f"{name}: an attribute shadows the module"
