import sys

from custodian.main import main

sys.exit(main(sys.argv[1:]))
