"""The emulated engine without a transport (see bench/emulator/__init__.py)."""
