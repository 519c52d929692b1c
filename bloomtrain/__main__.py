import sys

from bloomtrain.cli import main

sys.exit(main())
