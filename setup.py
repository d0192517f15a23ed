"""Build config beside pyproject.toml (setuptools reads both): two small C
extensions, the CPU tier's copy loop and hubchain's loops over its orders.
optional=True: without a compiler the package still installs, the copier
falls back to a ctypes loop (kvoffload/tiers/cpu/copy_cpu.py) and hubchain
to the same loops in Python (kvoffload/policies/hubchain/loops.py).
An editable install (`pip install -e .`) builds it into src/, so it imports
with PYTHONPATH=src too; `python setup.py build_ext --inplace` rebuilds it."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvoffload.tiers.cpu._memcopy", ["src/kvoffload/tiers/cpu/_memcopy.c"],
                             optional=True),
                   Extension("kvoffload.policies.hubchain._hubchain_loops", ["src/kvoffload/policies/hubchain/_hubchain_loops.c"],
                             optional=True)])
