"""Process plumbing: the command line, JAX's distributed runtime, leader-first steps, atomic files."""
