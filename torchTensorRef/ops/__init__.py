"""Op interception: what happens to each aten op that reaches a TensorRef."""
