"""Builders and helpers shared by the test directories. A test module imports these, never
another test module or a conftest (tests/test_layout.py)."""
