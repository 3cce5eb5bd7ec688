from setuptools import setup  # metadata lives in pyproject.toml; this adds the CFFI build

# cext/build_aio.py: the storage tier's I/O engine; it builds with or without liburing/libaio
setup(cffi_modules=["cext/build_cpu_adam.py:ffibuilder", "cext/build_aio.py:ffibuilder"])
