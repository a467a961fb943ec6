"""buzz-broker's daemon: everything that is not a secret.

See docs/internals.md for the seams between the modules. Nothing in this package holds,
logs or returns a secret key, a K_c, a PIN or a credential in clear; the only code that
sees a secret key is the `custody` package.
"""
