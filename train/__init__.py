"""Training and evaluation tools (PyTorch). Not part of the runtime: nothing under ``runtime/`` or
``model/`` imports this package, the corpus and the acceptance protocol live in ``model.corpus`` (no PyTorch)."""
