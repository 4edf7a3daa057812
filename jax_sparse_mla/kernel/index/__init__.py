"""The DSA indexer's kernels: FP8 warpgroup-MMA scores and an exact radix top-k (sm_90a).

A family of its own beside the decode kernels: its cubins are fingerprinted by these sources
(and the shared ``kernel/ptx.py``) only, so editing them never invalidates a decode cubin.
"""
