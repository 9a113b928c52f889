"""Build hook for kvflow's one compiled module; all metadata lives in pyproject.toml.

``kvflow.router._blockmap`` is optional: where no C compiler is available the
install still succeeds and :mod:`kvflow.router.index` uses the pure-Python
``_blockmap_py`` with the same behaviour.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvflow.router._blockmap", ["kvflow/router/_blockmap.c"], optional=True,
              extra_compile_args=["-O2"]),
])
