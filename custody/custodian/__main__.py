import sys

from custody.custodian.main import main

sys.exit(main(sys.argv[1:]))
