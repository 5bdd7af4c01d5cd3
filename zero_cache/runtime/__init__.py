"""Doing: the copy streams and the step's timeline, the host worker's job queue, data-parallel sharding and its
collectives, gathered params (prefetch along the trace, Belady's eviction), the exchange that drives them from the
module's hooks, the measured rates, and the native extensions' loader.

This ``__init__`` imports nothing.
"""
