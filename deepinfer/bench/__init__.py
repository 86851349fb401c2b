"""Benchmarks: offline throughput, serving load, the per-user vs per-chip Pareto sweep, and peers run
side by side (``deepinfer bench offline|serve|pareto|peer``)."""
