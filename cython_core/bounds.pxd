# Types of poseidon_plugin/search/bounds.py, compiled as poseidon_plugin._core.bounds. Only the module's
# constant is typed: its functions and their closures run as compiled Python on lists and floats
# (about 1.5x the interpreter on the positional bound), the same results (tests/unit/test_search_backends.py).
cdef double INF
