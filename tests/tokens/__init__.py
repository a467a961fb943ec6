"""PKCS#11 tokens other than the main suite's SoftHSM2: started from a script, no hardware.

`kinds.py` starts each kind; `with-token KIND -- COMMAND…` runs a command against one;
`test_mechanisms.py` records what each token offers and asserts the field lab's table.
"""
