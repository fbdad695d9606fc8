# Cython declarations for ledger/idmemory.py (see indexes.pxd): the memory is a final extension type, so the
# fold calls `add` and `contains` as C functions.

cimport cython


@cython.final
cdef class IdMemory:
    cdef public dict by_source
    cdef public Py_ssize_t added

    @cython.locals(ids=set, before=Py_ssize_t)
    cpdef add(self, str source, str transfer_id)
    @cython.locals(ids=set)
    cpdef bint contains(self, str source, str transfer_id) except -1
