"""Test and demo scaffolding: the rank launcher, the toy Megatron GPT and its CPU shim, the S3 server and
fault proxy, shared test fixtures and the backend conformance suite.

The library (``ckptd.client``, ``ckptd.daemon``, ``ckptd.writer``) never imports this package; tests,
benchmarks and ``ckptd demo`` do.
"""
