"""Model assets and our own Llama-family implementation."""
