# Cython declarations for ledger/upkeep.py: see indexes.pxd.

cimport cython

from kvledger.ledger.idmemory cimport IdMemory
from kvledger.ledger.indexes cimport Indexes
from kvledger.ledger.structs cimport TransferState as Side


cdef class Upkeep(Indexes):
    cdef public dict tombstones
    cdef public dict tombstones_old
    cdef public object tombstones_max
    cdef public Py_ssize_t tombstones_evicted
    cdef public dict orphan_tombstones
    cdef public dict orphan_tombstones_old
    cdef public object orphan_tombstones_max
    cdef public Py_ssize_t orphans_evicted
    cdef public Py_ssize_t sides_unchecked
    cdef public object id_memory
    cdef public Py_ssize_t late_after_eviction
    cdef public Py_ssize_t reused_after_eviction
    cdef public dict compacted_by_phase
    cdef public dict compacted_by_mode

    @cython.locals(memory=IdMemory)
    cdef bint _forget(self, tuple key, Side t) except -1
    cdef _evict(self, dict generation)
    cdef _tombstone(self, tuple key)
    cdef _recall(self, tuple key, object ts)
    @cython.locals(memory=IdMemory)
    cdef bint _remembered(self, tuple key) except -1
    cdef _after_eviction(self, object event)
