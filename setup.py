"""Build config beside pyproject.toml (setuptools reads both): the CPU tier's
copy extension. optional=True: without a compiler the package still installs,
and the copier falls back to a ctypes loop (kvoffload/tiers/cpu/copy_cpu.py).
An editable install (`pip install -e .`) builds it into src/, so it imports
with PYTHONPATH=src too; `python setup.py build_ext --inplace` rebuilds it."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvoffload.tiers.cpu._memcopy", ["src/kvoffload/tiers/cpu/_memcopy.c"],
                             optional=True)])
