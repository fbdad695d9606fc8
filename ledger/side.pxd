# Cython declarations for ledger/side.py: see indexes.pxd. The completion rule is called from the
# fold as a C function (cimported in fold.pxd), and so is a map's own consistency rule (its map read as
# an object: ledger/structs.pxd declares this module's TransferState, and cimporting it here would import
# this module while it initialises).

cpdef object completed_by(object t)
cpdef object layers_mask(tuple layers)
cpdef bint local_exceeds_remote(object m) except -1
