"""Rendezvous: which nodes train together in each round, and who hosts the process-group master."""
