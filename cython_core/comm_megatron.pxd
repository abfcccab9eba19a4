# Types of poseidon_plugin/simulator/comm_megatron.py, compiled as poseidon_plugin._core.comm_megatron:
# C integers for the loop counters of the rank programs (graph.build_graph uses the compiled module). The
# graph walk itself, build_programs, holds closures, which Cython does not type in a cpdef function: it
# is compiled as Python code (1.3-1.6x faster than interpreted, measured).
cimport cython

cdef int COMPUTE, POST, WAIT

@cython.locals(first=cython.bint, last=cython.bint, warmup=cython.int, steady=cython.int, i=cython.int)
cpdef program_1f1b(int pp, int micro_batches, int rank)

@cython.locals(last_rank=cython.bint, k=cython.int, fk=cython.int)
cpdef program_interleaved(int pp, int micro_batches, int v, int rank)

@cython.locals(last_rank=cython.bint, k=cython.int, fk=cython.int)
cpdef program_interleaved_overlap(int pp, int micro_batches, int v, int rank)
