"""Pure-torch reference backends: clarity first, the ground truth for every fast path."""
