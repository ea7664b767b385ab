"""peertrain's node agent: everything a training machine runs."""

__version__ = "0.1.0"
