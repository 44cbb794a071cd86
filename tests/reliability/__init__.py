"""Reliability campaigns: kill -9, corruption, metadata fuzzing and racing jobs (``python -m tests.reliability``)."""
