"""Reliability campaigns: kill -9, corruption, metadata fuzzing, racing jobs and the step manager (``python -m tests.reliability``)."""
