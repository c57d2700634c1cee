"""specbook: speculative decoding from the roofline to confidence-scheduled verification."""

__version__ = "0.1.0"
