"""pipefill: a reverse proxy for SGLang that keeps each backend at its knee."""

__version__ = "0.1.0"
