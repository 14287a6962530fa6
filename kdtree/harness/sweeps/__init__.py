"""Kernel sweeps: each writes one Parquet of rows with provenance, resumable point by point."""
