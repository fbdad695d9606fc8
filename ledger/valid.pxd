# Cython declarations for ledger/valid.py (see indexes.pxd): the JSONL reader's chunk check reads each
# event's fields as C struct members (ledger/structs.pxd) and its numbers as C values. Converting an
# integer past 64 bits to `long long` raises OverflowError: `_each_fits` answers False then.

cimport cython

from kvledger.ledger.structs cimport Ack, Map, Schedule, Seal


cdef long long _INT64_MIN, _INT64_MAX
cdef double _TS_MAX
cdef Py_ssize_t _SOURCE_CHARS_MAX, _TRANSFER_ID_CHARS_MAX

@cython.locals(a=Ack, s=Schedule, m=Map, seal=Seal)
cpdef bint _each_fits(list events) except -1
cdef bint _envelope_fits(long long seq, double ts, str source, str transfer_id) except -1
cdef bint _time_fits(double value) noexcept
cdef bint _int_fits(long long value) noexcept
@cython.locals(value=object)
cdef bint _ints_fit(tuple values) except -1
