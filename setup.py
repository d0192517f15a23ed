"""Build config beside pyproject.toml (setuptools reads both): two small C
extensions, the CPU tier's copy loop and hubchain's loops over its orders
(one module, compiled from the five _hubchain_loops*.c files).
optional=True: without a compiler the package still installs, the copier
falls back to a ctypes loop (kvoffload/tiers/cpu/copy_cpu.py) and hubchain
to the same loops in Python (kvoffload/policies/hubchain/loops.py).
An editable install (`pip install -e .`) builds it into src/, so it imports
with PYTHONPATH=src too; `python setup.py build_ext --inplace` rebuilds it."""

from setuptools import Extension, setup

HUBCHAIN = "src/kvoffload/policies/hubchain"  # one module from five C files sharing _hubchain_loops.h

setup(ext_modules=[Extension("kvoffload.tiers.cpu._memcopy", ["src/kvoffload/tiers/cpu/_memcopy.c"],
                             optional=True),
                   Extension("kvoffload.policies.hubchain._hubchain_loops",
                             [f"{HUBCHAIN}/_hubchain_loops{part}.c" for part in ("", "_orders", "_merge", "_prefix", "_learning")],
                             depends=[f"{HUBCHAIN}/_hubchain_loops.h"], optional=True)])
