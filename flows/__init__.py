"""Prefect flows: composition only. A flow body is the sequence of stage tasks, in order."""
