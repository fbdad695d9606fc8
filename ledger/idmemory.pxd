# Cython declarations for ledger/idmemory.py (see indexes.pxd): the Bloom filter's bit loops run on 64-bit
# C integers and index the bytearray directly, instead of a Python int operation per step.

cimport cython


@cython.locals(i=Py_ssize_t)
cdef int _set_bits(bytearray bits, unsigned long long position, unsigned long long step,
                   unsigned long long mask, Py_ssize_t hashes) except -1

@cython.locals(i=Py_ssize_t)
cdef bint _has_bits(bytearray bits, unsigned long long position, unsigned long long step,
                    unsigned long long mask, Py_ssize_t hashes) except -1
