import sys

from nagmoe.cli import main

sys.exit(main())
