"""Native kernels: their C++ sources (`csrc/`), the build and the ops it registers
(`build.py`), which path each CPU takes (`cpu_paths.py`), huge pages for the KV cache
(`hugepages.py`).

Imports only `settings` of the package.
"""
