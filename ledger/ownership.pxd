# Cython declarations for ledger/ownership.py (see indexes.pxd): the merge's per-map and per-release loop
# runs as C methods on C-typed dicts (each block's lookup, set and delete a C dict call), reading each claim
# and release as a C struct (ledger/structs.pxd).

cimport cython

from kvledger.ledger.structs cimport Claim, Free


cdef class Ownership:
    cdef public dict held
    cdef public dict sides
    cdef public dict double_owned

    @cython.locals(n_frees=Py_ssize_t, j=Py_ssize_t, at=Py_ssize_t, claim=Claim, free=Free)
    cpdef feed(self, list claims, list frees)
    @cython.locals(key=tuple, held=dict, holder=object, block=object, blocks=tuple)
    cdef _claim(self, Claim c)
    @cython.locals(key=tuple, held=dict, holder=object, block=object, claim=Claim, blocks=tuple)
    cdef _free(self, Free r)
    cpdef list findings(self)
