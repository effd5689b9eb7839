"""Exit codes a worker uses to tell the agent why it stopped; torch-free, for the agent."""

PREEMPTED_EXIT_CODE = 75
"""Saved a checkpoint and stopped on request (EX_TEMPFAIL): requeue it, not a failure."""
