import sys
from fnebm.cli import main
sys.exit(main())
