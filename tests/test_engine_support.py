"""Checks of the noise-engine tests' helpers (engine_support.py): the hand recipes are float32-exact
and the dense BLT matrix is the one written out by hand."""

from __future__ import annotations

import numpy as np

from engine_support import BLT_CASES, dense_blt_matrix, dense_inverse_apply, hand_blt


def test_hand_recipe_parameters_are_float32_exact():
    for name in BLT_CASES:
        mechanism = hand_blt(name).resolve(8)
        assert np.array_equal(mechanism.omega.astype(np.float32).astype(np.float64), mechanism.omega)
        one_minus_theta = 1.0 - mechanism.theta
        assert np.array_equal(one_minus_theta.astype(np.float32).astype(np.float64), one_minus_theta)


def test_dense_matrix_small_case_by_hand():
    # One buffer, omega = 0.5, theta = 0.75: c = 1, 0.5, 0.375, 0.28125.
    matrix = dense_blt_matrix([0.5], [0.25], 4)
    assert matrix[:, 0].tolist() == [1.0, 0.5, 0.375, 0.28125]
    assert matrix[3, 1] == 0.375 and matrix[0, 1] == 0.0
    # C^{-1} C = I.
    assert np.allclose(dense_inverse_apply(matrix, matrix), np.eye(4), atol=1e-15)
