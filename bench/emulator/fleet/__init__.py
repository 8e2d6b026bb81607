"""Emulated engines as one fleet in virtual time (see bench/emulator/__init__.py)."""
