"""Profiling a live endpoint: the engine's own profiler, the trace's analysis and advice."""
