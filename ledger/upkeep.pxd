# Cython declarations for ledger/upkeep.py: see indexes.pxd.

cimport cython

from ledger.idmemory cimport IdMemory
from ledger.indexes cimport Indexes
from ledger.structs cimport TransferState as Side


cdef class Upkeep(Indexes):
    cdef public double side_horizon_s
    cdef public double arrival_lag_s
    cdef public dict tombstones
    cdef public dict tombstones_old
    cdef public double tombstones_newest_ts
    cdef public double tombstones_old_newest_ts
    cdef public dict orphan_tombstones
    cdef public dict orphan_tombstones_old
    cdef public double orphans_newest_ts
    cdef public double orphans_old_newest_ts
    cdef public object id_memory
    cdef public Py_ssize_t tombstones_retired
    cdef public Py_ssize_t orphans_retired
    cdef public double retired_through
    cdef public Py_ssize_t late_after_horizon
    cdef public Py_ssize_t reused_after_horizon
    cdef public Py_ssize_t behind_horizon
    cdef public dict compacted_by_phase
    cdef public dict compacted_by_mode
    cdef public object retired_sides

    @cython.locals(last_ts=double)
    cdef bint _forget(self, tuple key, Side t) except -1
    cdef _retired_upto(self, double newest_ts)
    cdef _tombstone(self, tuple key)
    cdef _recall(self, tuple key, object ts)
    @cython.locals(memory=IdMemory)
    cdef _retired(self, tuple key)
    @cython.locals(memory=IdMemory)
    cdef _retire(self, Side t)
    cdef _after_horizon(self, object event)
