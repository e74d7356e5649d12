"""The data plane: moving and reducing vectors. Plans, the mesh and its
steps, the star's step, shared memory, the collective service, rank and
point-to-point links. It knows steps, not who takes part in them."""
