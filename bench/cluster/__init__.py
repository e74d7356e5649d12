"""An emulated cluster on one host, for benchmarking the network path.

One Linux network namespace per machine (the coordinator, each worker), each
joined by a veth pair to a bridge that lives in a namespace of its own, every
veth end shaped with ``tc tbf`` so that each machine's link has a fixed rate
in both directions. Nothing is created in the root namespace and no address
is reachable from outside the namespaces.

Modules, one job each: ``params`` (what to run, from the environment),
``plan`` (names and addresses), ``shaping`` (the tbf command lines), ``net``
(creating and removing the namespaces), ``nodes`` (benchmark processes inside
them), ``node`` (the entry point those processes run), ``report`` and
``plot`` (tables and the figure from the JSON).
"""
