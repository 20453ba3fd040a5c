"""kvcore: line-rate KV-cache movement between GPU and host memory for serving engines."""

__version__ = "0.1.0"
