"""The one training loop and what it needs: steps, evaluation, metrics, checkpoints."""
