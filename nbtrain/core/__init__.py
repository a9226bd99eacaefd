"""Pure decision logic: no threads, no Dask, no torch, no clock reads.

Events go in, decisions come out; the engine and the simulator carry them out.
"""
