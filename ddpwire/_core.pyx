# cython: language_level=3
"""ddpwire's compiled core: one extension module over every C unit in csrc/.

The C units are linked once, here, so their process-wide state (the SIMD
path and thread count of the kernels) is one state: ``ddpwire.plane.reduce`` and
the socket layer read the same settings. Each source file included below
keeps one job: the codec (_wire.pxi), the kernels (_reduce.pxi), the int8
wire codec (_int8.pxi), the socket layer (_net.pxi) and the shared-memory
allreduce of ranks on one host (_shm.pxi).
"""
from ddpwire.includes.wire cimport *
from ddpwire.includes.reduce cimport *
from ddpwire.includes.int8 cimport *
from ddpwire.includes.net cimport *
from ddpwire.includes.shm cimport *

include "_wire.pxi"
include "_reduce.pxi"
include "_int8.pxi"
include "_net.pxi"
include "_shm.pxi"
