# Cython declarations for ledger/fold.py: see indexes.pxd. The handlers are `cpdef` (the `_handlers`
# table holds them as Python callables) called from C.

from ledger.side cimport completed_by, layers_mask
from ledger.upkeep cimport Upkeep


cdef class Fold(Upkeep):
    cdef public dict releases_by_cause
    cdef public dict forged_by_reason
    cdef public dict lease_counts
    cdef public object forged_recent
    cdef public dict layer_masks
    cdef public dict _handlers

    cdef _after_close(self, object t, object event)
    cdef _on_drop(self, object e)
    cdef _first_sight(self, object event)
    cdef _first_map(self, tuple key, object e)
    cdef _hold(self, object t, tuple key, object e, object deadline)
    cpdef _on_map(self, object t, object e)
    cpdef _on_schedule(self, object t, object e)
    cpdef _on_seal(self, object t, object e)
    cpdef _on_ack(self, object t, object e)
    cdef _on_lease(self, object t, object e)
    cpdef _on_fail(self, object t, object e)
    cpdef _on_expire(self, object t, object e)
    cdef _ack_layers(self, object t, object e)
    cdef _mask_of(self, tuple layers)
    cdef _adopt_early_acks(self, object t)
    cdef _check_complete(self, object t, object seq, object ts)
    cdef _decide(self, object t, object cause, object seq, object ts, object reason, object why)
