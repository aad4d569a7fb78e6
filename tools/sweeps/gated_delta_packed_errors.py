"""Relative L2 of chunk_gated_delta_rule's values and six gradients with packed sequences
(cu_seqlens traced), per implementation, against the float64 sequential definition
evaluated on the host CPU: one JSON line per (case, implementation). For a device whose
compiled kernels may differ from the interpreters' (a TPU: docs/gated_delta_rule.md).

    PYTHONPATH=<the four package roots>:packages/kernels/tests \\
        python3 tools/sweeps/gated_delta_packed_errors.py [--implementation NAME ...]
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

import gated_delta_testlib as testlib
from pallasite.kernels import chunk_gated_delta_rule

# (name, testlib.inputs arguments, cu_seqlens, chunk): each with whole padding chunks
# after its last sequence, the layout's bound for N sequences.
CASES = (("five_sequences", dict(t=100, n=5), [0, 5, 5, 32, 90, 100], 16),
         ("two_on_chunk_bounds", dict(t=64, n=2), [0, 32, 64], 16),
         ("one_sequence_as_packed", dict(t=64, n=1), [0, 64], 16))
SHAPE = dict(b=1, hk=1, hv=2, dk=32, dv=32)


def errors(implementation, a, cu, chunk):
    fn = functools.partial(chunk_gated_delta_rule, implementation=implementation,
                           chunk_size=chunk)
    return testlib.packed_errors(fn, a, cu)[2]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--implementation", action="append",
                        help="default: pallas_mosaic_tpu and xla")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)  # the definition runs in float64
    print(json.dumps({"devices": [d.device_kind for d in jax.devices()],
                      "jax": jax.__version__}), flush=True)
    for name, spec, cu, chunk in CASES:
        a = testlib.inputs(3, **SHAPE, **spec)
        cu = jnp.asarray(cu, jnp.int32)
        for implementation in args.implementation or ("pallas_mosaic_tpu", "xla"):
            record = dict(case=name, impl=implementation)
            try:
                record["rel_l2"] = errors(implementation, a, cu, chunk)
                record["ok"] = max(record["rel_l2"].values()) <= testlib.REL_L2
            except Exception as err:  # a refusal or a compiler's error, recorded
                record["error"] = f"{type(err).__name__}: {err}"[:800]
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
