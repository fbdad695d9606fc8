# Cython declarations for ledger/upkeep.py: see indexes.pxd.

cimport cython

from kvledger.ledger.indexes cimport Indexes
from kvledger.ledger.structs cimport TransferState as Side


cdef class Upkeep(Indexes):
    cdef public dict tombstones
    cdef public dict orphan_tombstones
    cdef public list retire_queue
    cdef public double retired_through
    cdef public double arrival_lag_s
    cdef public Py_ssize_t behind_horizon
    cdef public Py_ssize_t unstamped_held
    cdef public dict past_window
    cdef public dict settled
    cdef public dict compacted_by_phase
    cdef public dict compacted_by_mode

    cdef bint _premature_pair(self, tuple key) except -1
    cdef bint _forget(self, tuple key, Side t) except -1
    cdef _tombstone(self, tuple key)
    cdef _recall(self, tuple key, object ts)
    cdef _past_window(self, object event, double window_end)
