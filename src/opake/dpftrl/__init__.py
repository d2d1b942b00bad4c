"""DP-FTRL with matrix-factorization (correlated) noise."""
