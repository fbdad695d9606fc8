"""A fake `mori` package for tests (mori needs ROCm hardware); only `mori.io` exists, see io.py."""
