"""Probes of the machine: the kernel calibration (``doctor --speed``, bench) and every graph on fixed inputs."""
