"""The balls-in-bins (random allocation) accountant and its bounds, one module each.

``balls_in_bins`` (the accountant and its methods), ``bin_gram`` (the bins' Gram matrix of the
dominating pair), ``rdp`` (Renyi divergences of the pair), ``hockey_stick`` (direct hockey-stick
bounds) and ``monte_carlo`` (the estimate, with confidence bounds).
"""
