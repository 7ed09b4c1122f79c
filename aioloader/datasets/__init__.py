"""What a sample is and where its bytes lie."""

from .base import Dataset
from .files import Files

__all__ = ["Dataset", "Files"]
