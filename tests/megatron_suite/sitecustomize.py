"""Applies the CPU mapping of ``megatron_suite_cpu`` in every Python process a suite rank starts
(``run.py`` puts this folder first on ``PYTHONPATH`` and sets ``MEGATRON_SUITE_OUT``); nothing otherwise."""

import os

if os.environ.get("MEGATRON_SUITE_OUT"):
    import megatron_suite_cpu  # noqa: F401
