# The memory layout of the msgspec Structs the compiled fold reads and writes on every event: a side
# (ledger/transfer_state.py) and the events it folds (ledger/events.py), with their envelope (`_Envelope`: what a
# replay reads of an event of any kind); and what a partition tells a `--jobs` merge's block ownership, once per
# map and release of the whole log (ledger/claims.py, read by ledger/ownership.py). Declared, the compiled fold reads and
# writes their fields as C struct members instead of through Python's attribute lookup (most of what the
# compiled fold otherwise spends). Nothing here runs interpreted.
#
# The layout is msgspec's: after the object header, a Struct's base class fields, then its own, each
# sorted by name (CPython sorts a class's slots); every field is one object pointer. `check_size error`
# refuses a class whose size no longer matches at import; ledger/compiled.py checks msgspec still lays
# Structs out this way before it lets the compiled fold load, and tests/ledger/test_both_builds.py that
# these declarations name every field of each class, in memory order.

cdef extern from *:
    """
    typedef struct {
        PyObject_HEAD
        PyObject *acked_mask, *acks_expected, *arrived_seq, *arrived_ts, *closed, *decision,
            *deferrals, *duplicate_seqs, *early_mask, *events, *expected, *first, *last, *late_seqs,
            *lease_until, *leases, *map_event, *mode, *over_ack_seqs, *pending_fail, *phase,
            *ranks_mask, *recv, *retries, *reuse_seqs, *reused_by, *role, *scheduled_mask, *source,
            *transfer_id, *transient_failures, *transient_since, *whole_acked, *whole_scheduled, *window_end;
    } kvledger_TransferState;
    typedef struct {
        PyObject_HEAD
        PyObject *seq, *source, *transfer_id, *ts;
    } kvledger__Envelope;
    typedef struct {
        PyObject_HEAD
        PyObject *seq, *source, *transfer_id, *ts, *acks_expected, *block_groups, *block_ids,
            *deadline, *mode, *peer, *remote_block_groups, *remote_block_ids, *request_id, *role;
    } kvledger_Map;
    typedef struct {
        PyObject_HEAD
        PyObject *seq, *source, *transfer_id, *ts, *attempt, *deferred, *layers, *op;
    } kvledger_Schedule;
    typedef struct {
        PyObject_HEAD
        PyObject *seq, *source, *transfer_id, *ts, *expected;
    } kvledger_Seal;
    typedef struct {
        PyObject_HEAD
        PyObject *seq, *source, *transfer_id, *ts, *layers, *rank, *until, *what;
    } kvledger_Ack;
    typedef struct {
        PyObject_HEAD
        PyObject *seq, *source, *transfer_id, *ts, *code, *reason, *retryable;
    } kvledger_Fail;
    typedef struct {
        PyObject_HEAD
        PyObject *seq, *source, *transfer_id, *ts, *deadline;
    } kvledger_Expire;
    typedef struct {
        PyObject_HEAD
        PyObject *block_ids, *index, *map_seq, *request_id, *source, *transfer_id;
    } kvledger_Claim;
    typedef struct {
        PyObject_HEAD
        PyObject *index, *source, *transfer_id;
    } kvledger_Free;
    """

    ctypedef class kvledger.ledger.transfer_state.TransferState [object kvledger_TransferState, check_size error]:
        cdef object acked_mask
        cdef object acks_expected
        cdef object arrived_seq
        cdef object arrived_ts
        cdef object closed
        cdef object decision
        cdef object deferrals
        cdef object duplicate_seqs
        cdef object early_mask
        cdef object events
        cdef object expected
        cdef object first
        cdef object last
        cdef object late_seqs
        cdef object lease_until
        cdef object leases
        cdef object map_event
        cdef object mode
        cdef object over_ack_seqs
        cdef object pending_fail
        cdef object phase
        cdef object ranks_mask
        cdef object recv
        cdef object retries
        cdef object reuse_seqs
        cdef object reused_by
        cdef object role
        cdef object scheduled_mask
        cdef object source
        cdef object transfer_id
        cdef object transient_failures
        cdef object transient_since
        cdef object whole_acked
        cdef object whole_scheduled
        cdef object window_end

    ctypedef class kvledger.ledger.events._Envelope [object kvledger__Envelope, check_size error]:
        cdef object seq
        cdef object source
        cdef object transfer_id
        cdef object ts

    ctypedef class kvledger.ledger.events.Map [object kvledger_Map, check_size error]:
        cdef object seq
        cdef object source
        cdef object transfer_id
        cdef object ts
        cdef object acks_expected
        cdef object block_groups
        cdef object block_ids
        cdef object deadline
        cdef object mode
        cdef object peer
        cdef object remote_block_groups
        cdef object remote_block_ids
        cdef object request_id
        cdef object role

    ctypedef class kvledger.ledger.events.Schedule [object kvledger_Schedule, check_size error]:
        cdef object seq
        cdef object source
        cdef object transfer_id
        cdef object ts
        cdef object attempt
        cdef object deferred
        cdef object layers
        cdef object op

    ctypedef class kvledger.ledger.events.Seal [object kvledger_Seal, check_size error]:
        cdef object seq
        cdef object source
        cdef object transfer_id
        cdef object ts
        cdef object expected

    ctypedef class kvledger.ledger.events.Ack [object kvledger_Ack, check_size error]:
        cdef object seq
        cdef object source
        cdef object transfer_id
        cdef object ts
        cdef object layers
        cdef object rank
        cdef object until
        cdef object what

    ctypedef class kvledger.ledger.events.Fail [object kvledger_Fail, check_size error]:
        cdef object seq
        cdef object source
        cdef object transfer_id
        cdef object ts
        cdef object code
        cdef object reason
        cdef object retryable

    ctypedef class kvledger.ledger.events.Expire [object kvledger_Expire, check_size error]:
        cdef object seq
        cdef object source
        cdef object transfer_id
        cdef object ts
        cdef object deadline

    ctypedef class kvledger.ledger.claims.Claim [object kvledger_Claim, check_size error]:
        cdef object block_ids
        cdef object index
        cdef object map_seq
        cdef object request_id
        cdef object source
        cdef object transfer_id

    ctypedef class kvledger.ledger.claims.Free [object kvledger_Free, check_size error]:
        cdef object index
        cdef object source
        cdef object transfer_id
