"""Performance benchmarks of torchTensorRef (not part of the installed package); see docs/benchmarks/."""
