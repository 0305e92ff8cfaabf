"""Audit a qstore snapshot: a thin spark-submit entry point for qstore.spark.audit.

    spark-submit --master spark://host:7077 spark/audit.py /shared/snap [--out DIR]

The session comes from spark-submit (its --master and --conf settings); the
checks, outputs and exit codes are those of `qstore audit` (docs/spark.md).
Every executor needs `pip install "qstore[spark]"` and the snapshot at the
same path.
"""

import sys

from pyspark.sql import SparkSession

from qstore.spark.audit import main

if __name__ == "__main__":
    session = SparkSession.builder.appName("qstore-audit").getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    try:
        code = main(spark=session)
    finally:
        session.stop()
    sys.exit(code)
