from setuptools import setup  # metadata lives in pyproject.toml; this adds the CFFI build

setup(cffi_modules=["cext/build_cpu_adam.py:ffibuilder"])
