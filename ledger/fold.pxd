# Cython declarations for ledger/fold.py: see indexes.pxd. The handlers are C functions `apply` calls
# after a chain of type tests; events are read as C structs (ledger/structs.pxd): `envelope`, the fields
# every event has, and each handler's own kind.

cimport cython

from kvledger.ledger.side cimport completed_by, count64, layers_mask, local_exceeds_remote, low_layers_mask
from kvledger.ledger.structs cimport _Envelope, Ack, Expire, Fail, Map, Schedule, Seal
from kvledger.ledger.structs cimport TransferState as Side
from kvledger.ledger.upkeep cimport Upkeep


cdef bint COMPILED  # a C flag, read without a module lookup where `apply` picks how to take a layer mask


cdef class Fold(Upkeep):
    cdef public dict releases_by_cause
    cdef public dict forged_by_reason
    cdef public dict lease_counts
    cdef public object forged_recent
    cdef public dict layer_masks

    @cython.locals(
        t=Side, key=tuple, by_id=dict, mask=cython.ulonglong, acked=cython.ulonglong, scheduled=cython.ulonglong,
        envelope=_Envelope, ack=Ack, schedule=Schedule, first_try=bint
    )
    cpdef apply(self, object event)
    cdef _after_close(self, Side t, object event)
    cdef _on_drop(self, object e)
    cdef _first_sight(self, object event)
    cdef _first_map(self, tuple key, Map e)
    @cython.locals(blocks=tuple, held=set, before=Py_ssize_t, i=Py_ssize_t, j=Py_ssize_t)
    cdef _hold(self, Side t, tuple key, Map e, object deadline)
    cdef _on_map(self, Side t, Map e)
    cdef _on_schedule(self, Side t, Schedule e)
    cdef _on_seal(self, Side t, Seal e)
    cdef _on_ack(self, Side t, Ack e)
    cdef _on_lease(self, Side t, Ack e)
    cdef _on_fail(self, Side t, Fail e)
    cdef _on_expire(self, Side t, Expire e)
    cdef _ack_layers(self, Side t, Ack e)
    cdef _mask_of(self, tuple layers)
    cdef _adopt_early_acks(self, Side t)
    cdef _check_complete(self, Side t, object seq, object ts)
    @cython.locals(blocks=tuple, held=set, m=Map)
    cdef _decide(self, Side t, object cause, object seq, object ts, object reason, object why)


cpdef apply_all(Fold state, object events, list out)
