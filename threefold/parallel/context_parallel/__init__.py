"""Context parallelism: each sample's sequence split over the CP ranks (sequence.py), and the
attention that lets every token see the earlier tokens other ranks hold (attention.py)."""
