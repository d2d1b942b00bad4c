"""Opacus peer for benchmarks/opacus_epsilon.py; runs in ../peer-opacus's interpreter, never imported.

    ../peer-opacus/bin/python benchmarks/peers/opacus_accountant.py '[[1.0, 0.001, 9380, 1e-5]]'

For each (noise multiplier, sample rate, steps, delta) prints, as one JSON list, the epsilon
that Opacus' PRV accountant (its default) and its RDP accountant report after that many steps
of its Poisson-subsampled Gaussian, and Opacus' version.
"""

import json
import sys


def main() -> int:
    import opacus
    from opacus.accountants import PRVAccountant, RDPAccountant

    results = []
    for sigma, rate, steps, delta in json.loads(sys.argv[1]):
        row = {}
        for name, kind in (("prv", PRVAccountant), ("rdp", RDPAccountant)):
            accountant = kind()
            accountant.history = [(float(sigma), float(rate), int(steps))]  # steps identical steps
            row[name] = float(accountant.get_epsilon(delta=float(delta)))
        results.append(row)
    print(json.dumps({"version": opacus.__version__, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
