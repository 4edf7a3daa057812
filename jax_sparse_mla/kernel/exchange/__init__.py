"""The push exchange's own kernel (the owners' merge), in CuTe DSL."""
