"""Build the compiled core: one extension module, ddpwire._core, linking every
C unit in csrc/ once (so process-wide C state really is process-wide).

Wheels must stay portable, so nothing here targets the build machine's CPU
(no -march=native); faster instruction sets are chosen at run time in C.
"""
import glob
import hashlib
import os
import sys
import tempfile

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

# every C unit, linked once into ddpwire._core
C_SOURCES = ["csrc/wire.c", "csrc/reduce.c", "csrc/int8.c", "csrc/link.c", "csrc/sealed.c", "csrc/aead.c",
             "csrc/net.c", "csrc/threaded.c", "csrc/sender.c", "csrc/wake.c", "csrc/shm.c"]
# aead.c loads libcrypto with dlopen, which glibc before 2.34 keeps in libdl
LIBRARIES = ["dl"] if sys.platform.startswith("linux") else []

extra_compile_args = []
extra_link_args = []
if sys.platform != "win32":
    # no fused multiply-adds: the int8 codec's decode-and-sum must round each
    # product, as torch and numpy do, on every CPU (aarch64 included)
    extra_compile_args += ["-O3", "-Wall", "-Wextra", "-ffp-contract=off"]
    # DDPWIRE_SANITIZE=1 builds with AddressSanitizer and UBSan for the test
    # suite; DDPWIRE_SANITIZE=thread with ThreadSanitizer, for the coordinator's
    # socket threads (csrc/threaded.c).
    sanitize = os.environ.get("DDPWIRE_SANITIZE")
    if sanitize:
        kinds = "thread" if sanitize == "thread" else "address,undefined"
        san = [f"-fsanitize={kinds}", "-fno-omit-frame-pointer", "-g", "-O1"]
        extra_compile_args += san
        extra_link_args += san
    elif not os.environ.get("DDPWIRE_DEBUG"):
        # Release builds ship without debug info: it tripled the wheel's size.
        # DDPWIRE_DEBUG=1 keeps it for a debugger.
        extra_compile_args += ["-g0"]
        extra_link_args += ["-Wl,-S,-x"] if sys.platform == "darwin" else ["-s"]

# Intermediate objects go outside the source tree, so that `pip wheel .` or
# `python -m build` leave no build/ behind; the path is stable per checkout so
# `build_ext --inplace` stays incremental. `--build-base` still overrides it.
_BUILD_BASE = os.path.join(
    tempfile.gettempdir(),
    "ddpwire-build-" + hashlib.sha256(os.path.abspath(os.path.dirname(__file__) or ".").encode()).hexdigest()[:12],
)

extensions = [
    Extension(
        "ddpwire._core",
        ["ddpwire/_core.pyx", *C_SOURCES],
        include_dirs=["csrc", numpy.get_include()],
        # the headers and the tables (messages.def, codes.def) every unit
        # includes: a change to one rebuilds the module
        depends=sorted(glob.glob("csrc/*.h")) + sorted(glob.glob("csrc/*.def")),
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
        libraries=LIBRARIES,
    )
]

setup(
    options={"build": {"build_base": _BUILD_BASE}},
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
    ),
)
