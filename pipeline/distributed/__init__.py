"""The distributed runtime: which launcher started us, the process group and mesh, liveness, the flat collectives."""
