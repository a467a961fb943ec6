"""Security review tests: each xfail(strict) names a finding of the custody review; the plain
tests pin down properties that were checked and hold (regressions guard them)."""
