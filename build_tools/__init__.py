"""Helpers of setup.py (not part of the installed package): where cuda.h is,
which torch the build uses."""
