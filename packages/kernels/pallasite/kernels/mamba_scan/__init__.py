"""mamba_chunk_scan: the whole Mamba-2 scan (dt processing, D, z, packed sequences) on
the SSD kernels of pallasite.kernels.ssd."""

from pallasite.kernels.mamba_scan.api import mamba_chunk_scan

__all__ = ["mamba_chunk_scan"]
