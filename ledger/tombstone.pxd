# Cython declarations for ledger/tombstone.py (see indexes.pxd): compacting a side reads its map as a C
# struct (ledger/structs.pxd) and finds the packer of its block count in a C-typed dict.

cimport cython

from kvledger.ledger.structs cimport Map

cdef dict _PACKERS
cdef Py_ssize_t _PACKERS_MAX

@cython.locals(blocks=tuple)
cpdef compacted(Map m, object decision, object arrived_ts, object arrived_seq, object events)

@cython.locals(packer=object)
cpdef object _packer(Py_ssize_t blocks)
