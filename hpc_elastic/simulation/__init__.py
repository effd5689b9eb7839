"""Deterministic simulation of the control plane (issue 11); see world.py and
docs/reliability.md."""
