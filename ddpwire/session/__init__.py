"""The session: who takes part and what each step does. Admission, the
roster, membership, balancing, options, the Coordinator and the Worker."""
