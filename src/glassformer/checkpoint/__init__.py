"""glassformer.checkpoint: folders.py (checkpoint and run folders, pointers, pruning), builder.py
(the one model builder from a config and a state dict), training.py (training state),
loading.py (`load`: native or Hugging Face folders), hub.py (Hugging Face Hub names, inside
folders.resolve).

Nothing is imported here, so importing one submodule (convert.hf needs builder) never runs
the others (loading needs convert.hf): no cycle through this package."""
