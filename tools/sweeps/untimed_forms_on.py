"""A pytest plugin that switches on every kernel form built but not yet timed on a GPU
(each a module flag, off by default), so that the GPU tests compile and check them:

    PYTHONPATH=<the four package roots>:packages/kernels/tests:tools/sweeps \\
        python3 -m pytest -p untimed_forms_on -m gpu <test files>

Flipping one of these defaults after it is timed removes it from here."""

from pallasite.kernels.gated_delta import pallas_triton as gated_delta_forward
from pallasite.kernels.gated_delta import pallas_triton_bwd as gated_delta_backward
from pallasite.kernels.quantization import pallas_triton as quantizers
from pallasite.kernels.ssd import pallas_triton as ssd

gated_delta_forward.SOLVE_ROWS_LOADED = True
gated_delta_forward.MOSAIC_GPU_STATE_PASS = True
gated_delta_backward.DG_SPANS_IN_BF16_PIECES = True
quantizers.NARROW_AMAX = True
ssd.BWD_ROWS_NUM_STAGES = 1
