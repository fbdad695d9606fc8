# Cython declarations for ledger/fold.py: see indexes.pxd. The handlers are `cpdef` (the `_handlers`
# table holds them as Python callables), called from C; their events are read as C structs too
# (ledger/structs.pxd).

cimport cython

from ledger.side cimport completed_by, layers_mask
from ledger.structs cimport Ack, Expire, Fail, Map, Schedule, Seal
from ledger.structs cimport TransferState as Side
from ledger.upkeep cimport Upkeep


cdef class Fold(Upkeep):
    cdef public dict releases_by_cause
    cdef public dict forged_by_reason
    cdef public dict lease_counts
    cdef public object forged_recent
    cdef public dict layer_masks
    cdef public dict _handlers

    @cython.locals(t=Side, key=tuple, mask=object, acked=object)
    cpdef apply(self, object event)
    cdef _after_close(self, Side t, object event)
    cdef _on_drop(self, object e)
    cdef _first_sight(self, object event)
    cdef _first_map(self, tuple key, Map e)
    cdef _hold(self, Side t, tuple key, Map e, object deadline)
    cpdef _on_map(self, Side t, Map e)
    cpdef _on_schedule(self, Side t, Schedule e)
    cpdef _on_seal(self, Side t, Seal e)
    cpdef _on_ack(self, Side t, Ack e)
    cdef _on_lease(self, Side t, Ack e)
    cpdef _on_fail(self, Side t, Fail e)
    cpdef _on_expire(self, Side t, Expire e)
    cdef _ack_layers(self, Side t, Ack e)
    cdef _mask_of(self, tuple layers)
    cdef _adopt_early_acks(self, Side t)
    cdef _check_complete(self, Side t, object seq, object ts)
    cdef _decide(self, Side t, object cause, object seq, object ts, object reason, object why)
