"""Real clients: unmodified models run under torchTensorRef, checked against plain torch."""
