"""Training: parameter checkpoints (more modules arrive with the trainer)."""
