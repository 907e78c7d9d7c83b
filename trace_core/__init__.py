"""TRACE core library: environments, agents and the four pipeline stages as plain Python.

This package never imports prefect or mlflow; orchestration and tracking live in `tasks/` and `flows/`.
Heavy dependencies (torch, transformers, tau2) are imported inside the functions that need them.
"""

__version__ = "0.1.0"
