"""Build the compiled core: one extension module, ddpwire._core, linking every
C unit in csrc/ once (so process-wide C state really is process-wide).

Wheels must stay portable, so nothing here targets the build machine's CPU
(no -march=native); faster instruction sets are chosen at run time in C.
"""
import os
import sys

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

# every C unit, linked once into ddpwire._core
C_SOURCES = ["csrc/wire.c", "csrc/reduce.c", "csrc/net.c", "csrc/threaded.c", "csrc/sender.c",
             "csrc/wake.c"]

extra_compile_args = []
extra_link_args = []
if sys.platform != "win32":
    extra_compile_args += ["-O3", "-Wall", "-Wextra"]
    # DDPWIRE_SANITIZE=1 builds with AddressSanitizer and UBSan for the test
    # suite; DDPWIRE_SANITIZE=thread with ThreadSanitizer, for the coordinator's
    # socket threads (csrc/threaded.c).
    sanitize = os.environ.get("DDPWIRE_SANITIZE")
    if sanitize:
        kinds = "thread" if sanitize == "thread" else "address,undefined"
        san = [f"-fsanitize={kinds}", "-fno-omit-frame-pointer", "-g", "-O1"]
        extra_compile_args += san
        extra_link_args += san

extensions = [
    Extension(
        "ddpwire._core",
        ["ddpwire/_core.pyx", *C_SOURCES],
        include_dirs=["csrc", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
    )
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
    ),
)
