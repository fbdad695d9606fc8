# Cython declarations for ledger/indexes.py (compiled by setup.py; the .py is the source and runs as is
# where nothing is compiled). Typed attributes are read and written as C struct fields, cdef methods
# are called as C functions, and a side (`Side`, ledger/structs.pxd) is read as a C struct: what makes the compiled fold faster than the interpreted one.

cimport cython

from kvledger.ledger.side cimport due_at
from kvledger.ledger.structs cimport TransferState as Side


cdef object _note(object seqs, object seq)


cdef class Indexes:
    cdef public dict transfers
    cdef public dict sides_of
    cdef public dict live
    cdef public dict unmapped
    cdef public list deadlines
    cdef public dict held
    cdef public dict contested
    cdef public dict double_owned
    cdef public dict anomalous
    cdef public dict orphans_expired
    cdef public dict expired_producers
    cdef public dict retrying
    cdef public dict sources
    cdef public object decided
    cdef public Py_ssize_t blocks_held
    cdef public dict found_by_code

    @cython.locals(by_id=dict)
    cdef _put_side(self, tuple key, Side t)
    cdef _drop_side(self, tuple key)
    @cython.locals(t=Side)
    cpdef put_sides(self, list sides)
    @cython.locals(t=Side)
    cpdef put_decided(self, list entries, list sides)
    cdef _claim_blocks(self, Side t, tuple key)
    cdef _free_blocks(self, Side t, tuple key)
    @cython.locals(found=dict)
    cdef _found(self, str code)
    cdef _duplicate(self, Side t, object seq)
    cdef _late(self, Side t, object seq)
    cdef _refused_map(self, Side t, object seq, object request_id)
    cdef _over_ack(self, Side t, object seq)
    cdef _push_deadline(self, object deadline, object map_seq, Side t)
    @cython.locals(kept=list, d=tuple, t=Side)
    cdef _sweep_deadlines(self)
    @cython.locals(heap=list, sides_of=dict, by_id=dict, t=Side)
    cpdef put_deadlines(self, list entries)
