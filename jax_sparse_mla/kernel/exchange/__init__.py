"""The push exchange's own kernels (the query gather and the merge), in CuTe DSL."""
