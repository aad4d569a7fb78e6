"""How a sharded case's inputs are laid out: a mesh over the first devices, and one
PartitionSpec per input, the way a data- and tensor-parallel training step holds them.

  grouped_projection  x [m, k]: tokens over "data"; kernel [g, k, n]: columns over
                      "model"; dy [m, n] over both; group_sizes replicated (global counts).
  chunk_ssd           x, dy [b, l, h, p] and a [b, l, h]: batch over "data", heads over
                      "model"; b, c [b, l, g, n]: batch over "data", groups over "model"
                      where they split with the heads, else replicated; initial_state and
                      dfinal [b, h, p, n]: batch and heads.
The mesh has Explicit axes (jax.make_mesh's default), so pallasite reads the layouts from
the arrays' types. Checks run on copies gathered to the first device (`gathered`).
"""

from __future__ import annotations

import numpy as np

from pallasite.bench import ops


def mesh(case: ops.Case):
    import jax

    names = tuple(name for name, _ in case.mesh)
    sizes = tuple(size for _, size in case.mesh)
    devices = np.asarray(jax.devices()[:case.devices]).reshape(sizes)
    return jax.sharding.Mesh(devices, names,
                             axis_types=(jax.sharding.AxisType.Explicit,) * len(names))


def specs(case: ops.Case) -> dict[str, tuple]:
    """Per input name, the mesh axis of each dimension (None: replicated)."""
    axes = dict(case.mesh)
    data = "data" if "data" in axes else None
    model = "model" if "model" in axes else None
    if case.op == ops.GP:
        return {"x": (data, None), "kernel": (None, None, model), "group_sizes": (None,),
                "dy": (data, model)}
    groups = case.d["g"]
    split = model if model and groups % axes["model"] == 0 else None
    x = (data, None, model, None)
    state = (data, model, None, None)
    bc = (data, None, split, None)
    return {"x": x, "a": (data, None, model), "b": bc, "c": bc, "initial_state": state,
            "dy": x, "dfinal": state}


def place(case: ops.Case, inputs: dict) -> dict:
    """`inputs` laid out over the case's mesh (unchanged for a one-device case)."""
    if not case.mesh:
        return inputs
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    m, layout = mesh(case), specs(case)
    return {k: jax.device_put(v, NamedSharding(m, P(*layout[k]))) for k, v in inputs.items()}


def gathered(tree):
    """`tree`'s arrays copied whole to the first device, through the host (for the checks;
    an array of an Explicit mesh keeps its mesh in its type through a device-to-device
    copy, which the checks' indexing then refuses)."""
    import jax

    device = jax.devices()[0]
    return jax.tree.map(
        lambda t: jax.device_put(np.asarray(t), device) if hasattr(t, "sharding") else t, tree)
