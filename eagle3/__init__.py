"""eagle3: EAGLE-3 speculative decoding in plain PyTorch."""
__version__ = "0.1.0"
