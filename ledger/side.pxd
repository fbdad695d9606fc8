# Cython declarations for ledger/side.py: see indexes.pxd. The completion rule and a map's own consistency
# rule are called from the fold as C functions (cimported in fold.pxd), and read the side and the map as
# C structs (ledger/structs.pxd).

cimport cython

from kvledger.ledger.structs cimport Map
from kvledger.ledger.structs cimport TransferState as Side

cpdef object completed_by(Side t)
@cython.locals(m=Map)
cpdef object due_at(Side t)
cpdef object layers_mask(tuple layers)
cdef unsigned long long _ONE
cdef unsigned long long _M1, _M2, _M4, _H01, _MASK64

@cython.locals(x=cython.ulonglong)
cpdef int count64(unsigned long long mask) except? -1

@cython.locals(mask=cython.ulonglong, item=object, layer=cython.long)
cpdef unsigned long long low_layers_mask(tuple layers) except? 0
cpdef bint local_exceeds_remote(Map m) except -1

@cython.locals(side=Side, t=Side, out=list)
cpdef list copies(object sides)
@cython.locals(t=Side, i=Py_ssize_t)
cpdef list wide_masks(list sides, Py_ssize_t bits_max)
@cython.locals(t=Side, m=Map, i=Py_ssize_t, keys_of=object)
cpdef dict requests_of(list keys, list sides)
