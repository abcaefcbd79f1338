"""Compiling a run's steps for chips this machine does not have: the check, its targets, the bytes."""
