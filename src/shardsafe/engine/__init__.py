"""Execution: run save plans (write, commit) and read plans (ranged reads into targets)."""
