import sys

from nxops.measure import main

sys.exit(main())
