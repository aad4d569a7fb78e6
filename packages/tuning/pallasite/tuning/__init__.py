"""pallasite.tuning: block sizes from the caller, tuned tables, an on-disk autotune cache.

Generic: nothing here imports the kernels. See select.select_block_sizes for the order and
docs/tuning.md for the formats.
"""

from pallasite.tuning.autotune import Benchmark, Trial, TuneResult
from pallasite.tuning.cache import autotune_enabled, cache_dir
from pallasite.tuning.configs import config_from_dict, config_to_dict
from pallasite.tuning.select import Selection, device_kind, recording, select_block_sizes
from pallasite.tuning.tables import Table, load_table

__all__ = [
    "Benchmark",
    "Selection",
    "Table",
    "Trial",
    "TuneResult",
    "autotune_enabled",
    "cache_dir",
    "config_from_dict",
    "config_to_dict",
    "device_kind",
    "load_table",
    "recording",
    "select_block_sizes",
]
