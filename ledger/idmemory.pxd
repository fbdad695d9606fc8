# Cython declarations for ledger/idmemory.py (see indexes.pxd): the key hash and the Bloom filter's bit loops
# run on 64-bit C integers (wrapping at 2**64, which is what the source's masks compute interpreted) and
# index the bytearray directly; the memory is a final extension type, so the fold calls `add` and
# `contains` as C functions.

cimport cython

cdef unsigned long long _FNV_OFFSET
cdef unsigned long long _FNV_PRIME
cdef unsigned long long _MASK64
cdef unsigned long long _FMIX_FIRST
cdef unsigned long long _FMIX_SECOND
cdef unsigned long long _STEP_SALT

cpdef unsigned long long fmix64(unsigned long long h)

@cython.locals(h=cython.ulonglong, ch=Py_UCS4)
cpdef unsigned long long key_hash(str source, str transfer_id)

cpdef unsigned long long step_of(unsigned long long h)


@cython.final
cdef class IdMemory:
    cdef public Py_ssize_t generation_ids
    cdef public Py_ssize_t generations
    cdef public Py_ssize_t hashes
    cdef public unsigned long long mask
    cdef public bytearray current
    cdef public Py_ssize_t count
    cdef public object older
    cdef public Py_ssize_t added

    @cython.locals(position=cython.ulonglong)
    cpdef add(self, str source, str transfer_id)
    @cython.locals(position=cython.ulonglong, step=cython.ulonglong, bits=bytearray)
    cpdef bint contains(self, str source, str transfer_id) except -1


@cython.locals(i=Py_ssize_t)
cdef int _set_bits(bytearray bits, unsigned long long position, unsigned long long step,
                   unsigned long long mask, Py_ssize_t hashes) except -1

@cython.locals(i=Py_ssize_t)
cdef bint _has_bits(bytearray bits, unsigned long long position, unsigned long long step,
                    unsigned long long mask, Py_ssize_t hashes) except -1
