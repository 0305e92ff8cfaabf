"""spark-submit entry point of the backfill job (the work is in qstore.spark.backfill).

    spark-submit --master spark://host:7077 spark/backfill.py SOURCE --queue NAME \
        --payload-col body --into /shared/store [--format parquet|json|csv] ...

Every executor needs the qstore package installed and the store directory on a
filesystem it shares with the driver. See docs/backfill.md.
"""

import sys

from qstore.spark.backfill import main

if __name__ == "__main__":
    sys.exit(main())
