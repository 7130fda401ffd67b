"""The researcher's bench: the routines interpretability work runs every day, on a model trained
here, each through the model's own probes (docs/research.md). One module per routine:
patching (activation and attribution patching sweeps), attribution (direct logit attribution),
probing (linear probes), steering (steering vectors and their hook)."""
