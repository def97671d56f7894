"""Checkpoint pickles: the allowlisting unpickler, torch-free stand-ins for the torch globals
they reference, and pickling references to classes we do not import."""
