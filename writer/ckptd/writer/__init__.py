"""Storage: the zarr v3 format, array I/O, commit protocol. Imports neither the client nor the daemon."""
