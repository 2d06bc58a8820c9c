"""HuggingFace transformers adapter (needs the ``hf`` extra)."""
