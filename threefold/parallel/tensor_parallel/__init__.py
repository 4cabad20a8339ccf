"""Tensor and sequence parallelism: the TP regions, the parallel layers, vocabulary-parallel
cross-entropy, how parameters are sharded, and the RNG streams dropout needs under TP."""
