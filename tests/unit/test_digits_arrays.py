"""The bundled digits read from scikit-learn's file without importing scikit-learn (its import
loads SciPy: ~0.9 s of CPU in every rank) are exactly what ``load_digits`` returns, and a run's
data fingerprint stays the one recorded by earlier versions."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from pimm_core.data.loaders import digits, digits_arrays


def test_the_same_arrays_as_load_digits():
    from sklearn.datasets import load_digits

    data, target = digits_arrays()
    want_data, want_target = load_digits(return_X_y=True)
    assert data.dtype == want_data.dtype and data.shape == (1797, 64)
    assert np.array_equal(data, want_data) and np.array_equal(target, want_target)


def test_the_fingerprint_recorded_by_checkpoints_is_unchanged():
    # the digits split's fingerprint as pimm recorded it when the data came from load_digits():
    # checkpoints of earlier runs compare against it at resume (a change restarts the epoch)
    assert digits().fingerprint == "cf62cc3b57af8085"


def test_reading_them_imports_no_scikit_learn():
    code = "import sys; from pimm_core.data import digits; digits(); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
