"""`python -m composer_replication` == the `composer-replication` command."""

import sys

from composer_replication.cli import main

if __name__ == "__main__":
    sys.exit(main())
