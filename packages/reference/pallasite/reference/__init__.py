"""pallasite.reference: the plain-JAX oracles every kernel is held to, and falls back to.

Modules (import the one you need; this file stays import-light):
- `grouped_projection`: MoE ragged matmul oracle (ragged_dot form and per-group form),
  its validation, and the fp32 `gmm_reference` / `tgmm_reference` building blocks.
- `ssd`: Mamba-2 SSD oracles (sequential recurrence, chunked and blockwise forms), segsum,
  validation, and the chunk layout helpers.
- `parity`: error statistics, per-dtype tolerances and the shape/dtype grid runner.
- `inputs`: seeded input generators shared by tests and the benchmark.

No Pallas in this package.
"""
