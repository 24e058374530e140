"""Profiling models into memsched problems (measured chains and graphs)."""
