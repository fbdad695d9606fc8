# Cython declarations for ledger/side.py: see indexes.pxd. The completion rule is called from the
# fold as a C function (cimported in fold.pxd).

cpdef object completed_by(object t)
cpdef object layers_mask(tuple layers)
