# Types of poseidon_plugin/search/assignment.py, compiled as poseidon_plugin._core.assignment.
cimport cython

cdef double NEG_F
cdef double INF

@cython.locals(total=cython.double, g=cython.double, best=cython.double, changed=cython.bint,
               r=cython.int, t=cython.int, a=cython.int, b=cython.int, rnd=cython.int, step=cython.int,
               at=cython.int, ar=cython.int, seen=cython.int)
cpdef double assign_into(int n, int nt, int stride, double[::1] val, int[::1] supply, int[::1] owner,
                         int[::1] used, double[::1] gain, int[::1] via_t, int[::1] via_r) noexcept nogil

@cython.locals(nt=cython.int, m=cython.int, n_t=cython.int, t=cython.int, r=cython.int, total=cython.double,
               val='double[::1]', sup='int[::1]', owner='int[::1]')
cpdef best_assignment(value, supply, int pp)
