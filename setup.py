"""Build the compiled core: each ddpwire/_<unit>.pyx links the C unit csrc/<unit>.c.

Wheels must stay portable, so nothing here targets the build machine's CPU
(no -march=native); faster instruction sets are chosen at run time in C.
"""
import os
import sys

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

# unit name -> C sources it links (besides its .pyx)
UNITS = {
    "_wire": ["csrc/wire.c"],
    "_reduce": ["csrc/reduce.c"],
    # the socket layer parses frame heads and reduces as bytes arrive
    "_net": ["csrc/net.c", "csrc/threaded.c", "csrc/sender.c", "csrc/wake.c", "csrc/wire.c",
             "csrc/reduce.c"],
}

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
        f"ddpwire.{unit}",
        [f"ddpwire/{unit}.pyx", *sources],
        include_dirs=["csrc", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
    )
    for unit, sources in UNITS.items()
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
    ),
)
